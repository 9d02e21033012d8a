"""Rotating a transformer's residual stream and attention heads as a pure tree transform (QuaRot's
offline rotations), the float function unchanged.

A :class:`ResidualLayout` names, by tree path, what touches the residual stream of width ``d``:

* ``embeddings``: ``(vocab, d)`` tables whose rows enter the stream;
* ``norms``: each RMSNorm weight with the linears reading its output (``(out, d)`` weights); the
  final norm reads into the output head;
* ``writers``: linears whose ``(d, in)`` outputs are added to the stream (attention and MLP
  output projections), with their biases;
* ``heads``: value/output projection pairs, for the per-head rotation;
* stacked experts weights of a mixture-of-experts layer (``(experts, out, in)``, their tree paths themselves)
  are readers and writers like any linear, each expert rotated by one batched product: the experts'
  ``gate_up_proj`` reads the stream (``W_e R1``), their ``down_proj`` writes it (``R1ᵀ W_e``, its bias
  ``<path>_bias`` ``b_e R1``); a router is a reader;
* ``transposed``: the readers and writers stored ``(in, out)`` (``(experts, in, out)``: GPT-OSS's experts):
  rotated on the other side (a reader ``R1ᵀ W``, a writer ``W R1``);
* ``down``: the weights of the linears reading the MLP's hidden activation (down projections), where
  an online rotation (``R4``) may go, and ``attention``: the attention modules with their head width,
  whose queries and keys an online rotation (``R3``) may rotate (:mod:`qtransform.rotation.online`).

:func:`rotate` first fuses each norm's weight into the linears it feeds (``W diag(g)``, the norm
left weightless: RMSNorm of ``x R`` is RMSNorm of ``x`` rotated, for an orthogonal ``R``), then
rotates the stream by ``R1``: embeddings and writers' outputs ``E R1``, ``R1ᵀ W``, ``b R1``;
readers' inputs ``W R1``. With ``R2`` each value head's outputs become ``R2ᵀ W_v[h]`` and the
output projection's columns for that head ``W_o[:, h] R2``. Attention scores and the MLP see the
same numbers as before: the rotated, unquantized network computes the original function; its
weights and activations are spread (outliers no longer sit in a few channels), which is what
4-bit quantization then gains from.

>>> import torch
>>> from qtransform.rotation import hadamard
>>> lay = ResidualLayout(embeddings=("emb",), norms=(NormReaders("norm", ("head",)),), writers=())
>>> p = {"emb": torch.randn(10, 4), "norm": torch.rand(4) + 0.5, "head": torch.randn(10, 4)}
>>> r = rotate(p, lay, hadamard(4))
>>> x = p["emb"][3]; xr = r["emb"][3]
>>> def rms(v, g): return v * torch.rsqrt(v.pow(2).mean() + 1e-6) * g
>>> bool(torch.allclose(p["head"] @ rms(x, p["norm"]), r["head"] @ rms(xr, r["norm"]), atol=1e-5))
True
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import torch

__all__ = ["NormReaders", "HeadPair", "QueryKey", "ResidualLayout", "rotate", "fuse_norms"]


class NormReaders(NamedTuple):
    """An RMSNorm's weight path and the weight paths of the linears that read its output."""

    weight: str
    readers: tuple[str, ...]


class HeadPair(NamedTuple):
    """A value projection (``v``, its rows ``rows`` of a fused ``[q; k; v]`` weight, or all of them) and
    the output projection ``o`` reading its heads of width ``head_dim``."""

    v: str
    o: str
    head_dim: int
    rows: tuple[int, int] | None = None


class QueryKey(NamedTuple):
    """An attention module (module path) whose queries and keys have heads of width ``head_dim``."""

    module: str
    head_dim: int


class ResidualLayout(NamedTuple):
    """What touches the residual stream, by tree path (see the module docstring)."""

    embeddings: tuple[str, ...]
    norms: tuple[NormReaders, ...]
    writers: tuple[str, ...]
    heads: tuple[HeadPair, ...] = ()
    down: tuple[str, ...] = ()
    attention: tuple[QueryKey, ...] = ()
    transposed: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """Plain JSON-able data (a step option), :meth:`from_value`'s inverse."""
        return {"embeddings": list(self.embeddings),
                "norms": [{"weight": n.weight, "readers": list(n.readers)} for n in self.norms],
                "writers": list(self.writers),
                "heads": [{"v": h.v, "o": h.o, "head_dim": h.head_dim, **({"rows": list(h.rows)} if h.rows else {})}
                          for h in self.heads],
                "down": list(self.down),
                "attention": [{"module": a.module, "head_dim": a.head_dim} for a in self.attention],
                **({"transposed": list(self.transposed)} if self.transposed else {})}

    def restrict(self, paths) -> "ResidualLayout":
        """The part of this layout whose tensors are among ``paths`` (one decoder block, or the tensors outside
        the blocks): the embeddings, the norms (with their readers), the writers, the head pairs, the down
        projections, the attention modules and the transposed tensors there."""
        paths = set(paths)
        return ResidualLayout(
            embeddings=tuple(e for e in self.embeddings if e in paths),
            norms=tuple(n for n in self.norms if n.weight in paths),
            writers=tuple(w for w in self.writers if w in paths),
            heads=tuple(h for h in self.heads if h.v in paths and h.o in paths),
            down=tuple(d for d in self.down if d in paths),
            attention=tuple(a for a in self.attention if any(p.startswith(a.module + ".") for p in paths)),
            transposed=tuple(t for t in self.transposed if t in paths))

    @classmethod
    def from_value(cls, value, *, where: str = "layout") -> "ResidualLayout":
        """A layout from itself or its :meth:`to_dict` form (``ValueError``/``TypeError`` naming the field)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"{where} must be a ResidualLayout or its dict, got {type(value).__name__}")
        unknown = sorted(set(value) - set(cls._fields))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}")
        try:
            return cls(embeddings=_strs(value.get("embeddings", ()), f"{where}.embeddings"),
                       norms=tuple(NormReaders(n["weight"], _strs(n["readers"], f"{where}.norms[{i}].readers"))
                                   for i, n in enumerate(value.get("norms", ()))),
                       writers=_strs(value.get("writers", ()), f"{where}.writers"),
                       heads=tuple(HeadPair(h["v"], h["o"], int(h["head_dim"]),
                                            tuple(h["rows"]) if h.get("rows") else None)
                                   for h in value.get("heads", ())),
                       down=_strs(value.get("down", ()), f"{where}.down"),
                       attention=tuple(QueryKey(a["module"], int(a["head_dim"])) for a in value.get("attention", ())),
                       transposed=_strs(value.get("transposed", ()), f"{where}.transposed"))
        except (KeyError, TypeError) as e:
            raise ValueError(f"{where}: malformed norms/heads/attention entry ({e!r}); see ResidualLayout.to_dict()"
                             ) from None


def _strs(value, where: str) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{where} must be a list of tree paths")
    return tuple(value)


def _bias(path: str, stacked: bool = False) -> str:
    """The bias of a weight path: ``<module>.bias``, or ``<path>_bias`` for a stacked experts weight."""
    if stacked:
        return f"{path}_bias"
    return path.rpartition(".")[0] + ".bias" if "." in path else "bias"


def _get(params: Mapping, path: str, where: str) -> torch.Tensor:
    t = params.get(path)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"rotate: {where} {path!r} is not a tensor of the tree" if t is None else
                         f"rotate: {where} {path!r} holds {type(t).__name__}, not a float tensor (rotate before "
                         "quantizing)")
    if not t.is_floating_point():
        raise TypeError(f"rotate: {where} {path!r} must be floating point, got {t.dtype}")
    return t


def _check(params: Mapping, layout: ResidualLayout, R1: torch.Tensor, R2) -> int:
    if not isinstance(layout, ResidualLayout):
        raise TypeError(f"rotate: layout must be a ResidualLayout, got {type(layout).__name__}")
    if not isinstance(R1, torch.Tensor) or R1.dim() != 2 or R1.shape[0] != R1.shape[1]:
        raise ValueError(f"rotate: R1 must be a square matrix, got {getattr(R1, 'shape', type(R1).__name__)}")
    d = R1.shape[0]
    flip = set(layout.transposed)  # stored (in, out): the residual axis is the other one
    wants = [(p, "embedding", -1, (2,)) for p in layout.embeddings]
    wants += [(r, f"reader of {n.weight}", -2 if r in flip else -1, (2, 3)) for n in layout.norms for r in n.readers]
    wants += [(w, "writer", -1 if w in flip else -2, (2, 3)) for w in layout.writers]  # 3-D: stacked experts
    for path, where, axis, dims in wants:
        t = _get(params, path, where)
        if t.dim() not in dims:
            raise ValueError(f"rotate: {where} {path!r} has shape {tuple(t.shape)}; it must be "
                             f"{' or '.join(f'{k}-D' for k in dims)} (3-D: stacked experts)")
        if t.shape[axis] != d:
            shown = axis if axis == -1 else t.dim() + axis
            raise ValueError(f"rotate: {where} {path!r} has shape {tuple(t.shape)}; its axis {shown} must be the "
                             f"residual width {d} (R1 is {d}x{d})")
    for n in layout.norms:
        g = _get(params, n.weight, "norm weight")
        if tuple(g.shape) != (d,):
            raise ValueError(f"rotate: norm weight {n.weight!r} has shape {tuple(g.shape)}, expected ({d},)")
        if _bias(n.weight) in params:
            raise ValueError(f"rotate: norm {n.weight!r} has a bias ({_bias(n.weight)}): only RMSNorm (no mean, no "
                             "bias) commutes with a rotation of the stream")
    if layout.heads:
        if R2 is None:
            return d
        n = len(layout.heads)
        if not isinstance(R2, torch.Tensor) or R2.dim() not in (2, 3) or R2.shape[-1] != R2.shape[-2] or (
                R2.dim() == 3 and R2.shape[0] != n):
            raise ValueError(f"rotate: R2 must be a square matrix or a stack of {n} (one per head pair), got "
                             f"{getattr(R2, 'shape', type(R2).__name__)}")
        for h in layout.heads:
            v, o = _get(params, h.v, "value projection"), _get(params, h.o, "output projection")
            rows = v.shape[0] if h.rows is None else h.rows[1] - h.rows[0]
            if h.head_dim != R2.shape[-1] or rows % h.head_dim or o.shape[1] % h.head_dim:
                raise ValueError(f"rotate: heads of {h.v!r} ({rows} rows) and {h.o!r} ({o.shape[1]} columns) are not "
                                 f"whole heads of width {h.head_dim} matching R2 {tuple(R2.shape)}")
    elif R2 is not None:
        raise ValueError("rotate: R2 given, but the layout names no value/output head pairs")
    return d


def fuse_norms(params: Mapping[str, torch.Tensor], layout: ResidualLayout, *,
               dtype: torch.dtype = torch.float64) -> dict:
    """``params`` with each norm's weight folded into the linears reading it (``W diag(g)``, computed in
    ``dtype``) and the norm's weight set to ones: the same function. Norms already all ones are left alone."""
    out = dict(params)
    for n in layout.norms:
        g = _get(params, n.weight, "norm weight")
        if bool((g == 1).all()):
            continue
        for r in n.readers:
            w = _get(out, r, f"reader of {n.weight}")
            f = g.to(dtype)[:, None] if r in layout.transposed else g.to(dtype)
            out[r] = (w.to(dtype) * f).to(w.dtype)
        out[n.weight] = torch.ones_like(g)
    return out


def _rotate_heads(w: torch.Tensor, R2: torch.Tensor, head_dim: int, *, rows: bool) -> torch.Tensor:
    """Each head block of ``w`` rotated: rows ``R2ᵀ W_h`` (``rows=True``) or columns ``W_h R2``."""
    if rows:  # a weight's head rows R2ᵀ W_h, or a bias's b_h R2: the same sum over the head's index j
        return torch.einsum("ji,hj...->hi...", R2, w.reshape(-1, head_dim, *w.shape[1:])).reshape(w.shape)
    return (w.reshape(w.shape[0], -1, head_dim) @ R2).reshape(w.shape)


def rotate(params: Mapping[str, torch.Tensor], layout: ResidualLayout, R1: torch.Tensor,
           R2: torch.Tensor | None = None, *, dtype: torch.dtype = torch.float64) -> dict:
    """``params`` with the norms fused and the residual stream rotated by ``R1`` (and each attention
    head by ``R2``: one matrix for every head pair, or a stack ``(len(layout.heads), n, n)``, one each),
    see the module docstring. ``R1``/``R2`` must be orthogonal for the function to be preserved (e.g.
    :func:`qtransform.rotation.orthogonal`). Pure: ``params`` is not changed; the products are computed
    in ``dtype`` (float64; float32 where speed matters more, as in SpinQuant's training loop) and stored
    in each tensor's dtype. Differentiable with respect to ``R1`` and ``R2``."""
    _check(params, layout, R1, R2)
    out = fuse_norms(params, layout, dtype=dtype)
    R = R1.to(dtype)

    def put(path, fn):
        t = out[path]
        out[path] = fn(t.to(dtype)).to(t.dtype)

    for p in layout.embeddings:
        put(p, lambda t: t @ R)
    for r in {r for n in layout.norms for r in n.readers}:
        put(r, (lambda t: R.T @ t) if r in layout.transposed else (lambda t: t @ R))
    for w in layout.writers:  # a stacked (experts, d, in) weight: one batched product
        b = _bias(w, out[w].dim() == 3)
        put(w, (lambda t: t @ R) if w in layout.transposed else (lambda t: R.T @ t))
        if isinstance(out.get(b), torch.Tensor):
            put(b, lambda t: t @ R)
    if R2 is not None:
        for i, h in enumerate(layout.heads):
            S = (R2 if R2.dim() == 2 else R2[i]).to(dtype)
            lo, hi = h.rows or (0, out[h.v].shape[0])
            for path in (h.v, _bias(h.v)):
                if isinstance(out.get(path), torch.Tensor):
                    t = out[path].to(dtype)
                    part = _rotate_heads(t[lo:hi], S, h.head_dim, rows=True)
                    out[path] = torch.cat([t[:lo], part, t[hi:]]).to(out[path].dtype)
            put(h.o, lambda t: _rotate_heads(t, S, h.head_dim, rows=False))
    return out

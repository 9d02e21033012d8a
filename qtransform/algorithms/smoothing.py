"""Smoothing groups: moving per-channel magnitude from a producer into the linear layers that read it.

A :class:`SmoothGroup` names a producer ``prev`` and the ``linears`` reading its output (module
paths of a flat parameter tree ``{"<module>.weight": tensor, ...}``):

* ``prev`` a **norm** (1-D ``weight``, optional ``bias``: RMSNorm ``y = w ⊙ x̂``, LayerNorm
  ``y = w ⊙ x̂ + b``): its output channel ``j`` is divided by ``s_j``;
* ``prev`` a **linear** (2-D ``weight``): its output channels ``rows`` (all by default; the value
  part of a fused ``[q; k; v]``, the ``up`` half of a fused ``[gate; up]``) are divided by ``s``,
  bias too. Between ``prev`` and the linears may sit an operation that commutes with a positive
  per-channel scale: attention (the output of head ``h`` is a convex combination of value rows),
  ``act(gate) * up``, ReLU. With grouped-query attention the values of ``n_kv`` heads are read by
  ``n_kv * n_rep`` heads: ``head_dim`` says how ``prev``'s channel ``(k, d)`` maps to the linears'
  input channels ``(k * n_rep + r, d)``, ``r < n_rep`` (``n_rep`` follows from the shapes);
* each linear's input column ``j`` is multiplied by ``s_j`` (expanded over the repeated heads).

For any positive ``s`` the float function is unchanged: the linears see ``x / s`` through
``W · diag(s)``. :func:`fold` does it, as a pure function returning the changed tensors. Weights
are read in their logical ``(out, in)`` layout; ``transposed=True`` says they are stored
``(in, out)`` (GPT-2's ``Conv1D``).

Mixture-of-experts layers: a member of ``linears`` named in ``stacked`` is the tree path of a stacked experts
weight itself (``"<block>.mlp.experts.gate_up_proj"``, ``(experts, out, in)``, ``(experts, in, out)`` with
``transposed``): its input axis is scaled in every expert, and its weight maxima are taken over all experts and
rows (every expert reads the same producer). Members named in ``routers`` (a router ``(experts, in)``, a shared
expert's gate) read the same input in float: they are scaled too, so the function stays exactly the same, but
they are never quantized, so the weight maxima (:func:`weight_absmax`) and the searches leave them out. The
statistics of a group's input are those of its first member that is not stacked (:func:`input_module`: a
router sees every token; an experts weight only the tokens routed to each expert). Groups are plain data (``to_dict``/``from_value``), so recipes,
recipe files and the bridge's architecture tables carry them.

>>> import torch
>>> params = {"norm.weight": torch.ones(2), "fc.weight": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}
>>> g = SmoothGroup.from_value({"prev": "norm", "linears": ["fc"]})
>>> new = fold(params, g, torch.tensor([2.0, 0.5]))
>>> new["norm.weight"].tolist(), new["fc.weight"].tolist()
([0.5, 2.0], [[2.0, 1.0], [6.0, 2.0]])
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

import torch

__all__ = ["SmoothGroup", "as_groups", "block_groups", "group_shape", "GroupShape", "logical_weight", "weight_absmax",
           "weight_path", "member_transposed", "input_module", "quantized_linears", "to_prev", "to_input", "fold"]


class SmoothGroup(NamedTuple):
    """A producer and the linears reading its output (see the module docstring).

    Attributes:
        prev: module path of the norm or linear whose output channels are divided by the scales.
        linears: module paths of the linears whose input columns are multiplied by them.
        rows: ``(start, stop)``: the output channels of a linear ``prev`` that feed the linears.
        head_dim: for a linear ``prev`` whose ``rows`` are attention heads read by ``n_rep`` times
            as many heads (grouped-query attention): the head size.
        transposed: the linears' (and a linear ``prev``'s) weights are stored ``(in, out)``.
        inspect: the module whose output a search over the group measures (AWQ: the attention for
            q/k/v, the MLP for gate/up); ``None``: the linears themselves.
        local: ``inspect`` computes each token's output from that token alone (an MLP; not attention),
            so a search may evaluate it on a sample of rows.
        stacked: the members of ``linears`` that are stacked experts weights (tree paths of the 3-D tensors).
        stacked_transposed: the stacked members are stored ``(experts, in, out)`` (GPT-OSS); ``transposed``
            says it of the other members.
        routers: the members of ``linears`` that read the input in float (routers): scaled, never quantized.
    """

    prev: str
    linears: tuple[str, ...]
    rows: tuple[int, int] | None = None
    head_dim: int | None = None
    transposed: bool = False
    inspect: str | None = None
    local: bool = False
    stacked: tuple[str, ...] = ()
    routers: tuple[str, ...] = ()
    stacked_transposed: bool = False

    @classmethod
    def from_value(cls, value: Any, *, where: str = "group") -> "SmoothGroup":
        """A group from a :class:`SmoothGroup` or its dict form ``{"prev": ..., "linears": [...], ...}``."""
        if isinstance(value, SmoothGroup):
            d = value._asdict()
        elif isinstance(value, Mapping):
            d = dict(value)
        else:
            raise TypeError(f"{where}: expected a SmoothGroup or a dict {{'prev': ..., 'linears': [...]}}, got "
                            f"{type(value).__name__}")
        unknown = sorted(set(d) - set(cls._fields))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; known: {list(cls._fields)}")
        prev, linears = d.get("prev"), d.get("linears")
        if not isinstance(prev, str) or not prev:
            raise ValueError(f"{where}: 'prev' must be a module path (a non-empty string), got {prev!r}")
        if isinstance(linears, str) or not isinstance(linears, Sequence) or not linears or not all(
                isinstance(p, str) and p for p in linears):
            raise ValueError(f"{where}: 'linears' must be a non-empty list of module paths, got {linears!r}")
        rows = d.get("rows")
        if rows is not None:
            if (isinstance(rows, str) or not isinstance(rows, Sequence) or len(rows) != 2
                    or not all(isinstance(r, int) and not isinstance(r, bool) for r in rows)
                    or not 0 <= rows[0] < rows[1]):
                raise ValueError(f"{where}: 'rows' must be [start, stop] with 0 <= start < stop, got {rows!r}")
            rows = (int(rows[0]), int(rows[1]))
        head_dim = d.get("head_dim")
        if head_dim is not None and (not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1):
            raise ValueError(f"{where}: 'head_dim' must be a positive int, got {head_dim!r}")
        transposed = d.get("transposed", False)
        if not isinstance(transposed, bool):
            raise TypeError(f"{where}: 'transposed' must be a bool, got {transposed!r}")
        inspect = d.get("inspect")
        if inspect is not None and (not isinstance(inspect, str) or not inspect):
            raise ValueError(f"{where}: 'inspect' must be a module path (a non-empty string), got {inspect!r}")
        local = d.get("local", False)
        if not isinstance(local, bool):
            raise TypeError(f"{where}: 'local' must be a bool, got {local!r}")
        members = {}
        for key in ("stacked", "routers"):
            v = d.get(key, ())
            if isinstance(v, str) or not isinstance(v, Sequence) or not set(v) <= set(linears):
                raise ValueError(f"{where}: {key!r} must be a list of members of 'linears', got {v!r}")
            members[key] = tuple(v)
        if set(members["stacked"]) & set(members["routers"]):
            raise ValueError(f"{where}: a router is a 2-D float linear, not a stacked experts weight: "
                             f"{sorted(set(members['stacked']) & set(members['routers']))}")
        if all(lin in members["routers"] for lin in linears):
            raise ValueError(f"{where}: its linears are all routers (never quantized): nothing to smooth for")
        if members["stacked"] and all(lin in members["stacked"] for lin in linears):
            raise ValueError(f"{where}: its linears are all stacked experts weights; the group needs a member that "
                             "sees every token of its input (the router)")
        stacked_transposed = d.get("stacked_transposed", False)
        if not isinstance(stacked_transposed, bool):
            raise TypeError(f"{where}: 'stacked_transposed' must be a bool, got {stacked_transposed!r}")
        return cls(prev, tuple(linears), rows, head_dim, transposed, inspect, local, **members,
                   stacked_transposed=stacked_transposed)

    def to_dict(self) -> dict:
        """JSON-able form (``from_value(g.to_dict()) == g``); defaults left out."""
        d: dict = {"prev": self.prev, "linears": list(self.linears)}
        if self.rows is not None:
            d["rows"] = list(self.rows)
        if self.head_dim is not None:
            d["head_dim"] = self.head_dim
        if self.transposed:
            d["transposed"] = True
        if self.inspect is not None:
            d["inspect"] = self.inspect
        if self.local:
            d["local"] = True
        for key in ("stacked", "routers"):
            if getattr(self, key):
                d[key] = list(getattr(self, key))
        if self.stacked_transposed:
            d["stacked_transposed"] = True
        return d


def as_groups(value: Any, *, where: str = "groups") -> tuple[SmoothGroup, ...]:
    """A tuple of groups from a list of groups or dicts (``ValueError`` naming the bad entry)."""
    if isinstance(value, (str, Mapping, SmoothGroup)) or not isinstance(value, Sequence):
        raise TypeError(f"{where}: expected a list of smoothing groups, got {type(value).__name__}")
    return tuple(SmoothGroup.from_value(g, where=f"{where}[{i}]") for i, g in enumerate(value))


def block_groups(groups: Sequence[SmoothGroup], block: str, *, step: str, online: Mapping = {}) -> list[SmoothGroup]:
    """The groups inside the block at path ``block``; a group reaching outside its block, or outside the
    blocks, is an error (``step`` names the algorithm in it): block-by-block steps change one block at a time.
    Groups whose linears rotate their input at run time (``online``: ``{Site: OnlineRotation}``, QuaRot's
    ``R4`` before a down projection) are left out: a rotation does not commute with per-channel scales."""
    prefix, parent = block + ".", block.rpartition(".")[0]
    rotated = {s.module for s in online if s.role == "input"}
    mine = []
    for g in groups:
        if rotated.intersection(g.linears):
            continue
        paths = (g.prev, *g.linears)
        inside = [p.startswith(prefix) for p in paths]
        if all(inside):
            mine.append(g)
        elif any(inside) or (parent and not all(p.startswith(parent + ".") for p in paths)):
            raise ValueError(f"{step}: the group of {g.prev!r} ({list(paths)}) is not inside one block of "
                             f"{parent or 'the model'}; block-by-block steps change one block at a time")
    return mine


class GroupShape(NamedTuple):
    """Channel counts of a group in a tree: ``channels`` (the linears' input features), ``prev``
    (the producer's channels that feed them), ``n_rep`` (``channels = n_rep * prev``)."""

    channels: int
    prev: int
    n_rep: int


def weight_path(group: SmoothGroup, member: str) -> str:
    """The tree path of a member's weight: ``"<member>.weight"``, or the member itself when stacked."""
    return member if member in group.stacked else f"{member}.weight"


def member_transposed(group: SmoothGroup, member: str) -> bool:
    """Whether a member's weight is stored ``(in, out)`` (``(experts, in, out)`` for a stacked one)."""
    return group.stacked_transposed if member in group.stacked else group.transposed


def input_module(group: SmoothGroup) -> str:
    """The member whose input statistics are the group's: the first that is not a stacked experts weight."""
    return next(lin for lin in group.linears if lin not in group.stacked)


def quantized_linears(group: SmoothGroup) -> tuple[str, ...]:
    """The members that may be quantized (all but the routers)."""
    return tuple(lin for lin in group.linears if lin not in group.routers)


def _weight(params: Mapping[str, torch.Tensor], path: str, role: str) -> torch.Tensor:
    w = params.get(path)
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise ValueError(f"{path}: smoothing group {role} {path.removesuffix('.weight')!r} has no floating-point "
                         "weight in the tree")
    return w


def logical_weight(w: torch.Tensor, transposed: bool) -> torch.Tensor:
    """A linear weight in its ``(out, in)`` layout (``(experts, out, in)`` for a stacked one)."""
    return w.transpose(-2, -1) if transposed else w


def group_shape(params: Mapping[str, torch.Tensor], group: SmoothGroup) -> GroupShape:
    """Check ``group`` against the tree and return its channel counts (``ValueError`` naming the path)."""
    ins = []
    for lin in group.linears:
        w = _weight(params, weight_path(group, lin), "linear")
        want = 3 if lin in group.stacked else 2
        if w.dim() != want:
            what = "a stacked experts weight must be 3-D" if want == 3 else "a smoothing group's linear must be 2-D"
            raise ValueError(f"{weight_path(group, lin)}: {what}, got shape {tuple(w.shape)}")
        ins.append(logical_weight(w, member_transposed(group, lin)).shape[-1])
    if len(set(ins)) != 1:
        raise ValueError(f"smoothing group of {group.prev!r}: its linears {list(group.linears)} read "
                         f"different widths {ins}; they must share one input")
    c = ins[0]
    pw = _weight(params, f"{group.prev}.weight", "prev")
    if pw.dim() == 1:  # a norm
        if group.rows is not None or group.head_dim is not None:
            raise ValueError(f"{group.prev}.weight: 'rows' and 'head_dim' apply to a linear prev, not a norm")
        if pw.shape[0] != c:
            raise ValueError(f"{group.prev}.weight: the norm has {pw.shape[0]} channels, its linears read {c}")
        bias = params.get(f"{group.prev}.bias")
        if bias is not None and tuple(bias.shape) != (c,):
            raise ValueError(f"{group.prev}.bias: shape {tuple(bias.shape)}, expected ({c},)")
        return GroupShape(c, c, 1)
    if pw.dim() != 2:
        raise ValueError(f"{group.prev}.weight: prev must be a norm (1-D weight) or a linear (2-D), got shape "
                         f"{tuple(pw.shape)}")
    out = logical_weight(pw, group.transposed).shape[0]
    start, stop = group.rows if group.rows is not None else (0, out)
    if stop > out:
        raise ValueError(f"{group.prev}.weight: rows {[start, stop]} exceed its {out} output channels")
    n = stop - start
    if n == c:
        return GroupShape(c, n, 1)
    if group.head_dim is None or c % n or n % group.head_dim:
        raise ValueError(f"{group.prev}.weight: rows {[start, stop]} give {n} channels, its linears read {c}; "
                         "they must be equal, or (grouped-query attention) a multiple with 'head_dim' dividing "
                         f"{n} (head_dim={group.head_dim})")
    return GroupShape(c, n, c // n)


def weight_absmax(params: Mapping[str, torch.Tensor], group: SmoothGroup) -> torch.Tensor:
    """``max |W[:, j]|`` over the rows (and experts) of the group's linears but its routers, per input channel
    ``j`` (float32)."""
    cols = []
    for lin in quantized_linears(group):
        w = logical_weight(params[weight_path(group, lin)], member_transposed(group, lin)).detach()
        cols.append(w.abs().reshape(-1, w.shape[-1]).amax(0).float())
    return torch.stack(cols).amax(0)


def to_prev(t: torch.Tensor, group: SmoothGroup, shape: GroupShape) -> torch.Tensor:
    """Per-input-channel values (``(..., channels)``) reduced by max over repeated heads to the
    producer's channels (``(..., prev)``); unchanged without repetition."""
    if shape.n_rep == 1:
        return t
    d = group.head_dim
    return t.reshape(*t.shape[:-1], shape.prev // d, shape.n_rep, d).amax(-2).reshape(*t.shape[:-1], shape.prev)


def to_input(s: torch.Tensor, group: SmoothGroup, shape: GroupShape) -> torch.Tensor:
    """Producer-channel scales (``(..., prev)``) expanded to the linears' input channels."""
    if shape.n_rep == 1:
        return s
    d = group.head_dim
    lead = s.shape[:-1]
    return s.reshape(*lead, shape.prev // d, 1, d).expand(*lead, shape.prev // d, shape.n_rep, d).reshape(
        *lead, shape.channels)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def fold(params: Mapping[str, torch.Tensor], group: SmoothGroup, s: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of ``group`` with the scales ``s`` folded in (new tensors, same shapes and dtypes).

    Args:
        params: flat tree ``{path: tensor}`` (not modified).
        group: the :class:`SmoothGroup`.
        s: positive scales, one per producer channel (``group_shape(params, group).prev``).

    Returns:
        ``{path: tensor}`` for ``prev``'s weight (and bias) and each linear's weight. Computed in
        float32 (or wider) and cast back.
    """
    shape = group_shape(params, group)
    if not isinstance(s, torch.Tensor) or tuple(s.shape) != (shape.prev,):
        got = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
        raise ValueError(f"smoothing group of {group.prev!r}: scales of shape {got}, expected ({shape.prev},)")
    if not bool((s > 0).all()) or not bool(torch.isfinite(s).all()):
        raise ValueError(f"smoothing group of {group.prev!r}: scales must be positive and finite")
    out = {}
    pw = params[f"{group.prev}.weight"]
    if pw.dim() == 1:
        inv = 1.0 / s
        factors = {f"{group.prev}.weight": inv}
        if params.get(f"{group.prev}.bias") is not None:
            factors[f"{group.prev}.bias"] = inv
    else:
        n_out = logical_weight(pw, group.transposed).shape[0]
        start, stop = group.rows if group.rows is not None else (0, n_out)
        ones = s.new_ones(())
        inv = torch.cat([ones.expand(start), 1.0 / s, ones.expand(n_out - stop)])
        factors = {f"{group.prev}.weight": inv[None, :] if group.transposed else inv[:, None]}
        if params.get(f"{group.prev}.bias") is not None:
            factors[f"{group.prev}.bias"] = inv
    cols = to_input(s, group, shape)
    for lin in group.linears:  # a stacked weight's experts broadcast
        factors[weight_path(group, lin)] = cols[:, None] if member_transposed(group, lin) else cols[None, :]
    for path, f in factors.items():
        t = params[path]
        dt = _compute_dtype(t)
        out[path] = (t.to(dt) * f.to(device=t.device, dtype=dt)).to(t.dtype)
    return out

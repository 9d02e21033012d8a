"""The GPTQ solver (Frantar et al., 2023): quantize a linear weight column by column, each column's
rounding error compensated on the columns not yet quantized, through the inverse Hessian of the
layer's squared output error ``H = XᵀX / n`` (:mod:`qtransform.observers.hessian`).

For a weight ``W`` of shape ``(out, in)``:

* input columns that calibration never saw (``H_jj = 0``, *dead*) get ``H_jj = 1`` and weight 0;
* ``act_order``: columns are processed by decreasing ``H_jj`` (the inputs with the most energy
  first, while the most columns are left to absorb their error);
* damping: ``H + damp · mean(diag H) · I``; when its Cholesky factorization fails the damping is
  multiplied by 10 (up to ``max_retries`` times) with a warning naming the layer;
* ``U``: the upper Cholesky factor of ``H⁻¹`` (factorizations in float64, the loop in float32);
* for each column ``j``: ``q_j = Q(w_j)``, ``e_j = (w_j − q_j) / U_jj``, and the columns after ``j``
  move by ``−e_j U_j,>j`` (inside a block of ``block_size`` columns at once, the rest of the matrix
  with one product per block: the *lazy batch* update). The loss is ``Σ e_j² / 2``.

``Q`` is the format's own codec: ``(round(w / s + z) − z) · s`` with the element grid, range and
rounding of the spec's format, so every registered format works (int/uint, NF4, fp8/fp6/fp4,
MX, NVFP4...). Where ``s``, ``z`` come from:

* *static groups* (``static_groups=True``, and always for per-tensor and per-output-channel specs,
  and for formats with tensor-wide or micro-exponent parts, NVFP4 and MX4/MX6/MX9): the
  quantization parameters of the whole weight are chosen before the loop, so the result is on the
  spec's own grid even with ``act_order``;
* otherwise, each group's parameters are chosen from the group's columns as the loop reaches its
  first column (after the compensation of the columns before it). With ``act_order`` the groups
  are runs of columns in processing order: the result's ``qparams`` then describe
  ``weight[:, perm]`` and ``g_idx[c]`` is the group of input column ``c`` (what GPTQ exporters store).

``init="minmax"`` chooses parameters with an observer (``observer``: ``"minmax"``, ``"mse"``...);
``init="clip"`` searches each group's clipping for the smallest squared error weighted by the
Hessian's diagonal (:mod:`.clip_search`; affine formats without micro-exponents, else min/max);
``init="hqq"`` uses HQQ's optimizer (uint specs with a float zero point).

``cross`` (GPTAQ, :mod:`.gptaq_math`): the statistic ``ΔXᵀX̃ / n`` of the float path's inputs against the
quantized path's, which adds ``alpha · w_j P_j,>j`` to each column step's update of the columns after it.

>>> import torch, qtransform as qt
>>> from qtransform.algorithms.gptq_math import gptq
>>> g = torch.Generator().manual_seed(0)
>>> x, w = torch.randn(256, 32, generator=g), torch.randn(16, 32, generator=g)
>>> spec = qt.QuantSpec(format="int4", granularity=qt.PerChannel(0))
>>> r = gptq(w, x.T @ x / 256, spec)
>>> rtn = qt.fake_quantize(w, qt.choose_qparams(w, spec))
>>> err = lambda v: float(((v - w) @ x.T).pow(2).mean())
>>> err(r.weight) < err(rtn), torch.equal(qt.fake_quantize(r.weight, r.qparams), r.weight)
(True, True)
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Sequence

import torch

from .._checks import check_finite, check_float_tensor, where
from ..formats.scaling import AffineScheme
from ..observers import choose_qparams
from ..spec import QuantSpec
from ..tensor import QParams, blocks
from ..tensor.quantize import element_range
from .clip_search import search_range
from .gptaq_math import asymmetric_term, check_alpha, check_cross
from .hqq_math import check_spec as check_hqq_spec
from .hqq_math import optimize as hqq_optimize

__all__ = ["GPTQResult", "gptq", "gptq_many", "inverse_hessian_factor", "QPARAMS_INITS"]

#: Columns whose errors are pushed one by one onto each other before one product updates the block's rest. At
#: 128 (the default block) the loop is the textbook lazy batch, bit for bit; 16 saved ~5% of the loop's CPU time on
#: SmolLM2 and changed float rounding enough to move a reduced run's perplexity ratio by 1% (x1.074 -> x1.084), so
#: it stays off.
_SUB_BLOCK = 128

#: How the quantization parameters of a group are chosen before its columns are quantized (gptq's ``init``).
QPARAMS_INITS = ("minmax", "clip", "hqq")


class GPTQResult(NamedTuple):
    """``weight``: the quantized weight (dequantized values, input columns in their own order, the
    dtype of the input); ``qparams``: its parameters (of ``weight[:, perm]`` when ``g_idx`` is
    given); ``loss``: GPTQ's ``Σ e² / 2``; ``perm``: the processing order (``act_order``) or
    ``None``; ``g_idx``: group of each input column, only for ``act_order`` with dynamic groups;
    ``unrounded`` (when asked): the weight as its columns stood when they were rounded (the errors of the
    columns before them compensated; float32, input columns in their own order): rounding it to nearest with
    ``qparams`` gives ``weight``."""

    weight: torch.Tensor
    qparams: QParams
    loss: float
    perm: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None
    unrounded: torch.Tensor | None = None


def inverse_hessian_factor(H: torch.Tensor, *, damp: float = 0.01, max_retries: int = 6,
                           path: str | None = None, perm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U, dead)``: the upper Cholesky factor of ``(H + λI)⁻¹`` (float32; ``λ = damp · mean diag``,
    dead diagonal entries set to 1 first) and the mask of dead columns. Float64 inside. ``perm``: factor
    ``H[perm][:, perm]`` (gathered here, never held beside ``H`` as a copy of its own).

    With ``P`` the reversal permutation and ``L Lᵀ = P H P``, ``H⁻¹ = (P L⁻¹ P)ᵀ (P L⁻¹ P)`` and
    ``P L⁻¹ P`` is upper triangular with a positive diagonal: the factor, from one Cholesky
    factorization and one triangular solve (instead of factorizing, inverting and factorizing again)."""
    def damped(lam: float) -> torch.Tensor:
        """``P (H + λI) P`` in float64, dead entries cleared (rebuilt for each try: one n×n float64 copy
        alive beside the factor, not four)."""
        order = (torch.arange(H.shape[0], device=H.device) if perm is None else perm).flip(0)
        A = H.detach()[order[:, None], order].to(torch.float64)  # P H[perm][:, perm] P, one gather
        dead = torch.diagonal(A).flip(0) <= 0
        rdead = dead.flip(0)
        A[rdead, :] = 0
        A[:, rdead] = 0
        A[rdead, rdead] = 1.0
        A.diagonal().add_(lam)
        return A, dead

    A, dead = damped(0.0)
    mean = float(torch.diagonal(A).flip(0).mean())  # in H's order: the same float as before
    d = damp
    for attempt in range(max_retries + 1):
        if attempt:
            A, _ = damped(d * mean)
        else:
            A.diagonal().add_(d * mean)
        L, info = torch.linalg.cholesky_ex(A)
        del A
        if int(info) == 0:
            U = torch.eye(L.shape[0], dtype=L.dtype, device=L.device)
            U = torch.linalg.solve_triangular(L, U, upper=False, out=U)
            del L
            U = U.to(torch.float32).flip(0, 1)
            if bool(torch.isfinite(U).all()):
                break
        if attempt == max_retries:
            raise ValueError(f"{where(path)}gptq: the Hessian is not positive definite even with damping "
                             f"{d:g} × its mean diagonal; too few calibration tokens for this layer?")
        d = d * 10 if d > 0 else 1e-6
        warnings.warn(f"{where(path)}gptq: Cholesky factorization failed; retrying with damp={d:g}", stacklevel=3)
    return U, dead


def _group_width(spec: QuantSpec, shape, path) -> int:
    """Input columns per parameter group of a logical ``(out, in)`` weight (``in``: one group)."""
    try:
        return int(blocks.tiling(shape, spec, path=path).block[-1])
    except ValueError as e:
        raise ValueError(f"{where(path)}gptq: {e}") from None


def _per_group_only(spec: QuantSpec) -> bool:
    """Whether the spec's parameters are per-group scales (and zero points) alone: an affine scheme without
    micro-exponents (MX4/MX6/MX9) or a tensor-wide scale (two-level fp8 block scales: NVFP4)."""
    fmt = spec.fmt
    return isinstance(fmt.scheme, AffineScheme) and fmt.sub_block is None and spec.scale_dtype != "float8_e4m3fn"


def _element(qp: QParams, shape) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 scale and zero point per element of a tensor of ``shape`` (transposed: ``(in, out)``)."""
    p = blocks.tiling(shape, qp.spec, sub_block=True)
    s, z = qp.effective()
    if z is not None and qp.spec.zero_point_domain == "offset":  # code * s + m == (code - (-m / s)) * s
        z = -z / s
    inter = [d for g, b in zip(p.grid, p.block) for d in (g, b)]
    full = lambda t: blocks.unview(blocks.expand(t.to(torch.float32), p).expand(inter), p).T.contiguous()  # noqa: E731
    return full(s), None if z is None else full(z)


def _choose(x: torch.Tensor, spec: QuantSpec, init: str, observer, path, energy=None) -> QParams:
    """Parameters for the weight slice ``x`` ``(out, n)``; ``energy`` ``(n,)``: the clip search's input weights."""
    if init == "hqq":
        return hqq_optimize(x, spec, path=path)
    if init == "clip":
        return search_range(x, spec, energy, path=path)
    return choose_qparams(x, spec, observer=observer, path=path)


class _Member(NamedTuple):
    rows: slice
    spec: QuantSpec
    group: int
    static: bool


def _check(W, H, spec, path):
    check_float_tensor(W, name="W", path=path)
    if W.dim() != 2:
        raise ValueError(f"{where(path)}gptq: W must be a 2-D (out, in) weight, got shape {tuple(W.shape)}")
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"{where(path)}gptq: spec must be a QuantSpec, got {type(spec).__name__}")
    if spec.rounding == "stochastic":
        raise ValueError(f"{where(path)}gptq: rounding='stochastic' has no place in GPTQ's deterministic "
                         "error compensation; use half_even or half_away")
    if not isinstance(H, torch.Tensor) or tuple(H.shape) != (W.shape[1], W.shape[1]):
        raise ValueError(f"{where(path)}gptq: H must be ({W.shape[1]}, {W.shape[1]}) for W of shape "
                         f"{tuple(W.shape)}, got {tuple(H.shape) if isinstance(H, torch.Tensor) else type(H).__name__}")
    check_finite(W, name="W", path=path)


def gptq(W: torch.Tensor, H: torch.Tensor, spec: QuantSpec, **options) -> GPTQResult:
    """GPTQ of one weight ``W`` ``(out, in)`` with Hessian ``H`` ``(in, in)`` (see the module
    docstring); ``options`` as :func:`gptq_many`."""
    return gptq_many([W], H, [spec], **options)[0]


def gptq_many(weights: Sequence[torch.Tensor], H: torch.Tensor, specs: Sequence[QuantSpec], *,
              damp: float = 0.01, block_size: int = 128, act_order: bool = False, static_groups: bool = False,
              init: str = "minmax", observer=None, max_retries: int = 6,
              paths: Sequence[str | None] | None = None, cross: torch.Tensor | None = None,
              alpha: float = 0.25, unrounded: bool = False) -> list[GPTQResult]:
    """GPTQ of weights that read the same input (one ``H``: q/k/v, gate/up), solved together: their
    rows are stacked, the Hessian is factorized once and every column step covers all of them. Each
    result equals :func:`gptq` of that weight alone.

    Args:
        weights: 2-D ``(out_i, in)`` floating tensors (not modified).
        H: ``(in, in)`` Hessian (``XᵀX / n``; any positive multiple gives the same result).
        specs: one spec per weight, for the logical ``(out, in)`` layout.
        damp: relative damping, ``>= 0``.
        block_size: columns per lazy batch update.
        act_order: process columns by decreasing Hessian diagonal.
        static_groups: choose all group parameters before the loop.
        init: ``"minmax"`` (parameters from ``observer``, default minmax), ``"clip"`` (energy-weighted
            clipping search) or ``"hqq"``.
        max_retries: damping increases (×10) tried when the factorization fails.
        paths: tree paths, for messages.
        cross: GPTAQ's ``(in, in)`` ``ΔXᵀX̃ / n`` (same tokens and scale as ``H``); ``None``: GPTQ.
        alpha: GPTAQ's scale of the asymmetric term (``>= 0``; with ``cross`` only).
        unrounded: also return each weight as its columns stood when rounded (:attr:`GPTQResult.unrounded`;
            one more float32 copy of the weights).
    """
    paths = list(paths) if paths is not None else [None] * len(weights)
    if len(weights) != len(specs) or len(paths) != len(weights) or not weights:
        raise ValueError(f"gptq: {len(weights)} weights, {len(specs)} specs and {len(paths)} paths; one spec and "
                         "path per weight, at least one weight")
    for W, spec, p in zip(weights, specs, paths):
        _check(W, H, spec, p)
    check_finite(H, name="H", path=paths[0])
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{where(paths[0])}gptq: block_size must be an int >= 1, got {block_size!r}")
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not 0 <= damp < float("inf"):
        raise ValueError(f"{where(paths[0])}gptq: damp must be a number >= 0, got {damp!r}")
    if init not in QPARAMS_INITS:
        raise ValueError(f"{where(paths[0])}gptq: init must be one of {list(QPARAMS_INITS)}, got {init!r}")
    alpha = check_alpha(alpha, path=paths[0])
    if cross is not None:
        check_cross(cross, H.shape[0], path=paths[0])
    if init == "hqq":
        for spec, p in zip(specs, paths):
            check_hqq_spec(spec, path=p)
    C = weights[0].shape[1]
    perm = torch.argsort(torch.diagonal(H).to(torch.float64), descending=True, stable=True) if act_order else None
    U, dead = inverse_hessian_factor(H, perm=perm, damp=damp, max_retries=max_retries, path=paths[0])
    if perm is not None:
        dead = dead[torch.argsort(perm)]
    P = None if cross is None or alpha == 0 else asymmetric_term(cross, U, alpha=alpha, perm=perm, dead=dead)

    members, start = [], 0
    for W, spec, p in zip(weights, specs, paths):
        group = _group_width(spec, tuple(W.shape), p)
        # one group spanning the width (per tensor, per output channel), or parts beyond per-group scales
        static = static_groups or group >= C or not _per_group_only(spec)
        members.append(_Member(slice(start, start + W.shape[0]), spec, group, static))
        start += W.shape[0]
    Wt = torch.cat([W.detach().to(torch.float32) for W in weights]).T.contiguous()  # (in, rows): columns as rows
    Wt[dead] = 0
    energy = torch.diagonal(H).detach().to(torch.float32).clamp(min=0)
    S, Z = torch.ones_like(Wt), torch.zeros_like(Wt)
    fitted: dict[int, QParams] = {}
    for i, m in enumerate(members):  # static parameters: from the weight before any update
        if m.static:
            fitted[i] = _choose(Wt[:, m.rows].T, m.spec, _init(init, m.spec), observer, paths[i], energy)
            _put(S, Z, fitted[i], 0, m.rows, C)
    if perm is not None:
        Wt, S, Z = Wt[perm].contiguous(), S[perm].contiguous(), Z[perm].contiguous()
    energy_p = energy if perm is None else energy[perm]
    dynamic = [i for i, m in enumerate(members) if not m.static]
    groups: dict[int, list[QParams]] = {i: [] for i in dynamic}
    runs = _runs(members)
    losses = torch.zeros(Wt.shape[1], dtype=torch.float64, device=Wt.device)
    Q = torch.empty_like(Wt)
    # columns are quantized one by one, each one's error pushed at once onto the next few (``sub``), onto the
    # rest of the lazy-batch block after each run of ``sub`` columns, onto the matrix after each block (two
    # products instead of one per column: same result up to the order of float additions). Dynamic groups
    # (read columns ahead) and GPTAQ (its own per-column term) take one run per block: the textbook loop.
    sub = block_size if dynamic or P is not None else min(block_size, _SUB_BLOCK)
    for i1 in range(0, C, block_size):
        i2 = min(i1 + block_size, C)
        W1, U1 = Wt[i1:i2], U[i1:i2, i1:i2]
        E1 = torch.empty_like(W1)
        # rows as views, once per block: each column step indexes Python lists, not tensors
        Wr, Er, Ur, dr, Sr, Zr = (t.unbind(0) for t in (W1, E1, U1, U1.diagonal(), S[i1:i2], Z[i1:i2]))
        qs = []
        for s1 in range(0, i2 - i1, sub):
            s2 = min(s1 + sub, i2 - i1)
            for j in range(s1, s2):
                col = i1 + j
                for i in dynamic:
                    m = members[i]
                    if col % m.group == 0:  # a group starts: its parameters from its columns as they are now
                        ahead = Wt[i2:col + m.group, m.rows]  # beyond the block: with the block's pending updates
                        if ahead.shape[0] and j:
                            ahead = ahead - U[i1:col, i2:col + m.group].T @ E1[:j, m.rows]
                            if P is not None:
                                ahead = ahead + P[i1:col, i2:col + m.group].T @ W1[:j, m.rows]
                        cols = torch.cat([W1[j:j + m.group, m.rows], ahead])
                        qp = _choose(cols.T, m.spec, _init(init, m.spec), observer, paths[i],
                                     energy_p[col:col + cols.shape[0]])
                        groups[i].append(qp)
                        _put(S, Z, qp, col, m.rows, cols.shape[0])
                w = Wr[j]
                if len(runs) == 1:
                    q = _round(w, Sr[j], Zr[j], *runs[0][1:])
                else:
                    q = torch.empty_like(w)
                    for rows, *fmt in runs:
                        q[rows] = _round(w[rows], Sr[j][rows], Zr[j][rows], *fmt)
                qs.append(q)
                e = torch.sub(w, q, out=Er[j]).div_(dr[j])
                if j + 1 < s2:
                    W1[j + 1:s2].addr_(Ur[j][j + 1:s2], e, alpha=-1.0)
                    if P is not None:  # GPTAQ: w (before rounding) times the asymmetric term
                        W1[j + 1:s2].addr_(P[col, col + 1:i1 + s2], w)
            if s2 < i2 - i1:  # sub < block only without P
                W1[s2:].addmm_(U1[s1:s2, s2:].T, E1[s1:s2], alpha=-1.0)
        torch.stack(qs, out=Q[i1:i2])
        losses += E1.to(torch.float64).pow(2).sum(0) / 2
        if i2 < C:
            Wt[i2:].addmm_(U[i1:i2, i2:].T, E1, alpha=-1.0)
            if P is not None:  # W1: the block's columns before rounding
                Wt[i2:].addmm_(P[i1:i2, i2:].T, W1)
    inv = None if perm is None else torch.argsort(perm)
    Qo = Q if inv is None else Q[inv]
    Wo = None if not unrounded else Wt if inv is None else Wt[inv]  # Wt: each column as it stood when rounded
    results = []
    for i, (W, m) in enumerate(zip(weights, members)):
        weight = Qo[:, m.rows].T.to(W.dtype).contiguous()
        kept = None if Wo is None else Wo[:, m.rows].T.contiguous()
        loss = float(losses[m.rows].sum())
        if m.static:
            results.append(GPTQResult(weight, fitted[i], loss, perm, unrounded=kept))
        else:
            g_idx = None if perm is None else (inv // m.group).to(torch.int32)
            results.append(GPTQResult(weight, _splice(groups[i], m.spec), loss, perm, g_idx, kept))
    return results


def _put(S: torch.Tensor, Z: torch.Tensor, qp: QParams, col: int, rows: slice, ncols: int) -> None:
    """Write the element-level scale and zero point of ``qp`` (fitted to a weight slice
    ``(len(rows), ncols)``) at columns ``col:col+ncols`` of the transposed ``S``, ``Z``."""
    s, z = _element(qp, (rows.stop - rows.start, ncols))
    S[col:col + ncols, rows] = s
    if z is not None:
        Z[col:col + ncols, rows] = z


def _runs(members) -> list[tuple[slice, QuantSpec, float | None, float | None]]:
    """``[(rows, spec, lo, hi)]``: the members' rows, adjacent members of one spec merged (one rounding call),
    with the spec's element range."""
    out = []
    for m in members:
        if out and out[-1][1] == m.spec:
            out[-1] = (slice(out[-1][0].start, m.rows.stop), *out[-1][1:])
        else:
            out.append((m.rows, m.spec, *element_range(m.spec)))
    return out


def _round(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, spec: QuantSpec, lo, hi) -> torch.Tensor:
    """``(round(w / s + z) − z) · s`` on the spec's element grid (what dequantize(quantize(.)) gives); ``lo``,
    ``hi``: :func:`element_range` of the spec."""
    v = torch.addcdiv(z, w, s)
    return spec.fmt.codec.round(v, rounding=spec.rounding, lo=lo, hi=hi).sub_(z).mul_(s)


def _splice(parts: list[QParams], spec: QuantSpec) -> QParams:
    """The groups' parameters (each of grid ``(R, 1)``) side by side: one QParams of grid ``(R, G)``."""
    fields = {}
    for name in ("scale", "zero_point"):
        ts = [getattr(p, name) for p in parts]
        if ts[0] is not None:
            fields[name] = torch.cat(ts, dim=-1)
    return QParams(spec=spec, **fields)


def _init(init: str, spec: QuantSpec) -> str:
    """``clip`` falls back to min/max where the search does not apply (micro-exponent formats, non-affine schemes)."""
    if init == "clip" and (spec.fmt.sub_block is not None or not isinstance(spec.fmt.scheme, AffineScheme)):
        return "minmax"
    return init

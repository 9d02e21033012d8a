"""HQQ's tensor math: :func:`optimize` (one tensor), :func:`optimize_stack` (layers of equal shape) and
the half-quadratic iterations on groups of a weight (:func:`solve_groups`); :mod:`.hqq` explains the method and
registers the step.

The solver works on ``(G, g)`` float32 groups with ``(G, 1)`` stored scales and zero points; every
function is vectorized over groups (no loop over groups, only over iterations and chunks).

>>> import torch, qtransform as qt
>>> spec = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(64), symmetric=False, zero_point_domain="float")
>>> optimize(torch.ones(2, 64), spec).scale.shape
torch.Size([2, 1])
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .._checks import check_finite, check_float_tensor, under_transform, where
from ..formats import SCALE_DTYPES
from ..granularity import PerBlock
from ..observers import compute_qparams, init_stats, observe
from ..spec import QuantSpec
from ..tensor import QParams, blocks
from .options import check_options, option

__all__ = ["Options", "solve_groups", "optimize", "optimize_stack", "check_spec", "supports"]

_CHUNK = 1 << 20  # elements per chunk: a few working buffers stay in cache


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """HQQ's options (see :func:`optimize`), checked by :func:`~qtransform.algorithms.options.check_options`."""

    lp_norm: float = option(0.7, gt=0, le=1, doc="p of the l_p error the proximal step targets")
    beta: float = option(10.0, gt=0, doc="initial proximal weight")
    kappa: float = option(1.01, ge=1, doc="beta's growth per iteration")
    iters: int = option(20, ge=0, doc="maximum number of updates")
    early_stop: bool = option(True, doc="stop a group at its first iterate without improvement")
    tol: float = option(0.0, ge=0, lt=1, doc="relative improvement a group needs to keep iterating")
    refine_scale: bool = option(True, doc="solve for scale and zero point, not the zero point only")
    error_norm: float = option(2.0, ge=1, inf=True, doc="p of the per-group error ranking the iterates")
    chunk_size: int = option(_CHUNK, ge=1, doc="elements per chunk of groups (speed only)")


def _round_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round float32 ``t`` to the storage dtype (nearest) and back: what will be stored."""
    return t if dtype == torch.float32 else t.to(dtype).to(torch.float32)


def _residual(w, s, z, codec, rounding: str, qmax: float):
    """Codes ``q`` (as float32) and code-domain residuals ``r = w / s + z - q``."""
    u = w / s
    u.add_(z)
    q = codec.round(u, rounding=rounding, lo=0.0, hi=qmax)
    return u.sub_(q), q


def _group_error(r, s, p: float) -> torch.Tensor:
    """``||r * s||_p ** p`` per group (the squared error for ``p = 2``; the largest error for
    ``p = inf``) from code-domain residuals ``r`` (G, g) and scales ``s`` (G, 1)."""
    if p == 2.0:
        return torch.linalg.vecdot(r, r).unsqueeze_(-1).mul_(s * s)
    a = r.abs()
    if math.isinf(p):
        return a.amax(-1, keepdim=True).mul_(s)
    if p == 4.0:
        a = a.mul_(a)
        return torch.linalg.vecdot(a, a).unsqueeze_(-1).mul_(s.pow(4))
    return a.pow_(p).sum(-1, keepdim=True).mul_(s.pow(p))


def _shrink_rows(bounds, s, z, qmax: float, threshold: float) -> torch.Tensor:
    """Rows where ``shrink(w - w_r)`` may be non-zero, i.e. some ``|w - w_r| > threshold``.

    Unclipped residuals are at most half a step; clipped ones at most the distance of the
    group's extreme values (``bounds``) to the code range. Grid-sized work only.
    """
    wmin, wmax = bounds
    reach = torch.maximum((wmin / s + z).neg_(), (wmax / s + z).sub_(qmax)).clamp_(min=0.5)
    return (reach.mul_(s) > threshold).nonzero()[:, 0]


def _shrunk(r, s, beta: float, p: float):
    """``rho = r - shrink(r * s) / s`` in the code domain: ``sign(r) * min(|r|, c |r|^(p-1))``."""
    a = r.abs()
    c = s.pow(p - 2.0).div_(beta)
    m = a.pow(p - 1.0).mul_(c)
    return torch.minimum(a, m).copysign_(r)


def _update(q, rho, s, z, refine: bool):
    """Least-squares fit of ``q - z + rho ~ A q + B`` per group: the new ``(s, z)``.

    With ``A = 1 + d``: ``s' = s A`` and ``z' = -B / A``. ``refine=False`` keeps ``d = 0``
    (hqq's zero-point step ``z' = z - mean(rho)``).
    """
    n = q.shape[-1]
    sr = rho.sum(-1, keepdim=True)
    if not refine:
        return s, z - sr / n
    sq = q.sum(-1, keepdim=True)
    den = torch.linalg.vector_norm(q, dim=-1, keepdim=True).pow_(2).mul_(n).sub_(sq * sq)
    d = torch.linalg.vecdot(q, rho).unsqueeze_(-1).mul_(n).sub_(sq * sr).div_(den)
    # a constant code vector (0/0) has no slope; a step may at most halve or double the scale
    d = d.nan_to_num(0.0, 0.0, 0.0).clamp(-0.5, 1.0)
    a = d + 1.0
    return s * a, (z - (sr - d * sq) / n).div_(a)


def _fit_chunk(w, s, z, lo, hi, *, codec, rounding: str, qmax: float, dtype: torch.dtype, o: Options,
               eager: bool):
    """Optimize one chunk of groups: ``w`` (G, g) float32; ``s``, ``z`` (G, 1) stored values;
    ``lo``, ``hi`` (G, 1) the groups' minima and maxima.

    Returns the best ``(scale, zero_point)`` per group. Eagerly, groups that stopped are dropped
    from the working set once they are the majority (the others' trajectories do not change), and
    ``shrink`` runs only on the groups where it is not exactly zero.
    """
    p = float(o.lp_norm)
    done, rows = None, None  # results of dropped groups; indices of the groups still iterating
    bounds = (lo, hi)
    best_s, best_z, best_err = s, z, torch.full_like(s, math.inf)
    active = torch.ones_like(s, dtype=torch.bool)
    beta = float(o.beta)
    for i in range(o.iters + 1):
        r, q = _residual(w, s, z, codec, rounding, qmax)
        err = _group_error(r, s, o.error_norm)
        better = err < best_err  # NaN never wins
        if o.early_stop:
            active = active & (better if o.tol == 0 else err < best_err * (1.0 - o.tol))
        best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
        best_err = torch.where(better, err, best_err)
        if i == o.iters:
            break
        if eager:
            n_active = int(active.sum())
            if n_active == 0:
                break
            if 2 * n_active <= active.shape[0]:
                done = _write(done, rows, best_s, best_z)
                keep = active.nonzero()[:, 0]
                rows = keep if rows is None else rows[keep]
                w, r, q, s, z, best_s, best_z, best_err, active, *bounds = (
                    t[keep] for t in (w, r, q, s, z, best_s, best_z, best_err, active, *bounds))
        if not eager:
            r = _shrunk(r, s, beta, p)
        else:
            need = _shrink_rows(bounds, s, z, qmax, beta ** (-1.0 / (2.0 - p)))
            if need.numel():
                r = r.index_copy_(0, need, _shrunk(r[need], s[need], beta, p))
        s_new, z_new = _update(q, r, s, z, o.refine_scale)
        s_new, z_new = _round_to(s_new, dtype), _round_to(z_new, dtype)
        ok = active & torch.isfinite(z_new) & torch.isfinite(s_new)
        s, z = torch.where(ok, s_new, best_s), torch.where(ok, z_new, best_z)
        beta *= o.kappa
    return _write(done, rows, best_s, best_z)


def _write(done, rows, s, z):
    """Merge the results ``(s, z)`` of the groups ``rows`` into ``done`` (all groups)."""
    if rows is None:
        return s, z
    return done[0].index_copy(0, rows, s), done[1].index_copy(0, rows, z)


def solve_groups(w, s, z, lo, hi, spec, o: Options):
    """All groups: ``w`` (G, g); ``s``, ``z``, ``lo``, ``hi`` (G, 1). Chunks are solved independently."""
    codec = spec.fmt.codec
    kw = dict(codec=codec, rounding=spec.rounding, qmax=float(codec.qmax),
              dtype=SCALE_DTYPES[spec.scale_dtype][0], o=o, eager=not under_transform(w))
    rows = max(1, o.chunk_size // w.shape[-1])
    if w.shape[0] <= rows:
        return _fit_chunk(w, s, z, lo, hi, **kw)
    parts = [_fit_chunk(*(t[i:i + rows] for t in (w, s, z, lo, hi)), **kw) for i in range(0, w.shape[0], rows)]
    return torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts])


def _options(path, **kw) -> Options:
    return check_options(Options, kw, step="hqq", path=path)


def supports(spec: QuantSpec) -> bool:
    """True when HQQ can optimize ``spec`` (see :func:`check_spec`)."""
    try:
        check_spec(spec)
    except (TypeError, ValueError):
        return False
    return True


def check_spec(spec: QuantSpec, *, path: str | None = None) -> None:
    """Raise unless ``spec`` is an HQQ spec: asymmetric ``uintN`` with a float zero point.

    >>> import qtransform as qt
    >>> from qtransform.algorithms import hqq
    >>> hqq.check_spec(qt.QuantSpec(format="int4", granularity=qt.PerGroup(64)))
    Traceback (most recent call last):
    ...
    ValueError: hqq: spec int4 g64 sym is not an HQQ spec: the format must be uint1..uint8 (got int4)
    """
    w = where(path)
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"{w}hqq: spec must be a QuantSpec, got {type(spec).__name__}")
    codec = spec.fmt.codec
    why = None
    if spec.fmt.family != "int" or codec.signed:
        why = f"the format must be uint1..uint8 (got {spec.format})"
    elif spec.symmetric:
        why = "it must be asymmetric (symmetric=False)"
    elif spec.zero_point_domain != "float":
        why = f"its zero point must be a float (zero_point_domain='float', got {spec.zero_point_domain!r})"
    elif spec.rounding == "stochastic":
        why = "HQQ needs deterministic rounding (half_even or half_away), not stochastic"
    elif spec.dynamic:
        why = "HQQ computes static weight parameters (dynamic=False)"
    if why:
        raise ValueError(f"{w}hqq: spec {spec} is not an HQQ spec: {why}")


def _pieces(tiles: blocks.Tiling):
    """Per axis, the ``(elements, grid cells, block length)`` ranges whose blocks tile exactly: all
    of an axis the block divides; else its whole blocks and the short last block (padding left out)."""
    out = []
    for n, b, g in zip(tiles.shape, tiles.block, tiles.grid):
        if n % b == 0:
            out.append(((slice(0, n), slice(0, g), b),))
        else:
            whole = (g - 1) * b
            tail = (slice(whole, n), slice(g - 1, g), n - whole)
            out.append(((slice(0, whole), slice(0, g - 1), b), tail) if g > 1 else (tail,))
    return out


def _solve_pieces(wf: torch.Tensor, grids, tiles: blocks.Tiling, spec: QuantSpec, o: Options, axis: int = 0,
                  ranges=()):
    """HQQ on the blocks of ``wf`` (float32, ``tiles.shape``) with their grid-shaped ``(s0, z0, lo, hi)``.

    A padded grid is solved piece by piece (whole blocks; the short last blocks on their real
    elements only), so padding never enters a block's error; the pieces are joined with ``cat``
    (no in-place writes: works under ``vmap``)."""
    if axis == len(tiles.shape):
        elems = tuple(r[0] for r in ranges)
        cells = tuple(r[1] for r in ranges)
        part = wf[elems]
        block = tuple(r[2] for r in ranges)
        sub = blocks.Tiling(tuple(part.shape), block, tuple(part.shape),
                               tuple(n // b for n, b in zip(part.shape, block)))
        flat = blocks.flat(blocks.view(part, sub), sub)
        s, z = solve_groups(flat.reshape(-1, flat.shape[-1]), *(t[cells].reshape(-1, 1) for t in grids), spec, o)
        return s.reshape(sub.grid), z.reshape(sub.grid)
    parts = [_solve_pieces(wf, grids, tiles, spec, o, axis + 1, ranges + (r,)) for r in _pieces(tiles)[axis]]
    if len(parts) == 1:
        return parts[0]
    return torch.cat([p[0] for p in parts], dim=axis), torch.cat([p[1] for p in parts], dim=axis)


def _optimize(w: torch.Tensor, spec: QuantSpec, o: Options, path: str | None) -> QParams:
    tiles = blocks.tiling(w.shape, spec, path=path)
    stats = observe(init_stats(spec), w, path=path)  # padding repeats the last element: real ranges
    init = compute_qparams(stats, spec, path=path)  # iterate 0: round-to-nearest (choose_qparams)
    s0, z0 = init.effective()
    s, z = _solve_pieces(w.detach().to(torch.float32), (s0, z0, stats.min, stats.max), tiles, spec, o)
    dtype = SCALE_DTYPES[spec.scale_dtype][0]
    return QParams(scale=s.to(dtype), zero_point=z.to(dtype), spec=spec)


def optimize(w: torch.Tensor, spec: QuantSpec, *, lp_norm: float = 0.7, beta: float = 10.0,
             kappa: float = 1.01, iters: int = 20, early_stop: bool = True, tol: float = 0.0,
             refine_scale: bool = True, error_norm: float = 2.0, chunk_size: int = _CHUNK,
             path: str | None = None) -> QParams:
    """HQQ parameters for ``w`` under ``spec``.

    Args:
        w: floating tensor (a weight), any shape the spec's blocks tile (or pad, with ``spec.pad``).
            It is not modified; the result carries no gradient.
        spec: asymmetric ``uintN`` spec with ``zero_point_domain="float"`` (see :func:`check_spec`);
            scale and zero point are stored (and optimized) in ``spec.scale_dtype``.
        lp_norm: ``p`` of the ``l_p`` error the proximal step targets, in (0, 1].
        beta: initial proximal weight; larger means less shrinkage.
        kappa: ``beta`` grows by this factor each iteration (>= 1).
        iters: maximum number of updates (0 returns the round-to-nearest parameters).
        early_stop: stop a group at its first iterate that does not improve its best error
            by the relative ``tol``; without it all ``iters`` updates run. Either way the
            best parameters seen are returned.
        tol: relative improvement a group needs to keep iterating.
        refine_scale: solve the quadratic step for scale and zero point (least-squares line per
            group); ``False`` updates the zero point only, as hqq does.
        error_norm: ``p`` of the per-group error ``||w - w_r||_p`` that ranks the iterates (and
            stops a group), ``>= 1``, ``math.inf`` allowed. ``2`` (default) returns the lowest
            squared error; a larger ``p`` weighs a group's largest errors (its clipped
            extremes) more, which the HQQ presets use because it lowers perplexity.
        chunk_size: elements per chunk of groups (a speed knob; results do not depend on it).
        path: tree path for error messages.

    Returns:
        :class:`QParams` with ``scale`` and ``zero_point`` of the grid shape, in ``spec.scale_dtype``.
        Invariant: for every group, the ``error_norm`` error of ``dequantize(quantize(w, result))``
        is at most that of ``choose_qparams(w, spec)`` (with the default, the squared error).

    Works under ``torch.func.vmap`` (then every group runs all ``iters`` updates, frozen once
    stopped, which gives the same parameters).
    """
    check_float_tensor(w, name="w", path=path)
    check_spec(spec, path=path)
    o = _options(path, lp_norm=lp_norm, beta=beta, kappa=kappa, iters=iters, early_stop=early_stop,
                 tol=tol, refine_scale=refine_scale, error_norm=error_norm, chunk_size=chunk_size)
    check_finite(w, name="w", path=path)
    return _optimize(w, spec, o, path)


def optimize_stack(ws: torch.Tensor, spec: QuantSpec, *, path: str | None = None, **options) -> QParams:
    """:func:`optimize` for a stack of equal-shape weights ``ws`` of shape ``(L, *shape)``.

    All groups of all layers are solved together (fewer, larger operations). The result equals
    ``torch.func.vmap(lambda w: optimize(w, spec))(ws)``: a :class:`QParams` whose ``scale`` and
    ``zero_point`` have a leading ``L`` axis; layer ``i`` is
    ``QParams(scale=qp.scale[i], zero_point=qp.zero_point[i], spec=spec)``.

    >>> import torch, qtransform as qt
    >>> from qtransform.algorithms import hqq
    >>> spec = qt.QuantSpec(format="uint3", granularity=qt.PerGroup(32), symmetric=False,
    ...                     zero_point_domain="float")
    >>> hqq.optimize_stack(torch.randn(4, 16, 64), spec).scale.shape
    torch.Size([4, 16, 2])
    """
    check_float_tensor(ws, name="ws", path=path)
    if ws.dim() < 2:
        raise ValueError(f"{where(path)}hqq.optimize_stack: ws must have shape (L, *shape), got "
                         f"{tuple(ws.shape)}")
    check_spec(spec, path=path)
    o = _options(path, **options)
    check_finite(ws, name="ws", path=path)
    try:
        block = spec.granularity.block_size(tuple(ws.shape[1:]))
    except ValueError as e:
        raise ValueError(f"{where(path)}{e}") from None
    stacked = spec.replace(granularity=PerBlock((1, *block)))
    qp = _optimize(ws, stacked, o, path)
    return QParams(scale=qp.scale, zero_point=qp.zero_point, spec=spec)

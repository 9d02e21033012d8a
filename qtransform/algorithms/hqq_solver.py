"""HQQ's solver: the half-quadratic iterations on groups of a weight (see :mod:`.hqq`).

Works on ``(G, g)`` float32 groups with ``(G, 1)`` stored scales and zero points; every
function is vectorized over groups (no loop over groups, only over iterations and chunks).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .._checks import under_transform
from ..formats import SCALE_DTYPES

__all__ = ["Options", "solve"]

_CHUNK = 1 << 20  # elements per chunk: a few working buffers stay in cache


class Options(NamedTuple):
    """Solver options (see :func:`optimize`)."""

    lp_norm: float = 0.7
    beta: float = 10.0
    kappa: float = 1.01
    iters: int = 20
    early_stop: bool = True
    tol: float = 0.0
    refine_scale: bool = True
    error_norm: float = 2.0
    chunk_size: int = _CHUNK


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


def solve(w, s, z, lo, hi, spec, o: Options):
    """All groups: ``w`` (G, g); ``s``, ``z``, ``lo``, ``hi`` (G, 1). Chunks are solved independently."""
    codec = spec.fmt.codec
    kw = dict(codec=codec, rounding=spec.rounding, qmax=float(codec.qmax),
              dtype=SCALE_DTYPES[spec.scale_dtype][0], o=o, eager=not under_transform(w))
    rows = max(1, o.chunk_size // w.shape[-1])
    if w.shape[0] <= rows:
        return _fit_chunk(w, s, z, lo, hi, **kw)
    parts = [_fit_chunk(*(t[i:i + rows] for t in (w, s, z, lo, hi)), **kw) for i in range(0, w.shape[0], rows)]
    return torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts])



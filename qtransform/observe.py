"""Observers as pure folds: ``init_stats`` / ``observe`` / ``merge_stats``.

>>> import torch, qtransform as qt
>>> spec = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
>>> s = qt.observe(qt.init_stats(spec), torch.tensor([[1.0, -2.0], [0.5, 4.0]]))
>>> s = qt.observe(s, torch.tensor([[3.0, 0.0], [0.0, 0.0]]))
>>> s.min.flatten().tolist(), s.max.flatten().tolist()
([-2.0, 0.0], [3.0, 4.0])

``merge_stats`` is associative (and commutative), so batches can be folded in any
grouping, on several processes or machines, and combined at the end.
"""

from __future__ import annotations

import dataclasses

import torch

from . import blocks, histogram
from ._checks import check_finite, check_float_tensor, under_transform, where
from .qtypes import HistogramStats, MinMaxStats
from .spec import QuantSpec

__all__ = ["init_stats", "observe", "merge_stats"]

Stats = MinMaxStats | HistogramStats


def init_stats(spec: QuantSpec) -> Stats:
    """Empty statistics for ``spec``'s observer (no shape needed yet)."""
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"init_stats: spec must be a QuantSpec, got {type(spec).__name__}")
    if spec.observer == "minmax":
        return MinMaxStats(spec=spec)
    return HistogramStats(spec=spec)


def _batch_stats(stats: Stats, x: torch.Tensor, path: str | None) -> Stats:
    spec = stats.spec
    p = blocks.plan(x.shape, spec, sub_block=True, path=path)
    xb = blocks.view(x.detach().to(torch.float32), p)
    if isinstance(stats, MinMaxStats):
        dims = blocks.reduce_dims(p)
        bmin, bmax = xb.amin(dims), xb.amax(dims)
        if not under_transform(x) and not bool(torch.isfinite(bmin).all() & torch.isfinite(bmax).all()):
            check_finite(x, path=path)  # raises with the offending index
        return MinMaxStats(min=bmin, max=bmax, spec=spec)
    check_finite(x, path=path)
    xf = blocks.flat(xb, p)
    n_blocks = xf[..., 0].numel()
    h = histogram.build(xf.reshape(n_blocks, -1), histogram.bins_for(spec.histogram_bins, n_blocks))
    grid = p.grid
    return HistogramStats(
        min=h["min"].reshape(grid), max=h["max"].reshape(grid),
        counts=h["counts"].reshape(*grid, -1), sums=h["sums"].reshape(*grid, -1),
        exponent=h["exponent"].reshape(grid), spec=spec,
    )


def observe(stats: Stats, x: torch.Tensor, *, path: str | None = None) -> Stats:
    """Fold one batch ``x`` into ``stats`` (returns new statistics; inputs unchanged).

    Statistics are kept per block of the spec's granularity, so their grid must agree
    between batches (per-tensor and per-channel activation stats do for any batch size).
    """
    if not isinstance(stats, (MinMaxStats, HistogramStats)):
        raise TypeError(f"{where(path)}observe: stats must come from init_stats, got {type(stats).__name__}")
    check_float_tensor(x, path=path)
    return merge_stats(stats, _batch_stats(stats, x, path), path=path)


def _empty(s: Stats) -> bool:
    return s.min is None


def merge_stats(a: Stats, b: Stats, *, path: str | None = None) -> Stats:
    """Combine two statistics of the same spec (associative and commutative)."""
    if type(a) is not type(b):
        raise TypeError(f"{where(path)}merge_stats: cannot merge {type(a).__name__} with {type(b).__name__}")
    if a.spec != b.spec:
        raise ValueError(f"{where(path)}merge_stats: statistics of different specs ({a.spec} vs {b.spec})")
    if _empty(a):
        return b
    if _empty(b):
        return a
    if a.min.shape != b.min.shape:
        raise ValueError(f"{where(path)}merge_stats: block grids differ ({tuple(a.min.shape)} vs "
                         f"{tuple(b.min.shape)}); the observed tensors' shapes are incompatible")
    if isinstance(a, MinMaxStats):
        return MinMaxStats(min=torch.minimum(a.min, b.min), max=torch.maximum(a.max, b.max), spec=a.spec)
    grid = a.min.shape
    flat = lambda s: {  # noqa: E731
        "min": s.min.reshape(-1), "max": s.max.reshape(-1), "exponent": s.exponent.reshape(-1),
        "counts": s.counts.reshape(grid.numel(), -1), "sums": s.sums.reshape(grid.numel(), -1)}
    h = histogram.merge(flat(a), flat(b))
    return dataclasses.replace(
        a, min=h["min"].reshape(grid), max=h["max"].reshape(grid), exponent=h["exponent"].reshape(grid),
        counts=h["counts"].reshape(*grid, -1), sums=h["sums"].reshape(*grid, -1))

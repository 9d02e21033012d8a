"""``minmax``: running minimum and maximum per block of a spec's granularity (the default observer).

>>> import torch, qtransform as qt
>>> spec = qt.QuantSpec(format="uint8", symmetric=False)
>>> s = qt.observe(qt.init_stats(spec), torch.tensor([-1.0, 3.0]))
>>> [t.tolist() for t in qt.finalize_stats(s)]
[[-1.0], [3.0]]
"""

from __future__ import annotations

import dataclasses

import torch

from .._checks import check_finite, under_transform, where
from .._pytree import pytree_dataclass
from ..spec import QuantSpec
from ..tensor import blocks
from .base import Observer, register_observer

__all__ = ["MinMax", "MinMaxStats", "check_grids"]


@pytree_dataclass(static=("spec", "observer"))
class MinMaxStats:
    """Running per-block minimum and maximum (grid-shaped); ``None`` before the first batch."""

    min: torch.Tensor | None = None
    max: torch.Tensor | None = None
    spec: QuantSpec | None = None
    observer: Observer | None = None


def check_grids(a: torch.Tensor, b: torch.Tensor, path) -> None:
    """Statistics of one spec merge only over the same block grid."""
    if a.shape != b.shape:
        raise ValueError(f"{where(path)}merge_stats: block grids differ ({tuple(a.shape)} vs {tuple(b.shape)}); "
                         "the observed tensors' shapes are incompatible")


@register_observer
@dataclasses.dataclass(frozen=True, kw_only=True)
class MinMax(Observer):
    """Exact per-block minimum and maximum: the range that clips nothing."""

    name = "minmax"
    reduction = {"min": "min", "max": "max"}
    needs_spec = True
    gives_range = True

    def init(self, spec=None):
        return MinMaxStats(spec=spec, observer=self)

    def batch(self, stats, x, *, path=None):
        p = blocks.tiling(x.shape, stats.spec, sub_block=True, path=path)
        xb = blocks.view(x.detach().to(torch.float32), p)
        dims = blocks.reduce_dims(p)
        bmin, bmax = xb.amin(dims), xb.amax(dims)
        if not under_transform(x) and not bool(torch.isfinite(bmin).all() & torch.isfinite(bmax).all()):
            check_finite(x, path=path)  # raises with the offending index
        return dataclasses.replace(stats, min=bmin, max=bmax)

    def merge(self, a, b, *, path=None):
        check_grids(a.min, b.min, path)
        return dataclasses.replace(a, min=torch.minimum(a.min, b.min), max=torch.maximum(a.max, b.max))

    def finalize(self, stats, *, path=None):
        return stats.min, stats.max

    def range(self, stats, spec, *, path=None):
        return stats.min, stats.max

"""``channel``: per-channel magnitudes of activations (what SmoothQuant and AWQ scale by).

For a batch ``x`` with channels along ``axis`` (the last, input features of the next layer, by
default) it keeps per channel the maximum of ``|x|`` (reduced by max) and the sums of ``|x|`` and
``x²`` with the number of values per channel (reduced by sum). Each batch's sums (float32) accumulate in
float64, where adding float32 values is exact in practice: the totals do not depend on how the batches were
split or ordered (across processes too). ``finalize`` gives
:class:`ChannelSummary` ``(absmax, mean_abs, mean_square)``.

>>> import torch, qtransform as qt
>>> s = qt.observe(qt.init_stats(observer="channel"), torch.tensor([[1.0, -4.0], [-3.0, 0.0]]))
>>> r = qt.finalize_stats(s)
>>> r.absmax.tolist(), r.mean_abs.tolist(), r.mean_square.tolist()
([3.0, 4.0], [2.0, 2.0], [5.0, 8.0])
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from .._checks import check_finite, where
from .._pytree import pytree_dataclass
from ..spec import QuantSpec
from .base import Observer, register_observer

__all__ = ["Channel", "ChannelStats", "ChannelSummary"]


@pytree_dataclass(static=("spec", "observer"))
class ChannelStats:
    """Per-channel ``absmax`` (float32), ``abs_sum``, ``sq_sum`` (float64; shape (channels,)) and ``count``
    (int64, shape ()) values per channel."""

    absmax: torch.Tensor | None = None
    abs_sum: torch.Tensor | None = None
    sq_sum: torch.Tensor | None = None
    count: torch.Tensor | None = None
    spec: QuantSpec | None = None
    observer: Observer | None = None


class ChannelSummary(NamedTuple):
    absmax: torch.Tensor
    mean_abs: torch.Tensor
    mean_square: torch.Tensor


@register_observer
@dataclasses.dataclass(frozen=True, kw_only=True)
class Channel(Observer):
    """Statistics per index along ``axis``."""

    axis: int = -1

    name = "channel"
    reduction = {"absmax": "max", "abs_sum": "sum", "sq_sum": "sum", "count": "sum"}

    def __post_init__(self):
        if not isinstance(self.axis, int) or isinstance(self.axis, bool):
            raise TypeError(f"channel: axis must be an int, got {self.axis!r}")

    def init(self, spec=None):
        return ChannelStats(observer=self)

    def batch(self, stats, x, *, path=None):
        if not -x.dim() <= self.axis < x.dim():
            raise ValueError(f"{where(path)}channel: axis {self.axis} is out of range for shape {tuple(x.shape)}")
        check_finite(x, path=path)
        a = x.detach().to(torch.float32).movedim(self.axis, -1)
        a = a.reshape(-1, a.shape[-1]).abs()
        count = torch.tensor(a.shape[0], dtype=torch.int64, device=x.device)
        return dataclasses.replace(stats, absmax=a.amax(0), abs_sum=a.sum(0).double(),
                                   sq_sum=(a * a).sum(0).double(), count=count)

    def merge(self, a, b, *, path=None):
        if a.absmax.shape != b.absmax.shape:
            raise ValueError(f"{where(path)}merge_stats: {a.absmax.shape[0]} and {b.absmax.shape[0]} channels")
        return dataclasses.replace(a, absmax=torch.maximum(a.absmax, b.absmax), abs_sum=a.abs_sum + b.abs_sum,
                                   sq_sum=a.sq_sum + b.sq_sum, count=a.count + b.count)

    def finalize(self, stats, *, path=None) -> ChannelSummary:
        n = stats.count.clamp(min=1).to(torch.float64)
        return ChannelSummary(stats.absmax, (stats.abs_sum / n).float(), (stats.sq_sum / n).float())

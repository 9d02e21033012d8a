"""``percentile``: clip each block's range at a percentile of its observed values.

Symmetric specs clip ``|x|`` at its ``p``-th percentile; asymmetric specs clip each tail at
``(100 - p) / 2`` percent (linear interpolation inside histogram bins; never beyond the
observed min/max). Statistics are mergeable histograms (:mod:`qtransform.observers.histogram`).

>>> import torch, qtransform as qt
>>> spec = qt.QuantSpec(format="int8", granularity=qt.PerTensor())
>>> x = torch.cat([torch.linspace(-1, 1, 999), torch.tensor([100.0])])
>>> lo, hi = qt.finalize_stats(qt.observe(qt.init_stats(spec, observer="percentile", percentile=99.0), x))
>>> round(hi.item(), 2)
0.99
"""

from __future__ import annotations

import dataclasses

import torch

from ..spec import QuantSpec
from .base import register_observer
from .histogram import HistogramObserver, HistogramStats

__all__ = ["Percentile", "percentile_range"]


@register_observer
@dataclasses.dataclass(frozen=True, kw_only=True)
class Percentile(HistogramObserver):
    """Keep ``percentile`` % of the values (in (50, 100]) inside the range."""

    percentile: float = 99.99

    name = "percentile"

    def __post_init__(self):
        super().__post_init__()
        p = self.percentile
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 50.0 < float(p) <= 100.0:
            raise ValueError(f"percentile: percentile must be in (50, 100], got {p!r}")
        object.__setattr__(self, "percentile", float(p))

    def range(self, stats, spec, *, path=None):
        return percentile_range(stats, spec, self.percentile)


def _bin_edges_value(index_frac: torch.Tensor, exponent: torch.Tensor, nb: int, *, centered: bool):
    width = torch.exp2(exponent.to(torch.float32))  # range half-width R
    if centered:
        return index_frac * 2 * width / nb - width
    return index_frac * width / (nb // 2)



def _quantile(cum: torch.Tensor, counts: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Fractional bin position where the cumulative count reaches ``target`` (per row)."""
    i = torch.searchsorted(cum, target.unsqueeze(-1).contiguous()).clamp(max=cum.shape[-1] - 1)
    prev = torch.where(i > 0, cum.gather(-1, (i - 1).clamp(min=0)), torch.zeros_like(target.unsqueeze(-1)))
    c = counts.gather(-1, i).clamp(min=1)
    frac = ((target.unsqueeze(-1) - prev) / c).clamp(0, 1)
    return (i.to(torch.float32) + frac).squeeze(-1)



def percentile_range(stats: HistogramStats, spec: QuantSpec, percentile: float):
    """``(lo, hi)`` keeping ``percentile`` % of the observed values of each block unclipped."""
    counts = stats.counts.to(torch.float64)
    nb = counts.shape[-1]
    total = counts.sum(-1)
    keep = percentile / 100.0
    if spec.symmetric:
        half = nb // 2
        folded = counts[..., half:] + counts[..., :half].flip(-1)  # |x| histogram
        pos = _quantile(folded.cumsum(-1), folded, keep * total)
        amax = _bin_edges_value(pos, stats.exponent, nb, centered=False)
        amax = torch.minimum(amax, torch.maximum(-stats.min, stats.max))
        return -amax, amax
    tail = (1.0 - keep) / 2 * total
    cum = counts.cumsum(-1)
    lo = _bin_edges_value(_quantile(cum, counts, tail), stats.exponent, nb, centered=True)
    hi = _bin_edges_value(_quantile(cum, counts, total - tail), stats.exponent, nb, centered=True)
    lo = torch.maximum(lo, stats.min)
    hi = torch.minimum(torch.maximum(hi, lo), stats.max)
    return lo, hi

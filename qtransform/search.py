"""Clipping-range searches over histograms: percentile and MSE.

Both return grid-shaped ``(lo, hi)`` ranges that :func:`qtransform.scales.from_range`
turns into quantization parameters.

* **percentile**: symmetric specs clip ``|x|`` at its ``p``-th percentile; asymmetric
  specs clip each tail at ``(100 - p) / 2`` percent (linear interpolation inside bins;
  never beyond the observed min/max).
* **MSE**: ``MSE_CANDIDATES`` candidate ranges per block, shrinking ``[min, max]`` from
  100% to ``MSE_MIN_RATIO`` of its width (towards 0, or towards the middle for float zero
  points), each scored by the squared quantization error of the observed data: every
  histogram bin contributes its count at its mean value, so the score is exact up to
  bins that straddle a rounding boundary. The first best candidate wins.
"""

from __future__ import annotations

import torch

from . import scales
from .quantize import roundtrip_blocks
from .qtypes import HistogramStats
from .spec import QuantSpec

__all__ = ["percentile_range", "mse_range", "MSE_CANDIDATES", "MSE_MIN_RATIO"]

MSE_CANDIDATES = 100
MSE_MIN_RATIO = 0.2


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


def percentile_range(stats: HistogramStats, spec: QuantSpec):
    counts = stats.counts.to(torch.float64)
    nb = counts.shape[-1]
    total = counts.sum(-1)
    keep = spec.percentile / 100.0
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


def _shrink(lo, hi, r, spec: QuantSpec):
    if spec.symmetric:
        amax = torch.maximum(-lo, hi) * r
        return -amax, amax
    if spec.zero_point_domain == "float":
        mid = (lo + hi) / 2
        return mid + (lo - mid) * r, mid + (hi - mid) * r
    return lo * r, hi * r


def mse_range(stats: HistogramStats, spec: QuantSpec):
    counts = stats.counts.to(torch.float32)
    means = torch.where(counts > 0, stats.sums / counts.clamp(min=1), torch.zeros_like(stats.sums))
    best_err = best_lo = best_hi = None
    for r in torch.linspace(1.0, MSE_MIN_RATIO, MSE_CANDIDATES).tolist():
        lo, hi = _shrink(stats.min, stats.max, r, spec)
        s, z = scales.effective(scales.from_range(lo, hi, spec))
        s, z = s.unsqueeze(-1), (None if z is None else z.unsqueeze(-1))
        v = means / s if z is None else means / s + z
        g = roundtrip_blocks(v, spec)
        deq = (g if z is None else g - z) * s
        err = (counts * (means - deq) ** 2).sum(-1)
        if best_err is None:
            best_err, best_lo, best_hi = err, lo, hi
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_lo, best_hi = torch.where(better, lo, best_lo), torch.where(better, hi, best_hi)
    return best_lo, best_hi

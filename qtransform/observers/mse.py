"""``mse``: the clipping range per block that minimizes the squared quantization error.

``candidates`` ranges per block, shrinking ``[min, max]`` from 100% to ``min_ratio`` of its
width (towards 0, or towards the middle for float zero points), each scored by the squared
quantization error of the observed data under the target spec: every histogram bin
contributes its count at its mean value, so the score is exact up to bins that straddle a
rounding boundary. The first best candidate wins.

>>> import torch, qtransform as qt
>>> spec = qt.QuantSpec(format="int4", granularity=qt.PerTensor())
>>> x = torch.cat([torch.randn(4000, generator=torch.Generator().manual_seed(0)), torch.tensor([40.0])])
>>> lo, hi = qt.finalize_stats(qt.observe(qt.init_stats(spec, observer="mse"), x))
>>> bool(hi < 40.0)  # one far outlier is clipped: the other 4000 values gain resolution
True
"""

from __future__ import annotations

import dataclasses

import torch

from ..spec import QuantSpec
from ..tensor import QParams, roundtrip_blocks
from .base import register_observer
from .histogram import HistogramObserver, HistogramStats

__all__ = ["MSE", "mse_range"]


@register_observer
@dataclasses.dataclass(frozen=True, kw_only=True)
class MSE(HistogramObserver):
    """Search ``candidates`` ranges from 100% down to ``min_ratio`` of ``[min, max]``."""

    candidates: int = 100
    min_ratio: float = 0.2

    name = "mse"

    def __post_init__(self):
        super().__post_init__()
        c, r = self.candidates, self.min_ratio
        if not isinstance(c, int) or isinstance(c, bool) or c < 1:
            raise ValueError(f"mse: candidates must be a positive int, got {c!r}")
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 < float(r) <= 1.0:
            raise ValueError(f"mse: min_ratio must be in (0, 1], got {r!r}")
        object.__setattr__(self, "min_ratio", float(r))

    def range(self, stats, spec, *, path=None):
        return mse_range(stats, spec, candidates=self.candidates, min_ratio=self.min_ratio)


def _shrink(lo, hi, r, spec: QuantSpec):
    if spec.symmetric:
        amax = torch.maximum(-lo, hi) * r
        return -amax, amax
    if spec.zero_point_domain in ("float", "offset"):
        mid = (lo + hi) / 2
        return mid + (lo - mid) * r, mid + (hi - mid) * r
    return lo * r, hi * r



def mse_range(stats: HistogramStats, spec: QuantSpec, *, candidates: int = 100, min_ratio: float = 0.2):
    """The best of ``candidates`` shrunk ranges per block by the squared error of quantizing with ``spec``."""
    counts = stats.counts.to(torch.float32)
    means = torch.where(counts > 0, stats.sums / counts.clamp(min=1), torch.zeros_like(stats.sums))
    best_err = best_lo = best_hi = None
    for r in torch.linspace(1.0, min_ratio, candidates).tolist():
        lo, hi = _shrink(stats.min, stats.max, r, spec)
        s, z = QParams.from_range(lo, hi, spec).effective()
        s, z = s.unsqueeze(-1), (None if z is None else z.unsqueeze(-1))
        offset = spec.zero_point_domain == "offset"
        v = means / s if z is None else (means - z) / s if offset else means / s + z
        g = roundtrip_blocks(v, spec)
        deq = g * s if z is None else g * s + z if offset else (g - z) * s
        err = (counts * (means - deq) ** 2).sum(-1)
        if best_err is None:
            best_err, best_lo, best_hi = err, lo, hi
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_lo, best_hi = torch.where(better, lo, best_lo), torch.where(better, hi, best_hi)
    return best_lo, best_hi

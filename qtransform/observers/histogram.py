"""Mergeable per-block histograms: the fold behind the ``percentile`` and ``mse`` observers.

Block ``b`` keeps ``bins`` equal bins over ``[-2^k_b, 2^k_b)`` with ``amax_b < 2^k_b``. When new data exceeds
the range, ``k_b`` grows and adjacent bins merge (bin ``i`` goes to
``((i - bins/2) >> shift) + bins/2``), which commutes with adding counts; histograms
with different bin counts merge at the coarser resolution. Counts therefore merge
exactly and associatively; value sums (used for bin means) up to float rounding.

Memory is ``blocks * bins * 12`` bytes; fine granularities get fewer bins so that a
histogram holds at most ``MAX_ENTRIES`` bins in total (at least 64 per block).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .._checks import check_finite
from .._pytree import pytree_dataclass
from ..spec import QuantSpec
from ..tensor import blocks
from .base import Observer
from .minmax import check_grids

__all__ = ["HistogramStats", "HistogramObserver", "bins_for", "build_histogram", "merge", "MAX_ENTRIES"]

MAX_ENTRIES = 1 << 23
_MIN_EXP = -126


def bins_for(requested: int, n_blocks: int) -> int:
    """Bins per block for ``n_blocks`` blocks (a power of two, 64..requested)."""
    cap = 1 << max(6, int(math.floor(math.log2(max(1, MAX_ENTRIES // max(1, n_blocks))))))
    return max(64, min(requested, cap))


def _exponent(amax: torch.Tensor) -> torch.Tensor:
    """Smallest ``k`` with ``amax < 2^k`` (so no value sits on the clamped top edge)."""
    k = torch.frexp(amax)[1]
    return torch.where(amax > 0, k, torch.full_like(k, _MIN_EXP)).clamp(_MIN_EXP, 127).to(torch.int64)


def _scatter(values: torch.Tensor, index: torch.Tensor, nb: int) -> torch.Tensor:
    """Sum ``values`` (G, m) into ``nb`` bins per row at ``index`` (G, m)."""
    G = values.shape[0]
    offset = (torch.arange(G, device=values.device) * nb).unsqueeze(1)
    out = torch.zeros(G * nb, dtype=values.dtype, device=values.device)
    out = out.index_add(0, (index + offset).reshape(-1), values.reshape(-1))
    return out.reshape(G, nb)


def build_histogram(xf: torch.Tensor, bins: int) -> dict:
    """Histogram of ``xf`` (G, m): one row per block."""
    bmin, bmax = xf.amin(1), xf.amax(1)
    k = _exponent(torch.maximum(bmin.abs(), bmax.abs()))
    half = bins // 2
    # exact: power-of-two scaling in float64 (no float32 underflow of subnormals), then floor,
    # so binning then rebinning equals binning at the final range
    scaled = xf.to(torch.float64) / torch.exp2(k.to(torch.float64)).unsqueeze(1) * half
    idx = (scaled.floor().long() + half).clamp_(0, bins - 1)
    counts = _scatter(torch.ones_like(xf, dtype=torch.int64), idx, bins)
    sums = _scatter(xf, idx, bins)
    return {"min": bmin, "max": bmax, "counts": counts, "sums": sums, "exponent": k}


def _rebin(counts, sums, k_old, k_new):
    """Re-express histograms at the (larger or equal) exponents ``k_new``."""
    G, nb = counts.shape
    half = nb // 2
    shift = (k_new - k_old).clamp(0, 62).unsqueeze(1)
    i = torch.arange(nb, device=counts.device).unsqueeze(0) - half
    j = torch.bitwise_right_shift(i, shift) + half  # arithmetic shift: floor division
    return _scatter(counts, j, nb), _scatter(sums, j, nb)


def _coarsen(counts, sums, nb):
    G, n = counts.shape
    f = n // nb
    return counts.reshape(G, nb, f).sum(-1), sums.reshape(G, nb, f).sum(-1)


def merge(a: dict, b: dict) -> dict:
    """Merge two histogram dicts of equal block count (exact for counts, associative)."""
    nb = min(a["counts"].shape[1], b["counts"].shape[1])
    k = torch.maximum(a["exponent"], b["exponent"])
    parts = []
    for h in (a, b):
        c, s = _coarsen(h["counts"], h["sums"], nb)
        parts.append(_rebin(c, s, h["exponent"], k))
    return {
        "min": torch.minimum(a["min"], b["min"]),
        "max": torch.maximum(a["max"], b["max"]),
        "counts": parts[0][0] + parts[1][0],
        "sums": parts[0][1] + parts[1][1],
        "exponent": k,
    }


@pytree_dataclass(static=("spec", "observer"))
class HistogramStats:
    """Per-block histograms for the percentile and MSE observers.

    Each block has ``counts`` and value ``sums`` over ``bins`` equal bins spanning
    ``[-2^exponent, 2^exponent)``; the range doubles (adjacent bins merge) when data grows,
    so merging is exact for counts and associative. ``min``/``max`` are exact.
    Shapes: ``counts``, ``sums``: ``grid + (bins,)``; ``exponent``, ``min``, ``max``: ``grid``.
    """

    min: torch.Tensor | None = None
    max: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    sums: torch.Tensor | None = None
    exponent: torch.Tensor | None = None
    spec: QuantSpec | None = None
    observer: Observer | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class HistogramObserver(Observer):
    """Base of the histogram range observers: ``bins`` per block (a power of two >= 64; fine
    granularities get fewer so that one histogram holds at most ``MAX_ENTRIES`` bins)."""

    bins: int = 2048

    reduction = {"min": "min", "max": "max", "counts": "merge", "sums": "merge", "exponent": "merge"}
    needs_spec = True
    gives_range = True

    def __post_init__(self):
        b = self.bins
        if not isinstance(b, int) or isinstance(b, bool) or b < 64 or b & (b - 1):
            raise ValueError(f"{self.name}: bins must be a power of two >= 64, got {b!r}")

    def init(self, spec=None):
        return HistogramStats(spec=spec, observer=self)

    def batch(self, stats, x, *, path=None):
        check_finite(x, path=path)
        p = blocks.tiling(x.shape, stats.spec, sub_block=True, path=path)
        xf = blocks.flat(blocks.view(x.detach().to(torch.float32), p), p)
        n_blocks = xf[..., 0].numel()
        h = build_histogram(xf.reshape(n_blocks, -1), bins_for(self.bins, n_blocks))
        return _from_flat(stats, h, p.grid)

    def merge(self, a, b, *, path=None):
        check_grids(a.min, b.min, path)
        grid = a.min.shape
        return _from_flat(a, merge(_flat(a), _flat(b)), grid)

    def finalize(self, stats, *, path=None):
        return self.range(stats, stats.spec, path=path)


def _flat(s: HistogramStats) -> dict:
    n = s.min.numel()
    return {"min": s.min.reshape(-1), "max": s.max.reshape(-1), "exponent": s.exponent.reshape(-1),
            "counts": s.counts.reshape(n, -1), "sums": s.sums.reshape(n, -1)}


def _from_flat(like: HistogramStats, h: dict, grid) -> HistogramStats:
    return dataclasses.replace(like, min=h["min"].reshape(grid), max=h["max"].reshape(grid),
                               exponent=h["exponent"].reshape(grid), counts=h["counts"].reshape(*grid, -1),
                               sums=h["sums"].reshape(*grid, -1))

"""Mergeable per-block histograms (the fold behind the percentile and MSE observers).

Block ``b`` keeps ``bins`` equal bins over ``[-2^k_b, 2^k_b)`` with ``amax_b < 2^k_b``. When new data exceeds
the range, ``k_b`` grows and adjacent bins merge (bin ``i`` goes to
``((i - bins/2) >> shift) + bins/2``), which commutes with adding counts; histograms
with different bin counts merge at the coarser resolution. Counts therefore merge
exactly and associatively; value sums (used for bin means) up to float rounding.

Memory is ``blocks * bins * 12`` bytes; fine granularities get fewer bins so that a
histogram holds at most ``MAX_ENTRIES`` bins in total (at least 64 per block).
"""

from __future__ import annotations

import math

import torch

__all__ = ["bins_for", "build", "merge", "MAX_ENTRIES"]

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


def build(xf: torch.Tensor, bins: int) -> dict:
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

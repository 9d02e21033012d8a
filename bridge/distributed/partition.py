"""Which calibration batches each rank runs: contiguous, balanced by tokens, the same split on every rank.

Contiguous slices in rank order keep every fold in the one-process order: statistics merged in rank order
(histograms, row samples) are the one-process statistics, and sums are exact (float64 accumulation), so the
split changes nothing but who computes what. A batch is never cut: every rank runs whole batches, as the
one-process run does, so each batch's numbers are the same wherever it runs.

>>> share_bounds([4, 4, 4, 4, 4, 4], 2)
[0, 3, 6]
>>> share_bounds([8, 1, 1, 1, 1, 1, 1, 1, 1], 2)
[0, 1, 9]
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["share_bounds", "share", "raw_tokens"]


def share_bounds(sizes: Sequence[int], world: int) -> list[int]:
    """``[0, b1, ..., len(sizes)]``: rank ``r`` runs batches ``b_r .. b_{r+1}-1``; each boundary the one whose
    cumulative size is nearest ``total · r / world``, every rank at least one batch. ``ValueError`` when there
    are fewer batches than ranks."""
    n = len(sizes)
    if n < world:
        raise ValueError(f"distributed calibration: {n} calibration batch(es) for {world} ranks; every rank needs "
                         f"at least one batch (use more calibration samples or a smaller batch size)")
    cum = [0]
    for s in sizes:
        cum.append(cum[-1] + max(int(s), 0))
    total = cum[-1]
    bounds = [0]
    for r in range(1, world):
        ideal = total * r / world
        lo, hi = bounds[-1] + 1, n - (world - r)
        best = min(range(lo, hi + 1), key=lambda i: (abs(cum[i] - ideal), i))
        bounds.append(best)
    return bounds + [n]


def share(items: Sequence, sizes: Sequence[int], world: int, rank: int) -> list:
    """Rank ``rank``'s contiguous share of ``items`` (see :func:`share_bounds`)."""
    if len(items) != len(sizes):
        raise ValueError(f"share: {len(items)} items but {len(sizes)} sizes")
    b = share_bounds(sizes, world)
    return list(items[b[rank]:b[rank + 1]])


def raw_tokens(batch) -> int:
    """Tokens in a calibration batch as given (token ids ``(batch, seq)``, or a dict holding ``input_ids`` or
    tensors): the element count of its ids, used only to balance the shares."""
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    if isinstance(batch, dict):
        t = batch.get("input_ids")
        if not isinstance(t, torch.Tensor):
            t = next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
        return 0 if t is None else t.numel()
    if isinstance(batch, (list, tuple)):
        return sum(raw_tokens(b) for b in batch)
    return 1

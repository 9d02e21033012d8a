"""How a step shares its work among processes, without knowing how they talk.

A block-by-block step (:class:`~qtransform.Block`) gets ``block.parallel``: the ranks that run the same
step on disjoint shares of the calibration data. The core never imports ``torch.distributed``; the
bridge (:mod:`bridge.distributed`) implements :class:`Parallel` with its collectives, and
:data:`SERIAL` is the one-process case, where every method is the identity.

Contract (every rank calls the same methods in the same order):

* ``world``/``rank``: how many processes, and which one this is;
* :meth:`Parallel.owners`: a deterministic owner rank for each work item from its cost (the same answer on
  every rank, computed locally: longest work first, each to the least loaded rank);
* :meth:`Parallel.all_sum`: a tensor summed over the ranks (every rank gets the sum; float64 sums of
  float32 partials are exact, so the result does not depend on the split);
* :meth:`Parallel.gather`: a picklable value from every rank, in rank order, on every rank;
* :meth:`Parallel.share`: each item's value, computed on its owner only, on every rank;
* :meth:`Parallel.reduce_stats`: observer statistics folded on each rank's share, reduced with each
  observer's declared reduction (``Observer.reduction``) to every rank, or only to each item's owner.

>>> import torch, qtransform as qt
>>> qt.SERIAL.owners({"a": 3.0, "b": 1.0}), qt.SERIAL.all_sum(torch.tensor(2.0)).item()
({'a': 0, 'b': 0}, 2.0)
>>> lpt({"q": 8.0, "mlp": 20.0, "o": 5.0, "k": 7.0}, 2)
{'q': 1, 'mlp': 0, 'o': 1, 'k': 1}
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping

import torch

__all__ = ["Parallel", "SERIAL", "lpt"]


def lpt(costs: Mapping[Hashable, float], world: int) -> dict:
    """Owners by longest-processing-time-first: items by decreasing cost (ties in the mapping's order), each
    to the rank with the least cost so far (ties: the lowest rank). Deterministic, so every rank computes
    the same assignment on its own."""
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"lpt: world must be an int >= 1, got {world!r}")
    order = sorted(enumerate(costs.items()), key=lambda t: (-float(t[1][1]), t[0]))
    load = [0.0] * world
    out = {}
    for _, (key, cost) in order:
        r = min(range(world), key=lambda i: (load[i], i))
        out[key] = r
        load[r] += float(cost)
    return {k: out[k] for k in costs}


class Parallel:
    """One process (the base class is :data:`SERIAL`); the bridge's process group overrides the methods."""

    world: int = 1
    rank: int = 0

    def owners(self, costs: Mapping[Hashable, float]) -> dict:
        """``{item: rank}`` for ``costs`` (``{item: cost}``), the same on every rank (:func:`lpt`)."""
        return lpt(costs, self.world)

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks (a new tensor; float64 recommended for sums that must not depend
        on the split)."""
        return t

    def gather(self, value: Any) -> list:
        """``[value of rank 0, value of rank 1, ...]`` on every rank."""
        return [value]

    def share(self, values: Mapping[Hashable, Any], owners: Mapping[Hashable, int]) -> dict:
        """``{item: value}`` for every item of ``owners``, each computed by its owner (``values`` holds the
        items this rank owns; tensors travel by their owner's broadcast)."""
        missing = [k for k, r in owners.items() if r == self.rank and k not in values]
        if missing:
            raise ValueError(f"Parallel.share: rank {self.rank} owns {missing[:3]} but gave no value for them")
        return {k: values[k] for k in owners}

    def reduce_stats(self, stats: Mapping[Hashable, Any], owners: Mapping[Hashable, int] | None = None) -> dict:
        """Each rank's statistics (``{key: stats}``, folded on its share of the data) reduced over the ranks
        by each observer's ``reduction``: on every rank (``owners=None``), or ``stats[key]`` only on rank
        ``owners[key]`` (the others get no entry for it)."""
        if owners is None:
            return dict(stats)
        return {k: s for k, s in stats.items() if owners.get(k, 0) == self.rank}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world={self.world}, rank={self.rank})"


#: The one-process :class:`Parallel`.
SERIAL = Parallel()

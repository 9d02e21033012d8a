"""``TorchParallel``: :class:`qtransform.Parallel` over a ``torch.distributed`` process group.

gloo on CPU, NCCL on GPUs (collectives then travel on this rank's CUDA device). Statistics reduce by
each observer's declared reduction (``Observer.reduction``): ``sum`` fields are all-reduced in float64
(exact for the float32 sums of each rank's share, so N ranks give the one-process sums), ``max``/``min``
fields by ``MAX``/``MIN``, and observers with a ``merge`` field (histograms, row samples) are gathered and
merged in rank order (the ranks' shares being contiguous, that is the one-process order). With owners, a
statistic goes only to its owner (``reduce``/``gather`` to that rank, not to all).

:func:`current` is what the bridge uses by default: the initialised default group when it has more than one
process, else :data:`qtransform.SERIAL`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Mapping

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

import qtransform as qt

__all__ = ["TorchParallel", "current", "to_cpu"]

_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def to_cpu(value):
    """``value`` (a pytree: dicts, lists, qtransform's statistics, QParams, QTensors) with every tensor moved
    to the CPU: what travels in object collectives (a CUDA tensor would unpickle on the sender's device)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), value)


def _to(value, device):
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), value)


def _fields(stats) -> dict:
    return {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats) if f.name in stats.observer.reduction}


def _neutral(how: str, shape, dtype) -> torch.Tensor:
    if how == "sum":
        return torch.zeros(shape, dtype=dtype)
    if dtype.is_floating_point:
        return torch.full(shape, -torch.inf if how == "max" else torch.inf, dtype=dtype)
    info = torch.iinfo(dtype)
    return torch.full(shape, info.min if how == "max" else info.max, dtype=dtype)


class TorchParallel(qt.Parallel):
    """The ranks of ``group`` (default: the default process group, which must be initialised)."""

    def __init__(self, group=None, *, device: torch.device | str | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("TorchParallel: torch.distributed has no initialised process group (launch with "
                             "torchrun, or call torch.distributed.init_process_group first)")
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        nccl = dist.get_backend(group) == "nccl"
        self.comm = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = torch.device(device) if device is not None else self.comm

    # -- collectives ---------------------------------------------------------------------------------------
    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        x = t.detach().to(self.comm, copy=True)
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x.to(t.device)

    def gather(self, value: Any) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, to_cpu(value), group=self.group)
        return out

    def share(self, values: Mapping[Hashable, Any], owners: Mapping[Hashable, int]) -> dict:
        missing = [k for k, r in owners.items() if r == self.rank and k not in values]
        if missing:
            raise ValueError(f"Parallel.share: rank {self.rank} owns {missing[:3]} but gave no value for them")
        got = {}
        for r in sorted(set(owners.values())):
            box = [to_cpu({k: values[k] for k in owners if owners[k] == r}) if r == self.rank else None]
            dist.broadcast_object_list(box, src=self._global(r), group=self.group)
            got.update(box[0])
        return {k: _to(got[k], self.device) for k in owners}

    # -- statistics ----------------------------------------------------------------------------------------
    def reduce_stats(self, stats: Mapping[Hashable, Any], owners: Mapping[Hashable, int] | None = None) -> dict:
        keys = sorted(stats, key=repr)  # the same order on every rank (a dict built from a set need not be)
        # what each rank holds: empty or not, and each field's shape and dtype (a rank may have seen no data)
        shapes = {k: None if qt.observers.is_empty(stats[k]) else {f: (tuple(t.shape), t.dtype)
                                                                  for f, t in _fields(stats[k]).items()} for k in keys}
        every = self.gather(shapes)
        out = {}
        for k in keys:
            s, dst = stats[k], None if owners is None else owners[k]
            how = s.observer.reduction
            held = [e[k] for e in every]
            if all(h is None for h in held):
                if dst is None or dst == self.rank:
                    out[k] = s
                continue
            if "merge" in how.values():
                merged = self._merge(s, dst)
                if merged is not None:
                    out[k] = merged
                continue
            ref = next(h for h in held if h is not None)
            new = {}
            for f, (shape, dtype) in ref.items():
                t = getattr(s, f)
                wide = torch.float64 if dtype.is_floating_point and how[f] == "sum" else dtype
                x = (_neutral(how[f], shape, wide) if t is None else t.detach().to(wide)).to(self.comm, copy=True)
                op = getattr(dist.ReduceOp, _OPS[how[f]])
                if dst is None:
                    dist.all_reduce(x, op=op, group=self.group)
                else:
                    dist.reduce(x, dst=self._global(dst), op=op, group=self.group)
                new[f] = x.to(self.device if t is None else t.device)
            if dst is None or dst == self.rank:
                out[k] = dataclasses.replace(s, **new)
        return out

    def _merge(self, s, dst):
        """Gather ``s`` from every rank (to ``dst`` only, when given) and merge in rank order."""
        mine = to_cpu(s)
        if dst is None:
            parts = self.gather(mine)
        else:
            parts = [None] * self.world if dst == self.rank else None
            dist.gather_object(mine, parts, dst=self._global(dst), group=self.group)
            if dst != self.rank:
                return None
        device = next((t.device for t in _fields(s).values() if t is not None), self.device)
        total = parts[0]
        for p in parts[1:]:
            total = qt.merge_stats(total, p)
        return _to(total, device)


def current(*, device: torch.device | str | None = None) -> qt.Parallel:
    """The default process group as a :class:`TorchParallel` when torch.distributed is initialised with more
    than one process, else :data:`qtransform.SERIAL`."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchParallel(device=device)
    return qt.SERIAL

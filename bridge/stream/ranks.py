"""A streamed run on several ranks (``torchrun``): who writes, where each rank keeps its scratch, and how the
ranks agree.

Every rank reads the same input shards (each tensor ``pread`` from the shared files when its turn comes:
nothing is copied per rank) and computes the same quantized tensors; rank 0 alone writes the output
(shards, index, config, manifest), the others hand it a :class:`NoFiles`. What a rank keeps for itself (its
share of the calibration activations spilled to disk, its snapshots for a resume) lives in its own
:func:`scratch` directory, so that the ranks never collide and each restores its own share. Steps that can
fail on rank 0 alone (opening the work directory, finishing and publishing the checkpoint) run through
:func:`on_rank0`: its error is raised on every rank, so that none waits for a rank that stopped.

>>> import qtransform as qt
>>> on_rank0(qt.SERIAL, lambda: {"done": ["block 0"]}), to_rank0(qt.SERIAL, 3)
({'done': ['block 0']}, [3])
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import torch

import qtransform as qt

__all__ = ["NoFiles", "on_rank0", "barrier", "to_rank0", "scratch", "drop_scratch"]

#: errors raised again on every rank by :func:`on_rank0` (others become a RuntimeError naming rank 0's)
_KINDS = {e.__name__: e for e in (ValueError, TypeError, FileExistsError, FileNotFoundError, OSError, KeyError)}


class NoFiles:
    """The writer of the ranks other than 0: takes every tensor, writes nothing."""

    sums: dict = {}

    def put(self, tensors) -> None:
        pass

    def put_raw(self, name, source, begin, end, dtype, shape) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def on_rank0(parallel: qt.Parallel, fn: Callable[[], Any]) -> Any:
    """``fn()`` run on rank 0 only; its value (picklable) on every rank, or its error raised on every rank
    (of the same class for the usual ones, with rank 0's message)."""
    if parallel.world == 1:
        return fn()
    box = None
    if parallel.rank == 0:
        try:
            box = ("ok", fn())
        except BaseException as e:
            parallel.share({"r": ("error", type(e).__name__, str(e))}, {"r": 0})
            raise
    got = parallel.share({"r": box} if parallel.rank == 0 else {}, {"r": 0})["r"]
    if got[0] == "error":
        _, kind, msg = got
        raise _KINDS.get(kind, RuntimeError)(msg if kind in _KINDS else f"rank 0: {kind}: {msg}")
    return got[1]


def barrier(parallel: qt.Parallel) -> None:
    """Every rank has reached this point (a no-op for one process)."""
    if parallel.world > 1:
        parallel.all_sum(torch.zeros((), dtype=torch.int64))


def to_rank0(parallel: qt.Parallel, value: Any) -> list | None:
    """``[value of rank 0, value of rank 1, ...]`` on rank 0 (tensors on the CPU), ``None`` on the others:
    what the others computed, sent to the writer only."""
    if parallel.world == 1:
        return [value]
    import torch.distributed as dist

    from ..distributed import to_cpu

    group = getattr(parallel, "group", None)
    dst = 0 if group is None else dist.get_global_rank(group, 0)
    out = [None] * parallel.world if parallel.rank == 0 else None
    dist.gather_object(to_cpu(value), out, dst=dst, group=group)
    return out


def scratch(work: Path, parallel: qt.Parallel, *, fresh: bool) -> Path:
    """This rank's scratch directory in the work directory ``work`` (``cache``; ``cache/rank<r>`` on several
    ranks); emptied unless resuming (``fresh=False``)."""
    d = Path(work) / "cache"
    if parallel.world > 1:
        d = d / f"rank{parallel.rank}"
    if fresh:
        shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True, exist_ok=True)
    return d


def drop_scratch(work: Path, parallel: qt.Parallel) -> None:
    """Remove this rank's scratch (a rank other than 0, once rank 0 published: on a file system of its own,
    the emptied work directory goes too; on a shared one rank 0 already removed it all)."""
    if parallel.world == 1 or parallel.rank == 0:
        return
    d = Path(work) / "cache" / f"rank{parallel.rank}"
    shutil.rmtree(d, ignore_errors=True)
    for empty in (d.parent, d.parent.parent):
        try:
            empty.rmdir()
        except OSError:  # not empty (another rank's), or gone
            break

"""Shards laid out before their tensors exist, filled tensor by tensor: the writer of streamed quantization.

:class:`ShardPlan` groups the stored tensors (names, dtypes and shapes: known from the plan before any
work) into shards by the one rule of :func:`bridge.checkpoint.store.shard_layout`, and each shard's file exactly
as :func:`~bridge.checkpoint.store.write_safetensors` lays it out (:mod:`bridge.checkpoint.stfile`).
:class:`ShardFiles` creates the files at their final size, writes each tensor at its offset as it comes
(hashing it on the way) and the headers with the checksums at the end: the bytes are those of
:func:`bridge.save` of the same tree, and memory holds one tensor at a time, never a shard.
Its ``sums`` (``{name: digest}`` of the tensors written) are the state a resumed run restores.
"""

from __future__ import annotations

import os
import struct
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping, Sequence

import torch

from ..checkpoint import checksum, stfile
from ..checkpoint.store import ST_DTYPES, shard_layout, write_index

__all__ = ["ShardPlan", "ShardFiles"]

_CHUNK = 16 * 2**20


class ShardPlan:
    """Where every stored tensor goes: ``groups`` is the ordered list of ``{name: (torch dtype, shape)}``
    kept in one shard (a quantized tensor's parts)."""

    def __init__(self, groups: Sequence[Mapping[str, tuple]], *, max_shard_size="2GB",
                 file_metadata: Mapping[str, str] | None = None, index_metadata: Mapping | None = None):
        stored = [{n: (ST_DTYPES[dt], [int(d) for d in shape]) for n, (dt, shape) in g.items()} for g in groups]
        layout = shard_layout([sum(stfile.nbytes(*e) for e in g.values()) for g in stored], max_shard_size)
        self.files = list(layout)
        self.entries = {f: {n: e for i in members for n, e in stored[i].items()} for f, members in layout.items()}
        self.metadata = {str(k): str(v) for k, v in (file_metadata or {}).items()}
        self.index_metadata = dict(index_metadata or {})
        self.where = {n: f for f, entries in self.entries.items() for n in entries}
        self.start = {f: 8 + stfile.header_length(e, self.metadata) for f, e in self.entries.items()}
        self.offsets = {f: stfile.data_offsets(e) for f, e in self.entries.items()}

    def size(self, file: str) -> int:
        return self.start[file] + sum(e - b for b, e in self.offsets[file].values())

    def total(self) -> int:
        return sum(stfile.nbytes(*e) for entries in self.entries.values() for e in entries.values())


def _pwrite(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class ShardFiles:
    """The files of ``plan`` in ``directory``: created at their final size (``resume``: reopened, with the
    ``sums`` of the tensors already written), filled by :meth:`put` and :meth:`put_raw`, closed by
    :meth:`finish`. Hashing and writing run on a background thread (a queue of ``depth`` tensors), so that
    reading and quantizing the next tensor overlap them; an error there is raised by the next call."""

    def __init__(self, directory, plan: ShardPlan, *, sums: Mapping[str, str] | None = None, depth: int = 2):
        self.directory, self.plan, self.sums = Path(directory), plan, dict(sums or {})
        self._fds = {}
        for f in plan.files:
            path = self.directory / f
            fd = os.open(path, os.O_RDWR | (0 if sums is not None and path.exists() else os.O_CREAT | os.O_TRUNC),
                         0o666)
            os.ftruncate(fd, plan.size(f))
            self._fds[f] = fd
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qtransform-writer")
        self._pending: deque = deque()
        self._depth = depth

    def _where(self, name: str, dtype: str, shape) -> tuple[str, int]:
        f = self.plan.where.get(name)
        if f is None:
            raise ValueError(f"stream writer: tensor {name!r} is not one the checkpoint's plan holds")
        st, planned = self.plan.entries[f][name]
        if dtype != st or list(shape) != planned:
            raise ValueError(f"stream writer: tensor {name!r} has dtype {dtype} and shape {list(shape)}, the "
                             f"checkpoint's plan holds {st} {planned}")
        return f, self.plan.start[f] + self.plan.offsets[f][name][0]

    def _submit(self, fn, *args) -> None:
        while len(self._pending) >= self._depth:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(fn, *args))

    def put(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write ``tensors`` (names of the plan, with the planned dtypes and shapes) at their places."""
        for name, t in tensors.items():
            f, offset = self._where(name, ST_DTYPES.get(t.dtype), t.shape)
            raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            self._submit(self._write, name, f, offset, raw)

    def _write(self, name: str, f: str, offset: int, raw) -> None:
        st, shape = self.plan.entries[f][name]
        self.sums[name] = checksum.digest(st, shape, raw)
        _pwrite(self._fds[f], raw, offset)

    def put_raw(self, name: str, source: Path, begin: int, end: int, dtype: torch.dtype, shape) -> None:
        """Write tensor ``name`` from bytes ``begin:end`` of file ``source`` as they are (a tensor stored
        unchanged: copied in chunks, never whole in memory)."""
        f, offset = self._where(name, ST_DTYPES.get(dtype), shape)
        self._submit(self._copy, name, f, offset, Path(source), begin, end)

    def _copy(self, name: str, f: str, offset: int, source: Path, begin: int, end: int) -> None:
        h = checksum.hasher(*self.plan.entries[f][name])
        buf = bytearray(min(_CHUNK, max(end - begin, 1)))
        with open(source, "rb", buffering=0) as src:
            while begin < end:
                n = os.preadv(src.fileno(), [memoryview(buf)[:min(len(buf), end - begin)]], begin)
                if n <= 0:
                    raise ValueError(f"{source}: tensor {name!r} ends early (a truncated shard)")
                chunk = memoryview(buf)[:n]
                h.update(chunk)
                _pwrite(self._fds[f], chunk, offset)
                begin, offset = begin + n, offset + n
        self.sums[name] = h.hexdigest()

    def flush(self) -> None:
        """Wait for the writes queued so far (raising what failed)."""
        while self._pending:
            self._pending.popleft().result()

    def missing(self) -> list[str]:
        return [n for n in self.plan.where if n not in self.sums]

    def finish(self) -> list[str]:
        """Write the headers (every tensor must have been put) and the index; returns the file names."""
        self.flush()
        missing = self.missing()
        if missing:
            raise ValueError(f"stream writer: tensor(s) {missing[:5]} were never written")
        for f, entries in self.plan.entries.items():
            text = stfile.header(entries, self.plan.metadata, {n: self.sums[n] for n in entries})
            if 8 + len(text) != self.plan.start[f]:  # digests have one length: cannot happen unless the plan lies
                raise RuntimeError(f"stream writer: the header of {f} changed length")
            _pwrite(self._fds[f], struct.pack("<Q", len(text)) + text, 0)
        self.close()
        if len(self.plan.files) > 1:
            write_index(self.directory, self.plan.where, self.plan.total(), self.plan.index_metadata)
        return list(self.plan.files)

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._pool.shutdown(wait=True)
            for fd in self._fds.values():
                os.close(fd)
            self._fds = {}

"""Per-tensor checksums of safetensors shards: written into each shard's metadata, verified on load.

Every tensor's checksum is a SHA-256 of its header description (safetensors dtype name and
shape) followed by its raw bytes as stored, so a changed byte, two same-shaped tensors swapped
by name or by offset, and an edited header dtype or shape are all detected. A shard's
``__metadata__`` holds ``"checksum": "sha256"`` and ``"checksums"``: a JSON object of stored
tensor name -> hex digest (sorted keys). ``save_pretrained`` writes the same metadata into
every shard, so an object may name tensors another shard holds; each stored tensor must have its
own entry. Shards without checksums (checkpoints of qtransform 0.1 and 0.2) load unverified.

Verification reads the shards' bytes once, straight from the files in chunks (several tensors
hashed at a time: file reads and ``hashlib`` release the GIL), before the tensors are loaded.

>>> import hashlib, torch
>>> raw = torch.ones(2).numpy().tobytes()
>>> digest("F32", [2], raw) == hashlib.sha256(b"F32:2:" + raw).hexdigest()
True
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Mapping

from .metadata import CheckpointError

__all__ = ["ALGORITHM", "hasher", "digest", "digests", "checksum_metadata", "read_header", "verify_files"]

ALGORITHM = "sha256"
_ALGORITHMS = {"sha256": hashlib.sha256}
_THREADS = max(1, min(8, os.cpu_count() or 1))
_CHUNK = 16 * 2**20


def hasher(st_dtype: str, shape, *, algorithm: str = ALGORITHM):
    """A ``hashlib`` object fed with a tensor's header description: feed it the raw bytes (in chunks if
    need be), its ``hexdigest()`` is the tensor's :func:`digest`."""
    h = _ALGORITHMS[algorithm]()
    h.update(f"{st_dtype}:{','.join(str(int(n)) for n in shape)}:".encode())
    return h


def digest(st_dtype: str, shape, data, *, algorithm: str = ALGORITHM) -> str:
    """Hex digest of one stored tensor: its safetensors dtype name, shape and raw bytes."""
    h = hasher(st_dtype, shape, algorithm=algorithm)
    h.update(data)
    return h.hexdigest()


def _map(fn, items: list) -> list:
    if len(items) < 2 or _THREADS == 1:
        return [fn(it) for it in items]
    with ThreadPoolExecutor(max_workers=_THREADS) as pool:
        return list(pool.map(fn, items))


def digests(items: Iterable[tuple[str, str, list, object]], *, algorithm: str = ALGORITHM) -> dict[str, str]:
    """``{name: digest}`` of ``(name, st_dtype, shape, bytes-like)`` items, hashed on a few threads."""
    items = list(items)
    out = _map(lambda it: digest(it[1], it[2], it[3], algorithm=algorithm), items)
    return {it[0]: d for it, d in zip(items, out)}


def _file_digest(path: Path, start: int, entry: Mapping, algorithm: str) -> str:
    """Digest of one tensor of a safetensors file, read in chunks (never the whole tensor at once)."""
    h = hasher(entry["dtype"], entry["shape"], algorithm=algorithm)
    begin, end = (start + int(o) for o in entry["data_offsets"])
    with open(path, "rb") as f:
        f.seek(begin)
        while begin < end:
            chunk = f.read(min(_CHUNK, end - begin))
            if not chunk:
                break  # a truncated file: the digest differs
            h.update(chunk)
            begin += len(chunk)
    return h.hexdigest()


def checksum_metadata(checksums: Mapping[str, str]) -> dict[str, str]:
    """The ``__metadata__`` entries that record ``checksums`` (deterministic: sorted keys)."""
    return {"checksum": ALGORITHM,
            "checksums": json.dumps(dict(checksums), sort_keys=True, separators=(",", ":"))}


def read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's JSON header and the offset where its data starts (no data is read)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path}: not a readable safetensors file (shorter than 8 bytes)")
        n = struct.unpack("<Q", head)[0]
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError, MemoryError, OverflowError) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file (header: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a readable safetensors file (header is not an object)")
    return header, 8 + n


def _recorded(path: Path, header: dict) -> dict[str, str] | None:
    meta = header.get("__metadata__") or {}
    if "checksums" not in meta and "checksum" not in meta:
        return None
    algorithm = meta.get("checksum")
    if algorithm not in _ALGORITHMS:
        raise CheckpointError(f"{path}: checksum algorithm {algorithm!r} is not one qtransform knows "
                              f"({sorted(_ALGORITHMS)})")
    try:
        recorded = json.loads(meta.get("checksums", ""))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: the 'checksums' metadata is malformed JSON ({e})") from None
    if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
        raise CheckpointError(f"{path}: the 'checksums' metadata must be an object of tensor name -> hex digest")
    return recorded


def verify_files(paths: Iterable) -> int:
    """Check every tensor of the given shards against the checksums in their metadata.

    Returns the number of tensors verified (0 for a checkpoint written without checksums).
    Raises :class:`CheckpointError` naming the file and the tensor whose bytes, dtype or shape
    differ from those written, a tensor without a checksum in a checksummed shard, and a shard
    without checksums beside shards with them.
    """
    paths = [Path(p) for p in paths]
    headers = {p: read_header(p) for p in paths}
    recorded = {p: _recorded(p, h) for p, (h, _) in headers.items()}
    with_sums = [p for p in paths if recorded[p] is not None]
    if not with_sums:
        return 0
    if len(with_sums) != len(paths):
        bare = next(p for p in paths if recorded[p] is None)
        raise CheckpointError(f"{bare}: shard has no checksums, the other shards of the checkpoint have "
                              "(a shard was replaced)")
    count = 0
    for p in paths:
        header, start = headers[p]
        sums, algorithm = recorded[p], header["__metadata__"]["checksum"]
        names = sorted(k for k in header if k != "__metadata__")
        unlisted = [n for n in names if n not in sums]
        if unlisted:
            raise CheckpointError(f"{p}: tensor(s) {unlisted[:5]} have no checksum in the shard's metadata "
                                  "(renamed or added after saving)")
        got = dict(zip(names, _map(lambda n: _file_digest(p, start, header[n], algorithm), names)))
        bad = [n for n in names if got[n] != sums[n]]
        if bad:
            raise CheckpointError(f"{p}: tensor {bad[0]!r}" + (f" (and {bad[1:5]})" if len(bad) > 1 else "")
                                  + " does not match the checksum written with it: the file was corrupted or "
                                  "edited (tensors swapped, bytes or header changed); loading with verify=False "
                                  "skips this check")
        count += len(names)
    return count

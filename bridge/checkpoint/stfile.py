"""The bytes of one safetensors file as qtransform writes it, from names, dtypes and shapes alone: the data
ordered by element size (largest first, so every tensor is aligned) then name, a compact JSON header with
sorted keys padded with spaces to 8 bytes, the checksum of every tensor in its metadata.

:func:`bridge.checkpoint.store.write_safetensors` writes a file from its tensors; the streaming writer
(:mod:`bridge.stream.shards`) lays the same file out before any tensor exists (a digest has a fixed
length, so the header's length is known in advance) and fills it tensor by tensor: both give the same bytes.

>>> entries = {"b": ("F32", [2]), "a": ("U8", [3])}
>>> data_order(entries), data_offsets(entries)
(['b', 'a'], {'b': (0, 8), 'a': (8, 11)})
>>> len(header(entries, {}, {"a": "0" * 64, "b": "1" * 64})) % 8
0
"""

from __future__ import annotations

import json
from typing import Mapping

from . import checksum

__all__ = ["ITEMSIZE", "nbytes", "data_order", "data_offsets", "header", "header_length"]

#: bytes per element of each safetensors dtype name
ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
            "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
            "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1, "F8_E8M0": 1, "F4": 1}


def nbytes(st_dtype: str, shape) -> int:
    n = ITEMSIZE[st_dtype]
    for d in shape:
        n *= int(d)
    return n


def data_order(entries: Mapping[str, tuple]) -> list[str]:
    """Names of ``{name: (st_dtype, shape)}`` in the order their data is stored."""
    return sorted(entries, key=lambda n: (-ITEMSIZE[entries[n][0]], n))


def data_offsets(entries: Mapping[str, tuple]) -> dict[str, tuple[int, int]]:
    """``{name: (begin, end)}`` of each tensor's data, relative to the end of the header."""
    out, offset = {}, 0
    for n in data_order(entries):
        size = nbytes(*entries[n])
        out[n] = (offset, offset + size)
        offset += size
    return out


def header(entries: Mapping[str, tuple], metadata: Mapping[str, str], sums: Mapping[str, str]) -> bytes:
    """The header's bytes (without the 8-byte length before it): ``entries`` ``{name: (st_dtype, shape)}``,
    the file's ``metadata`` and the tensors' checksums ``sums`` (``{name: hex digest}``)."""
    head = {n: {"dtype": entries[n][0], "shape": [int(d) for d in entries[n][1]], "data_offsets": [b, e]}
            for n, (b, e) in data_offsets(entries).items()}
    meta = {str(k): str(v) for k, v in metadata.items()}
    head["__metadata__"] = {**meta, **checksum.checksum_metadata(sums)}
    text = json.dumps(head, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    return text + b" " * (-len(text) % 8)


def header_length(entries: Mapping[str, tuple], metadata: Mapping[str, str]) -> int:
    """The header's length before the checksums are known (every digest has the same length)."""
    width = len(checksum.digest("U8", [0], b""))
    return len(header(entries, metadata, {n: "0" * width for n in entries}))

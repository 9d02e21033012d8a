"""What a GGUF file must satisfy before anything is built from it.

* **Reading** (:func:`open_reader`): the ``gguf`` package's reader, whose errors on a damaged file
  (``ValueError``, ``IndexError``, ``KeyError``, ...) become :class:`~bridge.CheckpointError` naming
  the file; before it maps any tensor, every tensor's extent is checked (:func:`check_extents`): a
  known type, rows of whole blocks, its offset a multiple of the file's alignment, its bytes (from
  type and shape) inside the data section, and no two tensors sharing a byte.
* **Metadata** (:func:`hyperparameters`): the keys the importer needs, present and of their type
  (a missing or mistyped key is named); :func:`check_hyperparameters` compares them with the model they are
  loaded into (architecture, layer count, hidden size, head counts, vocabulary).
* **Digests** (:data:`DIGESTS`): our exporter writes, per tensor, its GGUF type and the
  SHA-256 of its data bytes as one JSON string under a ``qtransform.`` key (llama.cpp ignores
  unknown keys); :func:`check_digests` verifies them when present, so a changed byte or swapped
  tensors are refused by name. Files of other tools (no such key) are read unverified.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import numpy as np

from ...checkpoint.metadata import CheckpointError
from . import arch as gguf_arch

__all__ = ["DIGESTS", "open_reader", "check_extents", "hyperparameters", "check_hyperparameters", "digest_entry",
           "check_digests"]

#: Metadata key of the per-tensor digests: a JSON object ``{GGUF tensor name: {"type", "sha256"}}``.
DIGESTS = "qtransform.tensor_sha256"

#: ``(GGUF key under the architecture, transformers config key)`` compared with the model loaded into.
_HYPER = (("block_count", "num_hidden_layers"), ("embedding_length", "hidden_size"),
          ("attention.head_count", "num_attention_heads"), ("attention.head_count_kv", "num_key_value_heads"),
          ("feed_forward_length", "intermediate_size"), ("vocab_size", "vocab_size"))
_REQUIRED = ("block_count", "embedding_length", "attention.head_count", "feed_forward_length")


@functools.cache
def _reader_class():
    from gguf import GGUFReader

    class _CheckedReader(GGUFReader):
        """The ``gguf`` package's reader, with every tensor's extent checked before it is mapped."""

        def _build_tensors(self, start_offs, fields):
            check_extents(fields, start=int(start_offs), size=len(self.data), alignment=int(self.alignment),
                          path=self.checked_path)
            super()._build_tensors(start_offs, fields)

    return _CheckedReader


def open_reader(path: Path):
    """A ``gguf.GGUFReader`` of ``path`` whose tensor extents are checked; :class:`CheckpointError`
    naming the file and what is wrong for anything the reader cannot parse."""
    cls = _reader_class()
    reader = cls.__new__(cls)
    reader.checked_path = Path(path)
    try:
        cls.__init__(reader, str(path))
    except CheckpointError:
        raise
    except Exception as e:  # a damaged file: whatever the parser trips on is that file's fault
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    return reader


def check_extents(fields, *, start: int, size: int, alignment: int, path) -> None:
    """Every tensor (the reader's tensor-info ``fields``) inside the data section that begins at byte
    ``start`` of a file of ``size`` bytes, aligned, of whole blocks, and no two overlapping."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    spans = []
    for field in fields:
        _, name_data, _, dims, raw_type, offset = field.parts
        name = bytes(name_data).decode("utf-8", "replace")
        try:
            kind = GGMLQuantizationType(int(raw_type[0]))
            block, type_size = GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise CheckpointError(f"{path}: tensor {name}: unknown GGML type {int(raw_type[0])}") from None
        shape = [int(d) for d in dims]
        if not shape or shape[0] % block:
            raise CheckpointError(f"{path}: tensor {name}: shape {shape} is not rows of whole {kind.name} blocks "
                                  f"of {block} elements")
        nbytes = int(np.prod(shape, dtype=object)) // block * type_size
        rel = int(offset[0])
        if rel % alignment:
            raise CheckpointError(f"{path}: tensor {name}: offset {rel} is not a multiple of the file's "
                                  f"alignment {alignment}")
        if start + rel + nbytes > size:
            raise CheckpointError(f"{path}: tensor {name} ({kind.name}, shape {shape}) needs bytes {rel} to "
                                  f"{rel + nbytes} of the data section, which holds {max(size - start, 0)}")
        spans.append((rel, rel + nbytes, name))
    spans.sort()
    for (a0, a1, a), (b0, _, b) in zip(spans, spans[1:]):
        if b0 < a1:
            raise CheckpointError(f"{path}: tensors {a} (bytes {a0} to {a1} of the data section) and {b} (from "
                                  f"byte {b0}) overlap")


def _value(reader, key: str, kind: str, path, *, required: bool = True):
    """The scalar ``key`` of ``kind`` (``"int"``, ``"float"``, ``"str"``); ``None`` when absent and not required."""
    from gguf import GGUFValueType as T

    field = reader.fields.get(key)
    if field is None:
        if required:
            raise CheckpointError(f"{path}: metadata key {key!r} is missing")
        return None
    ints = (T.UINT8, T.INT8, T.UINT16, T.INT16, T.UINT32, T.INT32, T.UINT64, T.INT64)
    allowed = {"int": ints, "float": ints + (T.FLOAT32, T.FLOAT64), "str": (T.STRING,)}[kind]
    types = list(field.types)
    if len(types) != 1 or types[0] not in allowed:
        got = "/".join(getattr(t, "name", str(t)) for t in types) or "empty"
        raise CheckpointError(f"{path}: metadata key {key!r} is {got}, expected one {kind}")
    try:
        value = field.contents()
    except Exception as e:
        raise CheckpointError(f"{path}: metadata key {key!r}: unreadable ({type(e).__name__}: {e})") from None
    value = {"int": int, "float": float, "str": str}[kind](value)
    if kind == "int" and value <= 0:
        raise CheckpointError(f"{path}: metadata key {key!r} is {value}, expected a positive count")
    return value


def hyperparameters(reader, path) -> dict:
    """``{GGUF key: value}`` of ``general.architecture`` and the architecture's hyperparameters
    (:data:`_HYPER`); :class:`CheckpointError` naming a missing or mistyped key."""
    arch = _value(reader, "general.architecture", "str", path)
    known = set(gguf_arch.arches().values())
    if arch not in known:
        raise CheckpointError(f"{path}: general.architecture {arch!r}: GGUF import supports {sorted(known)}")
    out = {"general.architecture": arch}
    for key, _ in _HYPER:
        out[f"{arch}.{key}"] = _value(reader, f"{arch}.{key}", "int", path, required=key in _REQUIRED)
    for key in ("context_length", "rope.dimension_count"):
        _value(reader, f"{arch}.{key}", "int", path, required=False)
    for key in ("attention.layer_norm_rms_epsilon", "rope.freq_base"):
        _value(reader, f"{arch}.{key}", "float", path, required=False)
    if out[f"{arch}.vocab_size"] is None and "tokenizer.ggml.tokens" in reader.fields:
        out[f"{arch}.vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    return out


def _config_of(like) -> dict | None:
    config = getattr(like, "config", None)
    if config is None:
        return None
    return config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))


def check_hyperparameters(hyper: dict, like, path) -> None:
    """The file's :func:`hyperparameters` agree with the config of ``like`` (a transformers model; a
    module without ``config`` is not compared): :class:`CheckpointError` naming the key and both values."""
    config = _config_of(like)
    if config is None:
        return
    arch = hyper["general.architecture"]
    want = gguf_arch.arch_of(config)
    model = type(like).__name__
    if want != arch:
        raise CheckpointError(f"{path}: general.architecture is {arch!r}, the model's ({model}, model_type "
                              f"{config.get('model_type')!r}) is {want!r}")
    for key, hf in _HYPER:
        got = hyper.get(f"{arch}.{key}")
        mine = config.get(hf)
        if hf == "num_key_value_heads" and mine is None:
            mine = config.get("num_attention_heads")
        if got is None and hf == "num_key_value_heads":
            got = hyper.get(f"{arch}.attention.head_count")
        if got is not None and mine is not None and int(got) != int(mine):
            raise CheckpointError(f"{path}: {arch}.{key} is {got}, the model's {hf} ({model}) is {mine}")


def digest_entry(qtype: str, data: np.ndarray) -> dict:
    """One tensor's entry of :data:`DIGESTS`: its GGUF type and the SHA-256 of the bytes the writer
    stores for ``data``."""
    data = np.ascontiguousarray(data)
    return {"type": qtype, "sha256": hashlib.sha256(data.tobytes()).hexdigest()}


def check_digests(reader, path) -> bool:
    """Verify every tensor against :data:`DIGESTS` when the file carries it (``False``: it does not).
    :class:`CheckpointError` naming the tensor whose type or bytes differ, one missing or added."""
    if DIGESTS not in reader.fields:
        return False
    try:
        table = json.loads(_value(reader, DIGESTS, "str", path))
        if not isinstance(table, dict) or not all(isinstance(v, dict) and isinstance(v.get("sha256"), str)
                                                  and isinstance(v.get("type"), str) for v in table.values()):
            raise ValueError("expected an object of {name: {type, sha256}}")
    except ValueError as e:
        raise CheckpointError(f"{path}: metadata key {DIGESTS!r} is malformed ({e}); verify=False skips "
                              "the check") from None
    tensors = {t.name: t for t in reader.tensors}
    for name in sorted(set(table) - set(tensors)):
        raise CheckpointError(f"{path}: tensor {name} is listed in {DIGESTS} but not in the file")
    for name, t in tensors.items():
        entry = table.get(name)
        if entry is None:
            raise CheckpointError(f"{path}: tensor {name} has no digest in {DIGESTS} (added after export?)")
        kind = t.tensor_type.name
        if entry["type"] != kind:
            raise CheckpointError(f"{path}: tensor {name} is {kind}, its digest says {entry['type']}")
        raw = reader.data[t.data_offset:t.data_offset + t.n_bytes]
        if hashlib.sha256(raw.tobytes()).hexdigest() != entry["sha256"]:
            raise CheckpointError(f"{path}: tensor {name}: its bytes do not match their SHA-256 digest (a changed "
                                  "byte or swapped tensors; verify=False skips the check)")
    return True

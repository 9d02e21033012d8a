"""The versioned ``quantization_config`` of qtransform checkpoints (JSON, no tensors).

::

    {"quant_method": "qtransform", "version": 1, "qtransform_version": "0.1.0",
     "specs": [<QuantSpec.to_dict()>, ...],
     "tensors": {"model.layers.0.mlp.up_proj.weight": {"spec": 0, "shape": [1536, 576], "dtype": "float32"}},
     "recipe": <Recipe.to_dict()> | null, "algorithm": "rtn", "skip_modules": [...] | null}

``tensors`` lists every quantized tensor: its spec (an index into ``specs``), logical
shape and dequantized dtype; with :func:`bridge.qstate.abstract_qtensor` this fixes the
exact names, shapes and dtypes of its stored parts.

>>> import torch, qtransform as qt
>>> spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))
>>> d = encode({"fc.weight": Entry(spec, (8, 64), torch.float32)})
>>> d["version"], d["tensors"]
(1, {'fc.weight': {'spec': 0, 'shape': [8, 64], 'dtype': 'float32'}})
>>> decode(d)["fc.weight"] == Entry(spec, (8, 64), torch.float32)
True
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import torch

import qtransform as qt

from .qstate import dtype_from_name, dtype_name

__all__ = ["VERSION", "QUANT_METHOD", "Entry", "CheckpointError", "encode", "decode", "entries_of"]

VERSION = 1
QUANT_METHOD = "qtransform"


class CheckpointError(ValueError):
    """A checkpoint file or its metadata is malformed, incomplete or does not fit the model."""


class Entry(NamedTuple):
    """Static description of one quantized tensor."""

    spec: qt.QuantSpec
    shape: tuple[int, ...]
    dtype: torch.dtype


def entries_of(quantized: Mapping) -> dict[str, Entry]:
    """``{path: Entry}`` from ``{path: QTensor}``."""
    return {p: Entry(q.spec, tuple(q.shape), q.dtype) for p, q in quantized.items()}


def encode(entries: Mapping[str, Entry], **extra) -> dict:
    """JSON-able ``quantization_config`` for ``entries`` (plus ``extra`` fields such as ``recipe``)."""
    specs: list[qt.QuantSpec] = []
    index: dict[qt.QuantSpec, int] = {}
    tensors = {}
    for path, e in entries.items():
        if e.spec not in index:
            index[e.spec] = len(specs)
            specs.append(e.spec)
        tensors[path] = {"spec": index[e.spec], "shape": [int(n) for n in e.shape], "dtype": dtype_name(e.dtype)}
    return {"quant_method": QUANT_METHOD, "version": VERSION, "qtransform_version": qt.__version__,
            "specs": [s.to_dict() for s in specs], "tensors": tensors, **extra}


def _fail(where: str, msg: str):
    raise CheckpointError(f"{where}: quantization_config {msg}")


def decode(d, *, where: str = "quantization_config") -> dict[str, Entry]:
    """Validate a ``quantization_config`` dict and return its ``{path: Entry}``.

    Raises :class:`CheckpointError` naming ``where`` for anything malformed: a wrong
    ``quant_method``, a missing or unknown ``version``, specs naming unknown formats, bad shapes.
    """
    if not isinstance(d, Mapping):
        _fail(where, f"must be a JSON object, got {type(d).__name__}")
    if d.get("quant_method") != QUANT_METHOD:
        _fail(where, f"has quant_method {d.get('quant_method')!r}, expected {QUANT_METHOD!r}")
    version = d.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        _fail(where, f"has no integer 'version' (got {version!r})")
    if version != VERSION:
        _fail(where, f"has version {version}; this qtransform reads version {VERSION} (upgrade qtransform)")
    specs_raw, tensors = d.get("specs", []), d.get("tensors", {})
    if not isinstance(specs_raw, list) or not isinstance(tensors, Mapping):
        _fail(where, "needs 'specs' as a list and 'tensors' as an object")
    specs = []
    for i, s in enumerate(specs_raw):
        try:
            specs.append(qt.QuantSpec.from_dict(s))
        except (TypeError, ValueError) as e:
            _fail(where, f"specs[{i}] is not a valid QuantSpec: {e}")
    out = {}
    for path, t in tensors.items():
        try:
            spec = specs[t["spec"]]
            shape = tuple(int(n) for n in t["shape"])
            dtype = dtype_from_name(t["dtype"])
        except (KeyError, TypeError, IndexError, ValueError) as e:
            _fail(where, f"entry for tensor {path!r} is malformed ({type(e).__name__}: {e}); expected "
                         "{'spec': <index>, 'shape': [...], 'dtype': '<name>'}")
        if not dtype.is_floating_point or any(n < 1 for n in shape):
            _fail(where, f"entry for tensor {path!r} has shape {list(shape)} / dtype {t['dtype']!r}")
        out[path] = Entry(spec, shape, dtype)
    return out

"""The shape and types of a Quark export's ``config.json``, checked before any tensor is read.

:func:`check_config` walks ``quantization_config`` (``global_quant_config``, ``layer_quant_config``,
``layer_type_quant_config``, ``kv_cache_quant_config``, ``exclude``, ``export``, our own ``qtransform``
specs) and the model's ``dtype``: a key that is missing or has the wrong type raises one
:class:`~bridge.CheckpointError` naming the file and the key (``quantization_config.global_quant_config
.weight.group_size``...), so the importer never meets a ``KeyError``, ``AttributeError`` or a division by
a zero group size. Whether a well-typed value is one qtransform reads (a dtype, a scheme) is said later,
by :func:`~bridge.interop.quark.config.spec_of`, naming the layer.

>>> check_config({"quantization_config": {"quant_method": "quark", "global_quant_config": {"weight": None}}}, "c.json")
>>> check_config({"quantization_config": {"quant_method": "quark", "global_quant_config": {"weight": {
...     "dtype": "int4", "qscheme": "per_group", "group_size": 0}}}}, "c.json")
Traceback (most recent call last):
...
bridge.checkpoint.metadata.CheckpointError: c.json: quantization_config.global_quant_config.weight.group_size must be a positive integer or null, got 0
"""

from __future__ import annotations

from ...checkpoint import metadata
from ..base import quantization_config_of
from ...checkpoint.metadata import CheckpointError

__all__ = ["check_config", "TENSOR_ROLES"]

#: The quantizers of one Quark layer config.
TENSOR_ROLES = ("weight", "bias", "input_tensors", "output_tensors")
_QSCHEMES = ("per_tensor", "per_channel", "per_group", "per_block")
_OPTIONAL = {"qscheme": str, "ch_axis": int, "symmetric": bool, "is_dynamic": bool, "scale_format": str,
             "zero_point_type": str, "scale_calculation_mode": str, "round_method": str, "scale_type": str,
             "mx_element_dtype": str}


def _fail(file, key: str, msg: str):
    raise CheckpointError(f"{file}: {key} {msg}")


def _is(v, typ) -> bool:
    return isinstance(v, typ) and not (typ is int and isinstance(v, bool))


def _tensor(d, file, key: str) -> None:
    if not isinstance(d, dict):
        _fail(file, key, f"must be a JSON object (a Quark tensor config) or null, got {type(d).__name__}")
    if not isinstance(d.get("dtype"), str):
        _fail(file, f"{key}.dtype", f"must be a string (Quark's dtype name), got {d.get('dtype')!r}")
    for k, typ in _OPTIONAL.items():
        if d.get(k) is not None and not _is(d[k], typ):
            _fail(file, f"{key}.{k}", f"must be {typ.__name__} or null, got {d[k]!r}")
    if d.get("qscheme") is not None and d["qscheme"] not in _QSCHEMES:
        _fail(file, f"{key}.qscheme", f"must be one of {list(_QSCHEMES)} or null, got {d['qscheme']!r}")
    g = d.get("group_size")
    if g is not None and not (_is(g, int) and g > 0):
        _fail(file, f"{key}.group_size", f"must be a positive integer or null, got {g!r}")
    if d.get("qscheme") == "per_group" and g is None:
        _fail(file, f"{key}.group_size", "is missing (qscheme per_group)")


def _layer(d, file, key: str) -> None:
    if not isinstance(d, dict):
        _fail(file, key, f"must be a JSON object (a Quark layer config), got {type(d).__name__}")
    for role in TENSOR_ROLES:
        v = d.get(role)
        if isinstance(v, list) and role == "weight":  # two-stage quantizers: refused by name later
            for i, t in enumerate(v):
                _tensor(t, file, f"{key}.{role}[{i}]")
        elif v is not None:
            _tensor(v, file, f"{key}.{role}")


def _patterns(d, file, key: str) -> None:
    if not isinstance(d, dict):
        _fail(file, key, f"must be a JSON object of name pattern -> layer config, got {type(d).__name__}")
    for pattern, cfg in d.items():
        _layer(cfg, file, f"{key}[{pattern!r}]")


def _names(v, file, key: str) -> None:
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        _fail(file, key, f"must be a list of name patterns (strings), got {v!r}"[:300])


def check_config(config, file) -> None:
    """Raise :class:`~bridge.CheckpointError` naming ``file`` and the key for a Quark ``config.json`` (decoded)
    whose ``quantization_config`` or ``dtype`` is missing or mistyped (see the module docstring)."""
    key, q = "quantization_config", quantization_config_of(config, file)
    if "global_quant_config" not in q:
        _fail(file, f"{key}.global_quant_config", "is missing")
    _layer(q["global_quant_config"], file, f"{key}.global_quant_config")
    for k in ("layer_quant_config", "layer_type_quant_config", "kv_cache_quant_config"):
        if q.get(k) is not None:
            _patterns(q[k], file, f"{key}.{k}")
    if q.get("exclude") is not None:
        _names(q["exclude"], file, f"{key}.exclude")
    export = q.get("export")
    if export is not None:
        if not isinstance(export, dict):
            _fail(file, f"{key}.export", f"must be a JSON object, got {type(export).__name__}")
        if export.get("kv_cache_group") is not None:
            _names(export["kv_cache_group"], file, f"{key}.export.kv_cache_group")
        for k in ("pack_method", "weight_format"):
            if export.get(k) is not None and not isinstance(export[k], str):
                _fail(file, f"{key}.export.{k}", f"must be a string, got {export[k]!r}")
    if q.get("qtransform") is not None:
        try:
            metadata.decode(q["qtransform"], where=f"{key}.qtransform")
        except CheckpointError as e:
            raise CheckpointError(f"{file}: {e} (the specs qtransform recorded with the export)") from None

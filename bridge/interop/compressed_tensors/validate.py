"""The shape and types of a compressed-tensors ``config.json``, checked before any tensor is read.

:func:`check_config` walks ``quantization_config`` (``config_groups`` with their ``targets`` and
QuantizationArgs, ``ignore``, ``format``, ``kv_cache_scheme``) and the model's ``dtype``: a key that is
missing or has the wrong type raises one :class:`~bridge.CheckpointError` naming the file and the key
(``quantization_config.config_groups.group_0.weights.num_bits``...), so the importer never meets a
``KeyError``, ``AttributeError`` or a division by a zero group size. Whether well-typed args are a
scheme qtransform reads is said later, by :func:`~bridge.interop.compressed_tensors.config.spec_of`.

>>> check_config({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
...     "g": {"targets": ["Linear"], "weights": {"num_bits": 4, "strategy": "group", "group_size": 0}}}}}, "c.json")
Traceback (most recent call last):
...
bridge.checkpoint.metadata.CheckpointError: c.json: quantization_config.config_groups.g.weights.group_size must be a positive integer for strategy 'group', got 0
"""

from __future__ import annotations

from ..base import quantization_config_of
from ...checkpoint.metadata import CheckpointError

__all__ = ["check_config", "STRATEGIES"]

#: compressed-tensors' ``strategy`` values.
STRATEGIES = ("tensor", "channel", "group", "block", "token", "tensor_group", "attn_head")
_ROLES = ("weights", "input_activations", "output_activations")


def _fail(file, key: str, msg: str):
    raise CheckpointError(f"{file}: {key} {msg}")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _names(v, file, key: str) -> None:
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        _fail(file, key, f"must be a list of strings (names, re: regexes, class names), got {v!r}"[:300])


def check_args(d, file, key: str) -> None:
    """One QuantizationArgs object (JSON): the types of its keys; a group or block size that fits its strategy."""
    if not isinstance(d, dict):
        _fail(file, key, f"must be a JSON object (QuantizationArgs) or null, got {type(d).__name__}")
    bits = d.get("num_bits", 8)
    if not _int(bits) or not 1 <= bits <= 8:
        _fail(file, f"{key}.num_bits", f"must be an integer from 1 to 8, got {bits!r}")
    if d.get("type", "int") not in ("int", "float"):
        _fail(file, f"{key}.type", f"must be 'int' or 'float', got {d.get('type')!r}")
    for k in ("symmetric", "actorder_static"):
        if d.get(k) is not None and not isinstance(d[k], bool):
            _fail(file, f"{key}.{k}", f"must be true or false, got {d[k]!r}")
    if d.get("dynamic", False) not in (True, False, "local"):
        _fail(file, f"{key}.dynamic", f"must be true, false or 'local', got {d.get('dynamic')!r}")
    strategy, g = d.get("strategy"), d.get("group_size")
    if strategy is not None and strategy not in STRATEGIES:
        _fail(file, f"{key}.strategy", f"must be one of {list(STRATEGIES)} or null, got {strategy!r}")
    if g is not None and not _int(g):
        _fail(file, f"{key}.group_size", f"must be an integer or null, got {g!r}")
    if (strategy in ("group", "tensor_group") or (strategy is None and g is not None and g not in (-1,))) and \
            not (_int(g) and g > 0):
        _fail(file, f"{key}.group_size", f"must be a positive integer for strategy {strategy or 'group'!r}, got {g!r}")
    if strategy == "block":
        b = d.get("block_structure")
        if not (isinstance(b, list) and len(b) == 2 and all(_int(n) and n > 0 for n in b)):
            _fail(file, f"{key}.block_structure", f"must be two positive integers for strategy 'block', got {b!r}")
    for k in ("scale_dtype", "zp_dtype", "observer"):
        if d.get(k) is not None and not isinstance(d[k], str):
            _fail(file, f"{key}.{k}", f"must be a string or null, got {d[k]!r}")


def check_config(config, file) -> None:
    """Raise :class:`~bridge.CheckpointError` naming ``file`` and the key for a compressed-tensors ``config.json``
    (decoded) whose ``quantization_config`` or ``dtype`` is missing or mistyped (see the module docstring)."""
    key, q = "quantization_config", quantization_config_of(config, file)
    for k in ("format", "quantization_status"):
        if q.get(k) is not None and not isinstance(q[k], str):
            _fail(file, f"{key}.{k}", f"must be a string or null, got {q[k]!r}")
    groups = q.get("config_groups")
    if groups is None:
        _fail(file, f"{key}.config_groups", "is missing")
    if not isinstance(groups, dict):
        _fail(file, f"{key}.config_groups", f"must be a JSON object of group name -> scheme, got {type(groups).__name__}")
    for name, scheme in groups.items():
        where = f"{key}.config_groups.{name}"
        if not isinstance(scheme, dict):
            _fail(file, where, f"must be a JSON object (a scheme), got {type(scheme).__name__}")
        if "targets" not in scheme:
            _fail(file, f"{where}.targets", "is missing")
        _names(scheme["targets"], file, f"{where}.targets")
        for role in _ROLES:
            if scheme.get(role) is not None:
                check_args(scheme[role], file, f"{where}.{role}")
        if scheme.get("format") is not None and not isinstance(scheme["format"], str):
            _fail(file, f"{where}.format", f"must be a string or null, got {scheme['format']!r}")
    if q.get("ignore") is not None:
        _names(q["ignore"], file, f"{key}.ignore")
    if q.get("kv_cache_scheme") is not None:
        check_args(q["kv_cache_scheme"], file, f"{key}.kv_cache_scheme")

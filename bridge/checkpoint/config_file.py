"""``config.json`` read and written the way transformers does: the one place that turns the file's
encoding of the floats plain JSON cannot hold (infinity, NaN) into Python floats and back.

Mamba-2's family (Mamba-2, Bamba, Nemotron-H, Falcon-H1, GraniteMoE-Hybrid) configs carry
``time_step_limit: [0.0, inf]``. transformers 5 writes such a float as a tagged object,
``{"__float__": "Infinity"}`` (strict JSON), and decodes it only in ``from_pretrained``'s file reader,
not in ``from_dict``; transformers 4 wrote Python's bare ``Infinity``. :func:`read_config` accepts both
and gives Python floats (what ``Config.from_dict`` validates); :func:`config_text` writes the tagged form
when the installed transformers reads it back, Python's bare tokens otherwise.

>>> decode_floats({"time_step_limit": [0.0, {"__float__": "Infinity"}], "x": {"__float__": "NaN"}})
{'time_step_limit': [0.0, inf], 'x': nan}
>>> encode_floats({"time_step_limit": (0.0, float("inf")), "y": [float("-inf")]})
{'time_step_limit': [0.0, {'__float__': 'Infinity'}], 'y': [{'__float__': '-Infinity'}]}
>>> decode_floats(encode_floats([float("inf"), 1.5, "Infinity"]))
[inf, 1.5, 'Infinity']
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any, Mapping

from . import store

__all__ = ["FLOAT_TAG", "decode_floats", "encode_floats", "read_config", "config_text", "write_config"]

#: transformers' key of a tagged float (``configuration_utils._FLOAT_TAG_KEY``) and the values it names.
FLOAT_TAG = "__float__"
_TAGGED = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def decode_floats(obj: Any) -> Any:
    """``obj`` (decoded JSON) with every ``{"__float__": "Infinity" | "-Infinity" | "NaN"}`` replaced by
    the float; anything else as it was (an unknown tag stays an object, as transformers leaves it)."""
    if isinstance(obj, dict):
        if set(obj) == {FLOAT_TAG} and obj[FLOAT_TAG] in _TAGGED:
            return _TAGGED[obj[FLOAT_TAG]]
        return {k: decode_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_floats(v) for v in obj]
    return obj


def encode_floats(obj: Any) -> Any:
    """``obj`` with every infinite or NaN float tagged as transformers 5 writes it (tuples become lists)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return {FLOAT_TAG: "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")}
    if isinstance(obj, Mapping):
        return {k: encode_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode_floats(v) for v in obj]
    return obj


@functools.cache
def _reads_tags() -> bool:
    """Whether the installed transformers decodes tagged floats in ``config.json`` (transformers 5 does)."""
    try:
        from transformers import PretrainedConfig
    except ImportError:
        return True
    return hasattr(PretrainedConfig, "_decode_special_floats")


def read_config(path, what: str = "checkpoint config") -> Any:
    """The decoded ``config.json`` at ``path`` with its non-finite floats as Python floats (tagged or bare);
    :class:`~bridge.CheckpointError` naming the file when it is missing or not JSON."""
    return decode_floats(store.read_json(Path(path), what))


def config_text(config: Mapping) -> str:
    """``config`` as transformers writes ``config.json``: sorted keys, two-space indent, non-finite floats
    in the encoding the installed transformers reads back."""
    data = encode_floats(config) if _reads_tags() else dict(config)
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def write_config(path, config: Mapping) -> None:
    """Write :func:`config_text` of ``config`` to the file ``path``."""
    Path(path).write_text(config_text(config))

"""What compressed-tensors needs to know of the model: its modules' classes (built on the ``meta``
device from ``config.json``, no weights), which attention modules hold the key/value cache scales,
and how its ``targets``/``ignore`` entries (module names, ``re:`` regexes, class
names) select modules.

>>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
>>> matches("0", m[0], ["Linear"]), matches("1", m[1], ["re:^0$"]), matches("0", m[0], ["re:^0$"])
(True, False, True)
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

import torch
from torch import nn

from ..hf_model import transformers_model

__all__ = ["skeleton", "QUANTIZABLE", "is_cached_attention", "matches"]

#: Module types compressed-tensors quantizes (``nn.Linear`` and ``nn.Embedding``).
QUANTIZABLE = (nn.Linear, nn.Embedding)
_KV_NAMES = ("k_proj", "v_proj", "qkv_proj", "kv_b_proj")


def skeleton(config: Mapping, paths: Iterable[str] = ()) -> tuple[nn.Module | None, str]:
    """The transformers model ``config`` (a ``config.json`` dict) describes that has every tensor in ``paths``
    (the checkpoint's: a composite config, a vision-language model's, also builds its text-only causal LM), on the
    ``meta`` device (:func:`~bridge.interop.hf_model.transformers_model`), or ``None`` and why not."""
    if not config.get("model_type"):
        return None, "config.json has no model_type (compressed-tensors exports transformers models)"
    try:
        return transformers_model(config, paths=paths), ""
    except Exception as e:  # noqa: BLE001  (a config this transformers cannot build: say so, do not crash the export)
        return None, f"cannot build the model of config.json ({type(e).__name__}: {e})"


def is_cached_attention(module: nn.Module) -> bool:
    """Whether ``module`` is an attention layer whose ``k_scale``/``v_scale`` a ``kv_cache_scheme`` gives
    (vLLM's reading): an attention class (by name) with key/value projections. compressed-tensors 0.20
    also asks for a ``past_key_values`` argument, which transformers 5's attention no longer takes (it
    takes ``cache``): under that pairing transformers loads the scales but does not quantize the cache."""
    return "attention" in type(module).__name__.lower() and any(hasattr(module, n) for n in _KV_NAMES)


def _match_name(name: str, target: str) -> bool:
    return re.match(target[3:], name) is not None if target.startswith("re:") else target == name


def matches(name: str, module: nn.Module | None, targets: Iterable[str]) -> bool:
    """Whether a target selects module ``name``: its name, a ``re:`` regex of it, or the name of a
    class in its type's MRO (``module`` ``None``: names and regexes only)."""
    classes = set() if module is None else {c.__name__ for c in type(module).__mro__}
    return any(_match_name(name, t) or t in classes for t in targets)

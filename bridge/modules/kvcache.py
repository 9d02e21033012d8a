"""The key/value cache of transformers' attention layers, quantized where it is written.

transformers' attention modules compute the keys and values (after rotary embeddings), store
them in the cache and hand the cached ones to an *attention function* chosen by name
(``config._attn_implementation``: ``"sdpa"``, ``"eager"``, ``"flash_attention_2"``...) with the
module itself as the first argument. :func:`route_attention` switches a model's attention modules to
``"qtransform|<name>"``: the same function, registered under that name with the same attention
mask, which first fake-quantizes the keys and values of a module that has a ``"key"``/``"value"``
quantizer (static per tensor, :func:`bridge.modules.actquant.attach`; buffers ``k_scale``,
``v_scale``). So the keys and values are quantized exactly as a quantized cache stores them, with a
cache or without one: quantizing with a fixed scale is idempotent, so entries read back from the
cache are unchanged by it. A module with an online rotation of its queries and keys (QuaRot's
``R3``, :mod:`bridge.modules.online`) has both rotated first: the scores are unchanged, the keys
quantized are the rotated ones.

:func:`observing` hands the keys and values to callbacks instead (calibration), and
:func:`attention_modules` finds the modules that call an attention function.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from typing import Callable, Mapping

from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

import qtransform as qt
from qtransform.rotation import apply_online

from . import actquant

__all__ = ["PREFIX_NAME", "attention_modules", "route_attention", "observing", "quantized_attention"]

#: Prefix of the attention implementation names :func:`route_attention` registers.
PREFIX_NAME = "qtransform|"


@functools.lru_cache(maxsize=None)
def _calls_attention(cls: type) -> bool:
    """Whether ``cls.forward`` dispatches through transformers' attention functions."""
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def _is_attention(m: nn.Module) -> bool:
    return hasattr(getattr(m, "config", None), "_attn_implementation") and _calls_attention(type(m))


def attention_modules(model: nn.Module) -> list[str]:
    """Paths of the modules of ``model`` that call transformers' attention functions with their keys
    and values (``LlamaAttention``, ``GPT2Attention``, ``BertSelfAttention``...), in module order."""
    return [name for name, m in model.named_modules() if _is_attention(m)]


def _base(module: nn.Module, name: str) -> Callable:
    """The attention function ``name`` names for ``module`` (``eager``: its model file's own)."""
    if name == "eager" or name is None:
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise ValueError(f"{type(module).__name__}: its module {type(module).__module__} defines no "
                             "eager_attention_forward to quantize the key/value cache around")
        return fn
    return ALL_ATTENTION_FUNCTIONS[name]


def _wrapped(base_name: str) -> Callable:
    def attention(module, query, key, value, *args, **kwargs):
        rot = getattr(module, "_qt_online", {}).get("key")
        if rot is not None:
            query, key = apply_online(query, rot), apply_online(key, rot)
        observe = getattr(module, "_qt_kv_observe", None)
        if observe is not None:
            observe(key, value)
        key = actquant.apply(module, "key", key)
        value = actquant.apply(module, "value", value)
        return _base(module, base_name)(module, query, key, value, *args, **kwargs)

    attention.__name__ = f"qtransform_kv_{base_name}"
    return attention


def _register(base_name: str) -> str:
    name = PREFIX_NAME + base_name
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _wrapped(base_name))
        mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(base_name)
        if mask is not None:  # the base's mask (implementations without one take none)
            AttentionMaskInterface.register(name, mask)
    return name


def _configs(model: nn.Module, paths) -> list:
    """The distinct configs of the attention modules at ``paths``."""
    out = []
    for p in paths:
        cfg = model.get_submodule(p).config
        if not any(cfg is c for c in out):
            out.append(cfg)
    return out


def quantized_attention(model: nn.Module) -> list[str]:
    """Paths of the attention modules of ``model`` with a key or value quantizer or an online rotation of
    their queries and keys."""
    return [name for name, m in model.named_modules()
            if _is_attention(m) and (any(getattr(m, f"{r}_spec", None) is not None for r in qt.spec.KV_ROLES)
                                     or "key" in getattr(m, "_qt_online", {}))]


def route_attention(model: nn.Module, paths=None) -> None:
    """Route the attention modules at ``paths`` (default: those with a key/value quantizer) through the
    quantizing attention function (idempotent). Their config's ``_attn_implementation`` becomes
    ``"qtransform|<the one it was>"``."""
    paths = quantized_attention(model) if paths is None else list(paths)
    for cfg in _configs(model, paths):
        current = cfg._attn_implementation or "eager"
        if not current.startswith(PREFIX_NAME):
            cfg._attn_implementation = _register(current)


@contextlib.contextmanager
def observing(model: nn.Module, callbacks: Mapping[str, Callable]):
    """Within the block, the attention module at each path of ``callbacks`` calls ``callback(key, value)``
    with the keys and values it attends over (what its cache stores). Restores the attention
    implementations after."""
    known = set(attention_modules(model))
    bad = sorted(set(callbacks) - known)
    if bad:
        raise ValueError(f"key/value sites {bad[:5]} are not attention modules of {type(model).__name__} (modules "
                         f"calling transformers' attention functions: {sorted(known)[:3]}...)")
    configs = _configs(model, callbacks)
    before = [c._attn_implementation for c in configs]
    modules = {p: model.get_submodule(p) for p in callbacks}
    try:
        route_attention(model, callbacks)
        for p, fn in callbacks.items():
            modules[p]._qt_kv_observe = fn
        yield
    finally:
        for m in modules.values():
            m.__dict__.pop("_qt_kv_observe", None)
        for c, b in zip(configs, before):
            c._attn_implementation = b

"""accelerate offloading of qtransform models: ``from_pretrained(..., device_map=..., offload_folder=...)``.

A quantized module keeps its weight in *buffers* (``weight``, ``weight_scale``... see
:mod:`bridge.modules.base`), where accelerate and transformers expect parameters. Four things
make a device map with ``"cpu"``/``"disk"`` entries (explicit, or ``"auto"`` with ``max_memory``)
load and run a qtransform checkpoint as it does a float model:

1. :func:`distinct_buffers`: the skeleton the quantizer builds must give every module its own
   ``meta`` tensors. :func:`bridge.checkpoint.layout.abstract_qtensor` is cached, so modules of one
   shape and spec shared the very same meta tensors, and ``named_buffers()`` (which drops
   repeated tensors) listed the quantized buffers of the first such module only. transformers
   tells buffers from parameters with that list: it treated the others as parameters of the
   ``"disk"`` modules (written to the offload index, never set on the module), and accelerate,
   which keeps buffers on the execution device, then found them on ``meta``: *"weight is on the
   meta device"*. The same list sized the modules for ``device_map="auto"`` (quantized weights
   counted once per shape, so "auto" kept on a device more than ``max_memory`` allows).
2. :func:`patch_accelerate_dispatch`: accelerate offloads parameters only unless ``offload_buffers=True``, so a
   quantized module mapped to ``"cpu"``/``"disk"`` would keep its whole weight in memory. For a
   qtransform checkpoint the dispatch offloads buffers too (transformers does the same for
   fbgemm fp8, whose scales are buffers): the quantized tensors are read from the checkpoint's
   own files (``"disk"``) or the CPU copy (``"cpu"`` with an accelerator) before each forward and
   dropped after it. Only where the offload index holds every persistent buffer of the
   ``"disk"`` modules, i.e. for checkpoints: quantize-on-load makes tensors the files do not
   hold, and those stay on the execution device as accelerate keeps any buffer.
3. The kernel state a quantized module prepares from its tensors (a packed copy of the weight,
   :mod:`bridge.kernels`) is dropped after each forward of an offloaded module, with the tensors
   (a forward hook, which runs after accelerate's ``post_forward``): the module prepares it again
   from the tensors accelerate sets before its next forward, and keeps no copy in between.
4. :func:`offloaded_names`: what the hooks hold for a module between forwards (its tensors are on
   ``meta`` then), so the quantizer's after-loading check tells offloaded from missing.

Forward passes give the logits of a load without a device map (tests/bridge/hf/test_offload.py).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers import modeling_utils

from ..checkpoint import metadata
from ..modules import QModule

__all__ = ["distinct_buffers", "patch_accelerate_dispatch", "offloaded_names", "offloads_buffers"]


def distinct_buffers(model: nn.Module) -> None:
    """Give every ``meta`` buffer that more than one module slot holds a tensor of its own (in place)."""
    seen: set[int] = set()
    for module in model.modules():
        for name, b in list(module._buffers.items()):
            if b is None:
                continue
            if id(b) in seen and b.is_meta:
                module._buffers[name] = torch.empty_like(b)
            else:
                seen.add(id(b))


def _device_of(device_map: dict, name: str):
    """The device ``device_map`` gives the module ``name`` (the longest matching prefix)."""
    best = None
    for key, device in device_map.items():
        if key == "" or name == key or name.startswith(key + "."):
            if best is None or len(key) > len(best[0]):
                best = (key, device)
    return None if best is None else best[1]


def _persistent_buffers(model: nn.Module, device_map: dict, device: str) -> list[str]:
    """State-dict names of the persistent buffers of the modules ``device_map`` puts on ``device``."""
    out = []
    for name, module in model.named_modules():
        if _device_of(device_map, name) != device:
            continue
        prefix = f"{name}." if name else ""
        out += [prefix + n for n, b in module._buffers.items()
                if b is not None and n not in module._non_persistent_buffers_set]
    return out


def offloads_buffers(model: nn.Module, hf_quantizer, device_map, offload_index) -> bool:
    """Whether the dispatch of a qtransform ``model`` should offload its buffers (see the module docstring)."""
    cfg = getattr(hf_quantizer, "quantization_config", None)
    if getattr(cfg, "quant_method", None) != metadata.QUANT_METHOD or not isinstance(device_map, dict):
        return False
    devices = {str(d) for d in device_map.values()}
    if not devices & {"cpu", "disk"}:
        return False
    if "disk" not in devices:
        return True
    index = offload_index or {}
    return bool(hf_quantizer.pre_quantized) and all(n in index for n in _persistent_buffers(model, device_map, "disk"))


def _drop_prepared(module: nn.Module, args, output):
    """Forward hook (it runs after accelerate's ``post_forward`` put the tensors back on ``meta``): the
    kernel state prepared from the tensors of this forward is dropped with them."""
    if any(module._buffers[n].is_meta for n in module._qnames):
        module._cache = None  # QModule's "derive again on next use" (as set_qweight and .to() do)


def _release_after_forward(model: nn.Module) -> None:
    """Quantized modules whose tensors accelerate offloads keep no packed copy between forwards."""
    for module in model.modules():
        if isinstance(module, QModule) and set(module._qnames) & offloaded_names(module) \
                and _drop_prepared not in module._forward_hooks.values():
            module.register_forward_hook(_drop_prepared)


def _wrapped(dispatch):
    signature = inspect.signature(dispatch)

    def accelerate_dispatch(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return dispatch(*args, **kwargs)
        a = bound.arguments
        model = a.get("model")
        if not a.get("offload_buffers") and offloads_buffers(model, a.get("hf_quantizer"), a.get("device_map"),
                                                            a.get("offload_index")):
            a["offload_buffers"] = True
        out = dispatch(*bound.args, **bound.kwargs)
        if isinstance(model, nn.Module):
            _release_after_forward(model)
        return out

    accelerate_dispatch.__wrapped__ = dispatch
    accelerate_dispatch._qtransform_offload = True
    return accelerate_dispatch


def patch_accelerate_dispatch() -> None:
    """Route transformers' dispatch of qtransform models through :func:`offloads_buffers` (idempotent;
    only where this transformers dispatches with ``offload_buffers``)."""
    dispatch = getattr(modeling_utils, "accelerate_dispatch", None)
    if not callable(dispatch) or getattr(dispatch, "_qtransform_offload", False):
        return
    params = inspect.signature(dispatch).parameters
    if {"model", "hf_quantizer", "device_map", "offload_index", "offload_buffers"} <= set(params):
        modeling_utils.accelerate_dispatch = _wrapped(dispatch)


def offloaded_names(module: nn.Module) -> set[str]:
    """Local names of the tensors of ``module`` that an accelerate hook holds in its weights map
    (on ``meta`` on the module between forwards); empty when the module is not offloaded."""
    hooks = [getattr(module, "_hf_hook", None)]
    hooks = list(getattr(hooks[0], "hooks", hooks))  # a SequentialHook holds several
    out = set()
    for hook in hooks:
        weights = getattr(hook, "weights_map", None)
        if not getattr(hook, "offload", False) or weights is None:
            continue
        prefix = getattr(weights, "prefix", "")
        out |= {k[len(prefix):] for k in weights if k.startswith(prefix)}
    return out

"""Multi-head attention in a model: where its projection weights are (:func:`projection_weights`,
:func:`mha_owner`), the fused paths that read them as tensors turned off (:func:`fused_paths_off`), what enters
its in-projection (:func:`projection_inputs`, for calibration hooks), the activation quantizers it takes
(:func:`check_sites`) and a view of a model whose attention calls its ``out_proj`` (:func:`calling_view`). The
module itself: :mod:`bridge.modules.mha`.

>>> import torch
>>> enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2, 16), 1, enable_nested_tensor=False)
>>> sorted(projection_weights(enc))
['layers.0.self_attn.in_proj_weight', 'layers.0.self_attn.out_proj.weight']
>>> mha_owner(enc, "layers.0.self_attn.out_proj.weight")[1:]
('layers.0.self_attn', 'out_proj.weight')
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import qtransform as qt

from .base import QModule
from .mha import QMultiheadAttention, in_proj_names, is_mha

__all__ = ["projection_weights", "mha_owner", "fused_paths_off", "projection_inputs", "check_sites", "calling_view"]


def projection_weights(model: nn.Module) -> dict[str, nn.Module]:
    """``{path: attention module}`` for each projection weight of every multi-head attention module of ``model``
    (its in-projection weights and ``<mha>.out_proj.weight``)."""
    out = {}
    for name, m in model.named_modules():
        if is_mha(m):
            prefix = f"{name}." if name else ""
            out.update({prefix + n: m for n in (*in_proj_names(m), "out_proj.weight")})
    return out


def mha_owner(model: nn.Module, path: str) -> tuple[nn.Module | None, str, str]:
    """``(attention module, its path, the weight's name in it)`` when ``path`` is a projection weight of a
    multi-head attention module of ``model`` (``"out_proj.weight"`` for the out-projection), else
    ``(None, "", "")``."""
    parent, _, leaf = path.rpartition(".")
    candidates = [(parent, leaf)]
    if path == "out_proj.weight" or path.endswith(".out_proj.weight"):
        candidates.append((path[:-len("out_proj.weight")].rstrip("."), "out_proj.weight"))
    for parent, leaf in candidates:
        try:
            m = model.get_submodule(parent)
        except AttributeError:
            continue
        if is_mha(m) and leaf in (*in_proj_names(m), "out_proj.weight"):
            return m, parent, leaf
    return None, "", ""


def fused_paths_off(model: nn.Module) -> None:
    """Turn off the fused paths that read projection weights as tensors where a quantized module sits: the fast
    path of each ``nn.TransformerEncoderLayer`` holding one (``activation_relu_or_gelu = 0``: that attribute only
    chooses the fused kernel's activation, the layer's own ``activation`` still runs) and the nested-tensor path
    of the ``nn.TransformerEncoder`` above it (``use_nested_tensor = False``). In place."""
    def quantized(m):
        return any(isinstance(s, (QModule, QMultiheadAttention)) for s in m.modules())

    for m in model.modules():
        if isinstance(m, nn.TransformerEncoderLayer) and quantized(m):
            m.activation_relu_or_gelu = 0
        if isinstance(m, nn.TransformerEncoder) and quantized(m):
            m.use_nested_tensor = False


def projection_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...] | None:
    """The distinct tensors entering the in-projection of a call ``module(*args, **kwargs)`` of a multi-head
    attention module (query, key, value; one where they are the same tensor), or ``None`` for another module."""
    if not is_mha(module):
        return None
    named = dict(zip(("query", "key", "value"), args))
    named.update({k: kwargs[k] for k in ("query", "key", "value") if k in kwargs})
    out: list[torch.Tensor] = []
    for t in named.values():
        if isinstance(t, torch.Tensor) and not any(t is o for o in out):
            out.append(t)
    return tuple(out)


def check_sites(model: nn.Module, activations) -> None:
    """``ValueError`` naming the module where a plan's activation quantizers (``{Site: spec}``) ask of a
    multi-head attention module what :class:`QMultiheadAttention` cannot do: an output quantizer, or a static
    input one that is not per tensor (query, key and value share it)."""
    for site, spec in activations.items():
        try:
            m = model.get_submodule(site.module)
        except AttributeError:
            continue
        if not is_mha(m):
            continue
        if site.role != "input":
            raise ValueError(f"{site.module}: the recipe quantizes the {site.role} of a MultiheadAttention; only its "
                             "input (query, key and value before the in-projection) can be, and out_proj's "
                             f"activations as a Linear's: drop it (act_rules={{'{site.module}:{site.role}': None}})")
        if not spec.dynamic and not isinstance(spec.granularity, qt.PerTensor):
            raise ValueError(f"{site.module}: the recipe's static input spec of a MultiheadAttention is "
                             f"{spec.granularity}; query, key and value share one static quantizer, which must be "
                             "per tensor (or use a dynamic spec)")


def calling_view(model: nn.Module) -> nn.Module:
    """``model`` itself when it has no multi-head attention; else a copy sharing every tensor in which each
    ``nn.MultiheadAttention`` is a float :class:`QMultiheadAttention` (the same outputs, with ``out_proj`` called as
    a module, so hooks on it see its input: calibration) and the fused paths are off (:func:`fused_paths_off`)."""
    if not any(isinstance(m, nn.MultiheadAttention) for m in model.modules()):
        return model
    tensors = [t for _, t in model.named_parameters(remove_duplicate=False)]
    tensors += [t for _, t in model.named_buffers(remove_duplicate=False)]
    view = copy.deepcopy(model, {id(t): t for t in tensors})
    if isinstance(view, nn.MultiheadAttention):
        return QMultiheadAttention(view)
    for name, m in list(view.named_modules()):
        if isinstance(m, nn.MultiheadAttention):
            parent, _, attr = name.rpartition(".")
            view.get_submodule(parent)._modules[attr] = QMultiheadAttention(m)
    fused_paths_off(view)
    return view

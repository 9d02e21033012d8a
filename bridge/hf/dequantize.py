"""``model.dequantize()``: a qtransform model back to a float model (transformers' ``_dequantize`` hook).

:func:`dequantize_model` replaces every quantized module by the float module it came from, with
``weight = qt.dequantize(module.qweight)`` in the requested dtype and the bias kept:
``QLinear`` -> ``nn.Linear`` (or transformers' ``Conv1D``, weight stored (in, out), when
``transposed``), ``QConv2d`` -> ``nn.Conv2d``, ``QConvTranspose2d`` -> ``nn.ConvTranspose2d`` (and the 1-D
and 3-D ones),
``QEmbedding`` -> ``nn.Embedding``, ``QEmbeddingBag`` -> ``nn.EmbeddingBag``. The rest of what a
quantized model computes is settled so that the result is a plain float model that computes the
function of the quantized weights and loads without the bridge:

* an online rotation of a linear layer's input (QuaRot's ``R4``: a pre-hook ``x -> x H``, the
  weight holding ``W H``) is *folded*: the float weight is ``dequantize(qweight) H^T``, so
  ``x W_float^T = (x H) dequantize(qweight)^T`` with no hook (float linears the recipe left alone
  but that take a rotation are folded the same way);
* a step output that folds (:attr:`bridge.step_outputs.OutputSlot.fold`) is *folded* before any input rotation
  is (it sees the rotated input): a low-rank correction of a linear layer (the ``lowrank`` step) makes the
  float weight ``dequantize(qweight) + B A``; a model carrying a kind that does not fold is refused;
* an online rotation of queries and keys (``R3``) is *dropped*: ``(q H)(k H)^T = q k^T`` since ``H``
  is orthogonal, so without the key quantizer it changes nothing but rounding;
* activation quantizers (input, output) and the key/value cache quantizers are *dropped* (a
  dequantized model is a float model), and attention modules get back the attention
  implementation they were routed from (``"qtransform|sdpa"`` -> ``"sdpa"``).

So the dequantized model's logits are the quantized model's with the ``"dequant"`` kernel and no
activation quantizers, to float rounding. The quantization config is removed by transformers
(``HfQuantizer.dequantize``), so ``save_pretrained`` then writes a plain float checkpoint.

>>> import torch, qtransform as qt, bridge
>>> qm = bridge.quantize(torch.nn.Sequential(torch.nn.Linear(64, 8)), qt.QuantSpec(format="int8"))
>>> w = qt.dequantize(qm[0].qweight)
>>> fm = dequantize_model(qm)
>>> type(fm[0]).__name__, torch.equal(fm[0].weight, w)
('Linear', True)
"""

from __future__ import annotations

import torch
from torch import nn

import qtransform as qt
from qtransform.rotation import OnlineRotation, apply_online

from ..modules import CONV_CLASSES, QEmbedding, QEmbeddingBag, QLinear, QModule, actquant, is_conv1d, kvcache
from ..modules import online
from ..modules.experts import QExperts
from ..step_outputs import SLOTS, read_outputs
from ..tree import submodule
from .offload import offloaded_names

__all__ = ["dequantize_model", "float_module"]

#: The float class each quantized class came from (``QLinear`` by ``transposed``, see :func:`_float_class`).
_FLOAT = {**{q: f for f, q in CONV_CLASSES.items()}, QEmbedding: nn.Embedding, QEmbeddingBag: nn.EmbeddingBag}


def _float_class(module: QModule) -> type[nn.Module] | None:
    if type(module) is QLinear:
        if module.transposed:
            from transformers.pytorch_utils import Conv1D
            return Conv1D
        return nn.Linear
    return _FLOAT.get(type(module))


def _check_dtype(dtype) -> torch.dtype | None:
    if isinstance(dtype, str):  # a config's dtype may be its name
        dtype = getattr(torch, dtype.removeprefix("torch."), dtype)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dequantize: dtype must be None or a floating torch.dtype, got {dtype!r}")
    return dtype


def _rotated(weight: torch.Tensor, rot: OnlineRotation, *, transposed: bool) -> torch.Tensor:
    """The weight that computes, on ``x``, what ``weight`` computes on ``apply_online(x, rot)``: ``W R^T``
    ((out, in) weights) or ``R W`` ((in, out), ``transposed``), ``R`` the block-diagonal rotation."""
    w = weight.double()
    block = apply_online(torch.eye(rot.size, dtype=torch.float64, device=w.device), rot)  # rows e_i B
    if transposed:
        k = w.shape[0] // rot.size
        return torch.einsum("ij,kjo->kio", block, w.reshape(k, rot.size, -1)).reshape(w.shape)
    return (w.reshape(w.shape[0], -1, rot.size) @ block.T).reshape(w.shape)


def float_module(module: QModule, dtype: torch.dtype | None = None, *,
                 rotation: OnlineRotation | None = None) -> nn.Module:
    """The float module ``module`` came from, holding its dequantized weight (see the module docstring).

    Args:
        module: a quantized module (``QLinear``, ``QConv2d``, ``QConvTranspose2d``, ``QEmbedding``,
            ``QEmbeddingBag``) with its tensors loaded.
        dtype: the float weight's (and bias') dtype; ``None``: the module's compute dtype.
        rotation: an online rotation of the module's input to fold into the weight (``QLinear`` only).

    Returns:
        A new module on the device of ``module``'s tensors, in ``module``'s training mode; its bias is
        ``module``'s own bias parameter when the dtype already matches.
    """
    if not isinstance(module, QModule):
        raise TypeError(f"float_module: module must be a QModule, got {type(module).__name__}")
    cls = _float_class(module)
    if cls is None:
        raise TypeError(f"float_module: no float module known for {type(module).__name__}")
    dtype = _check_dtype(dtype) or module.compute_dtype or module.weight_dtype
    if rotation is not None and type(module) is not QLinear:
        raise ValueError(f"float_module: an online input rotation folds into a linear layer, not a "
                         f"{type(module).__name__}")
    weight = qt.dequantize(module.qweight, dtype=torch.float32 if rotation is not None else dtype)
    for slot in SLOTS.values():  # step outputs fold into the weight (a low-rank correction: Q + B A)
        if slot.fold is not None:
            weight = slot.fold(module, weight)
    if rotation is not None:
        weight = _rotated(weight, rotation, transposed=module.transposed)
    bias = getattr(module, "bias", None)
    with torch.device("meta"):
        if cls is nn.Linear:
            new = cls(module.in_features, module.out_features, bias=bias is not None)
        elif module.transposed:  # Conv1D(nf=out, nx=in)
            new = cls(module.out_features, module.in_features)
        else:
            kw = {k: getattr(module, k) for k in module._HYPER}
            new = cls(**kw, **({"bias": bias is not None} if cls in CONV_CLASSES else {}))
    new.weight = nn.Parameter(weight.to(dtype))
    if "bias" in new._parameters:
        new.bias = None if bias is None else (
            bias if bias.dtype == dtype else nn.Parameter(bias.detach().to(dtype), requires_grad=bias.requires_grad))
    return new.train(module.training)


def _check(model: nn.Module, quantized: dict, rotations: dict) -> None:
    """Everything :func:`dequantize_model` will do, checked before it changes anything."""
    for name, values in read_outputs(model).items():
        if SLOTS[name].fold is None:
            raise ValueError(f"dequantize: {next(iter(values))} carries {SLOTS[name].label} ({name!r}), which do not "
                             "fold into a float model")
    for path, m in quantized.items():
        if not path:
            raise ValueError("dequantize: the model itself is a quantized module; wrap it in a container")
        if _float_class(m) is None:
            raise TypeError(f"dequantize: {path} is a {type(m).__name__}, which has no known float module")
        if set(m._qnames) & offloaded_names(m):
            raise ValueError(f"dequantize: {path} is offloaded by accelerate (a device_map with 'cpu'/'disk' "
                             "entries); load the model without offloading to dequantize it")
        meta = [n for n in m._qnames if m._buffers[n].is_meta]
        if meta:
            raise ValueError(f"dequantize: {path}.{meta[0]} is on the meta device (not loaded)")
    for site, rot in rotations.items():
        if site.role != "input":
            continue
        m = model.get_submodule(site.module)
        linear = isinstance(m, QLinear) or type(m) is nn.Linear or is_conv1d(m)
        if not linear or not isinstance(getattr(m, "weight", None), torch.Tensor):
            raise ValueError(f"dequantize: online rotation at {site.module} (input) is on a "
                             f"{type(m).__name__}; it folds into linear layers only")


def _restore_attention(model: nn.Module) -> None:
    """Attention implementations routed through the quantizing function get back their own."""
    for m in model.modules():
        cfg = getattr(m, "config", None)
        impl = getattr(cfg, "_attn_implementation", None)
        if isinstance(impl, str) and impl.startswith(kvcache.PREFIX_NAME):
            cfg._attn_implementation = impl[len(kvcache.PREFIX_NAME):]


def _move_hook(old: nn.Module, new: nn.Module) -> None:
    """An accelerate hook placing ``old`` (a device map without offloading) places ``new``."""
    hook = getattr(old, "_hf_hook", None)
    if hook is None:
        return
    from accelerate.hooks import add_hook_to_module, remove_hook_from_module
    remove_hook_from_module(old)
    add_hook_to_module(new, hook)


def dequantize_model(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """``model`` (in place) with every quantized module replaced by its float module, online input
    rotations folded, activation and key/value quantizers and key rotations dropped (see the module
    docstring). Checked first: nothing changes unless every quantized module can be dequantized.

    Args:
        model: a model with quantized modules (loaded; not offloaded by accelerate).
        dtype: the dtype of the float weights; ``None``: each module's compute dtype.

    Returns:
        ``model``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"dequantize: model must be a torch.nn.Module, got {type(model).__name__}")
    dtype = _check_dtype(dtype)
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, QModule)}
    experts = {name: m for name, m in model.named_modules() if isinstance(m, QExperts)}
    rotations = online.online_rotations(model)
    _check(model, quantized, rotations)
    for path, m in experts.items():
        held = [n for meta in m._qmeta.values() for n in meta[3] if n in offloaded_names(m) or m._buffers[n].is_meta]
        if held:
            raise ValueError(f"dequantize: {path}.{held[0]} is offloaded or not loaded")
    inputs = {site.module: rot for site, rot in rotations.items() if site.role == "input"}
    new = {path: float_module(m, dtype, rotation=inputs.get(path)) for path, m in quantized.items()}
    new.update({path: m.to_float(dtype) for path, m in experts.items()})
    quantized = {**quantized, **experts}
    folded = {}
    for path, rot in inputs.items():  # float linears the recipe left alone that take a rotation
        if path not in quantized:
            m = model.get_submodule(path)
            folded[path] = _rotated(m.weight.detach(), rot, transposed=is_conv1d(m)).to(m.weight.dtype)
    online.remove(model, list(rotations))
    for path, w in folded.items():
        m = model.get_submodule(path)
        m.weight = nn.Parameter(w, requires_grad=m.weight.requires_grad)
    for m in model.modules():  # key/value cache quantizers
        for role in qt.spec.KV_ROLES:
            if f"{role}_spec" in m.__dict__:
                actquant.attach(m, role, None)
                m.__dict__.pop(f"{role}_spec", None)
    _restore_attention(model)
    for path, m in new.items():
        old = quantized[path]
        parent, name = submodule(model, path)
        _move_hook(old, m)
        parent._modules[name] = m
    return model

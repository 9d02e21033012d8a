"""Input/output activation quantization of quantized modules (optional, per module).

A module may quantize its input and/or output with a :class:`~qtransform.QuantSpec`:

* a *dynamic* spec (``dynamic=True``): quantization parameters are fitted to each
  activation at run time;
* static :class:`~qtransform.QParams` (from calibration): stored as buffers named
  ``input_scale``, ``input_zero_point``... (``output_...``), so they travel with the
  state dict.

The spec applies to the activation as :func:`activation_view` shows it, on every forward path
(the fake-quantizing reference and the fp8 ``_scaled_mm`` kernel read their scales from the same
view): for linear layers and embeddings the **(tokens, features) matrix**, every leading axis of
an ``(..., features)`` activation flattened into tokens. So ``PerChannel(0)`` is *per token* (one
scale per row of that matrix, for a 2-D or a ``(batch, seq, features)`` input alike),
``PerChannel(-1)`` per feature, ``PerGroup(g)`` groups of ``g`` features of one token. Conv
activations (1-, 2- or 3-D) keep their ``(N, C, *spatial)`` shape (``PerChannel(1)``: per channel), and so do
their static scales (:func:`token_activations`). Static QParams
observed on a ``(batch, seq, features)`` activation (grid ``(1, 1, k)``) are taken as the
matrix's ``(1, k)``; a grid that varies along batch or sequence cannot be (``ValueError``).

By default the module fake-quantizes (``dequantize(quantize(x))``); a real low-precision
kernel (fp8 ``_scaled_mm``) consumes the quantized input directly when it applies.

Attention modules take static per-tensor quantizers of their key/value cache the same way (roles
``"key"`` and ``"value"``, see :mod:`bridge.modules.kvcache`), static per tensor or per key/value head
(``PerChannel(1)`` on the cache's ``(batch, heads, tokens, head_dim)`` layout), stored as ``k_scale``,
``v_scale`` (and ``k_zero_point``... for formats with a zero point): the names vLLM reads, scalars per
tensor, vectors of ``num_key_value_heads`` values per head.

>>> import torch, qtransform as qt
>>> from bridge.modules.actquant import apply, attach
>>> spec = qt.QuantSpec(format="int8", dynamic=True)
>>> x = torch.tensor([[0.0, 0.5, 1.0]])
>>> m = torch.nn.Module()
>>> attach(m, "input", spec)
>>> torch.equal(apply(m, "input", x), qt.fake_quantize(x, qt.choose_qparams(x, spec)))
True
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

import qtransform as qt
from qtransform.spec import KV_ROLES
from qtransform import QParams

from ..kernels import int8dyn

__all__ = ["PREFIX", "attach", "kv_heads", "token_activations", "activation_view", "qparams_for", "apply", "activation_specs", "stored_buffers",
           "static_buffers", "abstract_qparams"]

#: The observer of dynamic quantizers (min/max of each input), made once: ``torch.compile`` traces
#: its statistics but not the observer registry's lookup.
DYNAMIC_OBSERVER = _DYNAMIC_OBSERVER = qt.make_observer("minmax")

#: Stored-name prefix of each role's QParams fields: ``input_scale``, ``k_scale``...
PREFIX = {"input": "input_", "output": "output_", "key": "k_", "value": "v_"}


def attach(module: nn.Module, role: str, quant) -> None:
    """Give ``module`` an activation quantizer for ``role`` (``"input"`` or ``"output"``; ``"key"`` or
    ``"value"`` for an attention module's cache).

    ``quant`` is ``None``, a dynamic :class:`~qtransform.QuantSpec` or static :class:`~qtransform.QParams`
    (static per-tensor QParams only, for the key/value cache).
    """
    if role not in PREFIX:
        raise ValueError(f"role must be one of {list(PREFIX)}, got {role!r}")
    spec, tensors = None, {}
    if role in KV_ROLES and quant is not None and (
            not isinstance(quant, QParams) or quant.spec.dynamic or not qt.spec.is_kv_granularity(quant.spec.granularity)):
        raise ValueError(f"{role}_quant: the key/value cache takes static QParams per tensor or per key/value head "
                         f"(PerChannel(1); calibrated), got {quant}")
    if isinstance(quant, qt.QuantSpec):
        if not quant.dynamic:
            raise ValueError(f"{role}_quant: a QuantSpec must be dynamic (dynamic=True); pass static "
                             "QParams from calibration for static activation quantization")
        spec = quant
    elif isinstance(quant, QParams):
        if quant.spec.dynamic:
            raise ValueError(f"{role}_quant: QParams of a dynamic spec; pass the spec itself")
        spec, tensors = quant.spec, _stored(module, role, quant.tensors())
    elif quant is not None:
        raise TypeError(f"{role}_quant must be None, a dynamic QuantSpec or QParams, got {type(quant).__name__}")
    for f in QParams.FIELDS:  # checked above: nothing changes unless all of it is valid
        module._buffers.pop(PREFIX[role] + f, None)
    setattr(module, f"{role}_spec", spec)
    for f, t in tensors.items():
        module.register_buffer(PREFIX[role] + f, t)


def _stored(module: nn.Module, role: str, tensors: dict) -> dict:
    """Static QParams tensors as ``module`` stores them for ``role``: for the key/value cache scalars (per
    tensor) or vectors of one value per key/value head (``PerChannel(1)``, :func:`kv_heads`), the (tokens,
    features) matrix's grid for token activations, as they are otherwise."""
    if role in KV_ROLES:
        n = kv_heads(module) if any(t.numel() != 1 for t in tensors.values()) else 1
        bad = [f for f, t in tensors.items() if t.numel() != n or (n > 1 and t.dim() == 4 and t.shape[1] != n)]
        if bad:
            raise ValueError(f"{role}_quant: the key/value cache holds one value per field per tensor or one per "
                             f"key/value head ({kv_heads(module)} here), {bad[0]} has shape {tuple(tensors[bad[0]].shape)}")
        return {f: t.reshape(() if n == 1 else (n,)) for f, t in tensors.items()}
    if token_activations(module):
        return {f: _as_matrix_grid(role, f, t) for f, t in tensors.items()}
    return tensors


def token_activations(module: nn.Module) -> bool:
    """Whether ``module``'s activation specs apply to the (tokens, features) matrix (linear layers, embeddings)
    rather than to the activation as it is (convolutions: ``(N, C, *spatial)``). A quantized module says so
    itself (``token_activations``); a float module is answered as the quantized module that replaces it would:
    a checkpoint's expected shapes are found on the float model it loads into (:func:`static_buffers`), and
    must be the ones the quantized module stored."""
    own = getattr(module, "token_activations", None)
    return own if isinstance(own, bool) else not isinstance(module, nn.modules.conv._ConvNd)


def _as_matrix_grid(role: str, field: str, t: torch.Tensor) -> torch.Tensor:
    """A static QParams tensor as the grid of the (tokens, features) matrix (see the module docstring)."""
    if field == "global_scale" or t.dim() == 2:
        return t
    if any(n != 1 for n in t.shape[:-1]):
        raise ValueError(f"{role}_quant: static QParams apply to the (tokens, features) matrix of the activation "
                         f"(every leading axis flattened into tokens); {field} of shape {tuple(t.shape)} varies "
                         "along a leading axis (per batch element or position), which that matrix does not have")
    return t.reshape(1, t.shape[-1] if t.dim() else 1)


def kv_heads(module: nn.Module) -> int:
    """The number of key/value heads of attention ``module`` (its config's ``num_key_value_heads``, else
    ``num_attention_heads``): the length of its per-head ``k_scale``/``v_scale``."""
    cfg = getattr(module, "config", None)
    n = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_attention_heads", None)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"{type(module).__name__}: no num_key_value_heads / num_attention_heads in its config, "
                         "which per-head key/value scales need")
    return n


def activation_view(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The tensor an activation spec of ``module`` applies to: the (tokens, features) matrix
    ``x.reshape(-1, x.shape[-1])`` for linear layers and embeddings, ``x`` itself for modules whose
    ``token_activations`` is false (convolutions). The one definition every forward path uses."""
    if x.dim() == 2 or not token_activations(module):
        return x
    return x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)


def value_checks(x: torch.Tensor):
    """Off the CPU a forward's value checks are host synchronisations (one per quantizer per call): there the
    values propagate as NaN, as on every GPU kernel path, instead of raising (:func:`qtransform.data_checks`)."""
    if x.device.type == "cpu" or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return qt.data_checks(False)


def qparams_for(module: nn.Module, role: str, x: torch.Tensor) -> QParams | None:
    """The QParams that quantize ``x`` in ``role`` (fitted to it when dynamic), or ``None``; they
    describe :func:`activation_view` of ``x``."""
    spec = getattr(module, f"{role}_spec", None)
    if spec is None:
        return None
    if spec.dynamic:
        view = activation_view(module, x.detach())
        if _fused(spec, view):  # int8 per token: one pass, the same QParams (bridge.kernels.int8dyn)
            q = int8dyn.token_quantize(view, spec)
            if q is not None:
                return QParams(spec=spec, scale=q[1], zero_point=q[2])
        with value_checks(x):
            return qt.choose_qparams(view, spec, observer=_DYNAMIC_OBSERVER)
    fields = {f: module._buffers[PREFIX[role] + f] for f in QParams.FIELDS if PREFIX[role] + f in module._buffers}
    if role in KV_ROLES:  # stored as scalars or per head; the grid of the (batch, heads, tokens, head_dim) tensor
        fields = {f: t.reshape((1,) * x.dim()) if t.dim() == 0 else t.reshape(1, -1, *(1,) * (x.dim() - 2))
                  for f, t in fields.items()}
    return QParams(spec=spec, **fields)


def _fused(spec, view: torch.Tensor, x: torch.Tensor | None = None):
    """Whether a dynamic ``spec`` on ``view`` takes the fused int8 per-token quantizer: eager, on the CPU, a
    2-D view, no gradient through ``x`` (the general path's straight-through gradient)."""
    if (not spec.dynamic or view.dim() != 2 or view.device.type != "cpu" or torch.compiler.is_compiling()
            or (x is not None and x.requires_grad and torch.is_grad_enabled())):
        return False
    return int8dyn.fused_reason(spec) is None


def apply(module: nn.Module, role: str, x: torch.Tensor) -> torch.Tensor:
    """Fake-quantize ``x`` for ``role`` when ``module`` has a quantizer there (same shape as ``x``)."""
    spec = getattr(module, f"{role}_spec", None)
    if spec is None:
        return x
    if role in KV_ROLES:  # per tensor or per head on the cache's (batch, heads, tokens, head_dim) layout
        with value_checks(x):
            return qt.fake_quantize(x, qparams_for(module, role, x))
    view = activation_view(module, x)
    if _fused(spec, view, x):
        y = int8dyn.token_fake_quantize(view, spec)
        if y is not None:
            return y.reshape(x.shape)
    qp = qparams_for(module, role, x)
    with value_checks(x):
        return qt.fake_quantize(view, qp).reshape(x.shape)


def activation_specs(model: nn.Module) -> dict[qt.Site, qt.QuantSpec]:
    """``{Site: spec}`` of every activation quantizer of ``model``'s modules, key/value caches included
    (for checkpoints)."""
    out = {}
    for name, m in model.named_modules():
        if callable(getattr(m, "input_specs", None)):  # QExperts: one input quantizer per projection
            out.update({qt.Site(f"{name}.{leaf}", "input"): spec for leaf, spec in m.input_specs().items()})
        for role in PREFIX:
            spec = getattr(m, f"{role}_spec", None)
            if isinstance(spec, qt.QuantSpec):
                out[qt.Site(name, role)] = spec
    return out


def _example(module: nn.Module, role: str) -> torch.Tensor:
    """A zero activation of the shape ``role`` of ``module`` has (one token / one pixel)."""
    if role in KV_ROLES:
        cfg = getattr(module, "config", None)  # per head needs the head count; per tensor any grid of one value
        heads = kv_heads(module) if hasattr(cfg, "num_key_value_heads") or hasattr(cfg, "num_attention_heads") else 1
        return torch.zeros(1, heads, 1, 1, device="cpu")
    if hasattr(module, "nf") and not hasattr(module, "in_features"):  # transformers' Conv1D: weight (in, out)
        return torch.zeros(1, module.weight.shape[0] if role == "input" else module.nf, device="cpu")
    for i, o in (("in_features", "out_features"), ("in_channels", "out_channels")):
        if hasattr(module, i):
            n = getattr(module, i if role == "input" else o)
            shape = (1, n) if token_activations(module) else (1, n) + (1,) * len(module.kernel_size)
            return torch.zeros(shape, device="cpu")
    if role == "input" and hasattr(module, "embed_dim") and hasattr(module, "num_heads"):  # multi-head attention
        return torch.zeros(1, module.embed_dim, device="cpu")  # (its static input quantizers are per tensor)
    if role == "output" and hasattr(module, "embedding_dim"):
        return torch.zeros(1, module.embedding_dim, device="cpu")
    raise ValueError(f"{type(module).__name__}: no {role} activation quantizer for this module type")


def static_buffers(module: nn.Module, role: str, spec: qt.QuantSpec) -> dict[str, tuple[tuple, torch.dtype]]:
    """``{buffer name: (shape, dtype)}`` the static quantizer ``spec`` of ``role`` stores on ``module``
    (``input_scale``, ``input_zero_point``...), from shapes alone."""
    tensors = _stored(module, role, qt.choose_qparams(_example(module, role), spec).tensors())
    return {PREFIX[role] + f: (tuple(t.shape), t.dtype) for f, t in tensors.items()}


def stored_buffers(module: nn.Module, role: str, qparams: QParams) -> dict[str, torch.Tensor]:
    """``{buffer name: tensor}`` the calibrated static quantizer ``qparams`` of ``role`` becomes on ``module``
    (what a checkpoint stores under ``<module path>.<name>``; :func:`static_buffers` gives their shapes)."""
    return {PREFIX[role] + f: t for f, t in _stored(module, role, qparams.tensors()).items()}


def abstract_qparams(module: nn.Module, role: str, spec: qt.QuantSpec) -> QParams:
    """Static QParams of ``spec`` for ``role`` of ``module`` on the ``meta`` device (values to be loaded)."""
    shapes = static_buffers(module, role, spec)
    return QParams(spec=spec, **{n.removeprefix(PREFIX[role]): torch.empty(shape, dtype=dtype, device="meta")
                                 for n, (shape, dtype) in shapes.items()})

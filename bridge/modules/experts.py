"""Mixture-of-experts: transformers' experts modules and ``QExperts``, their quantized form.

transformers 5 holds the experts of a mixture-of-experts layer (Mixtral, Qwen2/3-MoE, DeepSeek-V3, OLMoE,
GPT-OSS...) in one module with stacked 3-D weights and a standard interface (its
``use_experts_implementation`` decorator): ``gate_up_proj`` ``(experts, 2·inter, hidden)`` (or ``up_proj``
without a gate), ``down_proj`` ``(experts, hidden, inter)``, stored ``(experts, in, out)`` where
``is_transposed``, optional ``*_bias`` ``(experts, out)``, ``_apply_gate``/``act_fn`` between them and an
optional ``post_expert_norm``; ``forward(hidden_states (tokens, hidden), top_k_index, top_k_weights)``.
:func:`is_experts` recognises such a module and :func:`expert_weights` names its weights (the tree paths
``<module>.gate_up_proj``... of module type ``"Experts"``).

:func:`routed_forward` is the one routed computation (transformers' eager loop: each expert that tokens
reached runs on its tokens, outputs weighted and summed in a fixed order) over weights given by a
function, with an optional *tap* that sees every expert's input to each projection (calibration: the
statistics of expert ``e`` come from the tokens routed to it, or from all tokens with ``all_tokens``). Where
the module's class wraps the standard forward in its own (a subclass whose ``forward`` calls
``super().forward``: Ergo's per-expert norms of each route), that wrapper runs around the loop.
``QExperts`` replaces the experts module: each quantized weight is a stacked QTensor (one
quantized matrix per expert, :mod:`qtransform.tensor.stacked`) held in buffers named by the native
layout (``gate_up_proj``, ``gate_up_proj_scale``...); a forward dequantizes only the experts its tokens
reached. It replaces transformers' ``eager``/``grouped_mm``/``batched_mm`` implementations by this loop.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import qtransform as qt
from qtransform import QTensor

from ..checkpoint.layout import NATIVE
from . import actquant
from .base import apply_moving_codes, weight_repr, store_codes

__all__ = ["EXPERT_WEIGHTS", "is_experts", "expert_weights", "routed_forward", "QExperts", "stacked_like", "stored_shape",
           "input_holder"]

#: The 3-D weights of a standard experts module, in forward order.
EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")
_FLAGS = ("has_gate", "has_bias", "is_transposed", "has_post_expert_norm")


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module with the standard interface (or its ``QExperts``)."""
    if isinstance(module, QExperts):
        return True
    if not all(hasattr(module, f) for f in _FLAGS) or not isinstance(getattr(module, "num_experts", None), int):
        return False
    first = "gate_up_proj" if module.has_gate else "up_proj"
    return all(isinstance(getattr(module, n, None), torch.Tensor) and getattr(module, n).dim() == 3
               for n in (first, "down_proj"))


def expert_weights(module: nn.Module) -> tuple[str, ...]:
    """The names of the stacked weights of an experts module (``gate_up_proj``/``up_proj``, ``down_proj``)."""
    if not is_experts(module):
        return ()
    return tuple(n for n in EXPERT_WEIGHTS if n != ("up_proj" if module.has_gate else "gate_up_proj"))


def stored_shape(module: nn.Module, name: str) -> tuple[int, ...]:
    """The stored shape of weight ``name`` of an experts module (float or :class:`QExperts`)."""
    return module._shape(name) if isinstance(module, QExperts) else tuple(getattr(module, name).shape)


def stacked_like(module: nn.Module, name: str) -> tuple[tuple[int, ...], bool]:
    """``((experts, out, in) logical shape, stored transposed)`` of weight ``name`` of an experts module."""
    shape = stored_shape(module, name)
    return ((shape[0], shape[2], shape[1]) if module.is_transposed else shape), bool(module.is_transposed)


def input_holder(module: nn.Module, name: str) -> nn.Module:
    """A stand-in with the input width of projection ``name`` of an experts module, for the activation
    quantizers' shape functions (:mod:`.actquant`); its buffers are stored as ``<experts>.<name>_input_*``."""
    holder = nn.Module()
    holder.in_features = holder.out_features = stacked_like(module, name)[0][2]
    return holder


def routed_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor, *, matrix: Callable, tap: Callable | None = None,
                   all_tokens: bool = False, inputs: Callable | None = None) -> torch.Tensor:
    """The experts' routed output ``(tokens, hidden)``.

    ``matrix(name, e, dtype)`` gives expert ``e``'s weight ``name`` as stored (``(out, in)``, or ``(in, out)``
    where ``module.is_transposed``); ``tap(name, e, x)``, when given, sees the input ``x`` of projection
    ``name`` of expert ``e``: the rows of the tokens routed to it, or every token with ``all_tokens`` (the
    output stays the routed one). ``inputs(name, x)``, when given, replaces each projection's input (activation
    quantization). Token ids of ``num_experts`` and above (expert-parallel sentinels) are skipped.
    Where the module's class (``QExperts``: the float class it replaced) wraps the standard forward in its own,
    that forward runs with this loop as its ``super().forward`` (:func:`_wrapper`).
    """
    def loop(h, index, weights):
        return _routed(module, h, index, weights, matrix, tap, all_tokens, inputs)

    wrapper = _wrapper(module._float_type if isinstance(module, QExperts) else type(module))
    if wrapper is None:
        return loop(hidden_states, top_k_index, top_k_weights)
    return wrapper.run(module, loop, hidden_states, top_k_index, top_k_weights)


def _routed(module, hidden_states, top_k_index, top_k_weights, matrix, tap, all_tokens, inputs):
    names = expert_weights(module)
    up, down = names[0], names[-1]
    final = torch.zeros_like(hidden_states)
    n = module.num_experts
    with torch.no_grad():
        hit = torch.unique(top_k_index[top_k_index < n]).tolist()
    experts = range(n) if all_tokens and tap is not None else hit
    for e in experts:
        pos, tok = torch.where((top_k_index == e).T)  # eager's order: by top-k slot, then token
        x = hidden_states if all_tokens and tap is not None else hidden_states[tok]
        y = _project(module, up, e, x, matrix, tap, inputs)
        y = module._apply_gate(y) if module.has_gate else module.act_fn(y)
        y = _project(module, down, e, y, matrix, tap, inputs)
        if module.has_post_expert_norm:
            y = module.post_expert_norm(y)
        if all_tokens and tap is not None:
            if e not in hit:
                continue
            y = y[tok]
        y = y * top_k_weights[tok, pos, None]
        final.index_add_(0, tok, y.to(final.dtype))
    return final


def _is_dispatch(fn) -> bool:
    """Whether ``fn`` is the ``forward`` that transformers' ``use_experts_implementation`` gives a class."""
    return (callable(fn) and getattr(fn, "__wrapped__", None) is not None and fn.__name__ == "forward"
            and getattr(fn, "__globals__", {}).get("__name__") == "transformers.integrations.moe")


@functools.lru_cache(maxsize=None)
def _wrapper(cls: type) -> type | None:
    """For an experts class whose ``forward`` wraps the standard one (Ergo's ``ErgoExperts`` over the decorated
    ``ErgoExpertProjections``: routes repeated one per row, then a norm per expert), a stand-in class whose
    ``run(module, loop, *args)`` runs that ``forward`` on ``module`` with ``loop`` as its ``super().forward``;
    ``None`` for a class whose ``forward`` is the standard one (or that has none).

    The stand-in's MRO is ``cls``'s with a class overriding ``forward`` just above the decorated class, so the
    wrapper's zero-argument ``super()`` reaches ``loop``; an instance reads every attribute from ``module``."""
    standard = next((c for c in cls.__mro__ if _is_dispatch(c.__dict__.get("forward"))), None)
    if standard is None or _is_dispatch(cls.forward):
        return None

    def loop_forward(self, *args, **kwargs):
        return self._loop(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_module"), name)

    def run(module, loop, *args, **kwargs):
        standin = object.__new__(stand_in)
        object.__setattr__(standin, "_module", module)
        object.__setattr__(standin, "_loop", loop)
        return cls.forward(standin, *args, **kwargs)

    inner = type(f"_Loop{standard.__name__}", (standard,), {"forward": loop_forward})
    stand_in = type(f"_Wrapped{cls.__name__}", (cls, inner), {"__getattr__": __getattr__, "run": staticmethod(run)})
    return stand_in


def _project(module, name, e, x, matrix, tap, inputs):
    if tap is not None:
        tap(name, e, x)
    if inputs is not None:
        x = inputs(name, x)
    w = matrix(name, e, x.dtype)
    bias = getattr(module, f"{name}_bias")[e].to(x.dtype) if module.has_bias else None
    return F.linear(x, w.t() if module.is_transposed else w, bias)


class QExperts(nn.Module):
    """A transformers experts module with quantized stacked weights (see the module docstring).

    Weights the recipe leaves in float stay ``nn.Parameter``s; biases, the activation, the gate function
    and a post-expert norm are the float module's. ``qtensor(name)`` rebuilds a quantized weight (no copy).
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        if not is_experts(module) or isinstance(module, QExperts):
            raise TypeError(f"QExperts: expected a transformers experts module, got {type(module).__name__}")
        for key, value in vars(module).items():  # flags, sizes, config, gate constants (GPT-OSS's alpha/limit)
            if not key.startswith("_") and not isinstance(value, (torch.Tensor, nn.Module)) and key != "training":
                setattr(self, key, value)
        self._gate_fn = type(module)._apply_gate if module.has_gate else None
        self.float_class = type(module).__name__
        self._float_type = type(module)
        for name, child in module.named_children():
            self.add_module(name, child)
        for name, p in module.named_parameters(recurse=False):
            self.register_parameter(name, p)
        self._qmeta: dict[str, tuple] = {}  # name -> (spec, width, dtype, qnames)
        self._act: dict[str, qt.QuantSpec] = {}  # name -> input quantizer spec
        self.compute_dtype = module.down_proj.dtype

    def _apply_gate(self, y: torch.Tensor) -> torch.Tensor:
        return self._gate_fn(self, y)

    @property
    def quantized_names(self) -> tuple[str, ...]:
        return tuple(self._qmeta)

    def set_qtensor(self, name: str, q: QTensor) -> None:
        """Hold weight ``name`` quantized as the stacked QTensor ``q`` (its shape must be the weight's)."""
        if name not in expert_weights(self):
            raise ValueError(f"QExperts: {name!r} is not one of its weights {list(expert_weights(self))}")
        if not isinstance(q, QTensor):
            raise TypeError(f"QExperts.{name}: expected a QTensor, got {type(q).__name__}")
        want = self._shape(name)
        if tuple(q.shape) != want:
            raise ValueError(f"QExperts.{name}: quantized weight has shape {tuple(q.shape)}, the experts need {want}")
        store_codes(self, name, q)

    def _shape(self, name):
        if name in self._qmeta:
            return tuple(self.qtensor(name).shape)
        return tuple(getattr(self, name).shape)

    def qtensor(self, name: str) -> QTensor:
        """Weight ``name`` as a stacked QTensor over this module's buffers (no copy)."""
        if name not in self._qmeta:
            raise ValueError(f"QExperts: {name!r} is not quantized (quantized: {list(self._qmeta)})")
        spec, width, dtype, _ = self._qmeta[name]
        return NATIVE.assemble(name, self._buffers, spec=spec, width=width, dtype=dtype)

    def matrix(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert ``e``'s weight ``name`` in float ``dtype``, as stored (dequantized when quantized)."""
        if name in self._qmeta:
            return qt.dequantize(qt.stacked.take(self.qtensor(name), slice(e, e + 1)), dtype=dtype)[0]
        return getattr(self, name)[e].to(dtype)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return routed_forward(self, hidden_states, top_k_index, top_k_weights, matrix=self.matrix,
                              inputs=self._quant_input if self._act else None)

    # ------------------------------------------------------------------ activation quantizers
    def in_features(self, name: str) -> int:
        """The input width of projection ``name`` of every expert."""
        shape = self._shape(name)
        return shape[1] if self.is_transposed else shape[2]

    def set_input_quant(self, name: str, quant) -> None:
        """Quantize the input of projection ``name`` (each expert's routed rows, a (tokens, features) matrix):
        ``None``, a dynamic QuantSpec or static QParams (one for all experts), as
        :func:`bridge.modules.actquant.attach`; static tensors are buffers ``<name>_input_scale``..."""
        if name not in expert_weights(self):
            raise ValueError(f"QExperts: {name!r} is not one of its weights {list(expert_weights(self))}")
        holder = nn.Module()  # the checks and stored form of a linear's input quantizer
        actquant.attach(holder, "input", quant)
        for f in qt.QParams.FIELDS:
            self._buffers.pop(f"{name}_input_{f}", None)
        self._act.pop(name, None)
        if holder.input_spec is not None:
            self._act[name] = holder.input_spec
        for key, t in holder._buffers.items():
            self.register_buffer(f"{name}_{key}", t)

    def input_specs(self) -> dict[str, qt.QuantSpec]:
        """``{projection name: spec}`` of the input quantizers."""
        return dict(self._act)

    def abstract_input(self, name: str, spec: qt.QuantSpec) -> qt.QParams:
        """Static QParams of ``spec`` for the input of ``name`` on ``meta`` (values to be loaded)."""
        return actquant.abstract_qparams(input_holder(self, name), "input", spec)

    def _quant_input(self, name: str, x: torch.Tensor) -> torch.Tensor:
        spec = self._act.get(name)
        if spec is None:
            return x
        with actquant.value_checks(x):
            if spec.dynamic:
                qp = qt.choose_qparams(x.detach(), spec, observer=actquant.DYNAMIC_OBSERVER)
            else:
                fields = {f: self._buffers[f"{name}_input_{f}"] for f in qt.QParams.FIELDS
                          if f"{name}_input_{f}" in self._buffers}
                qp = qt.QParams(spec=spec, **fields)
            return qt.fake_quantize(x, qp)

    def _apply(self, fn, recurse=True):
        probe = apply_moving_codes(self, fn, recurse, [n for meta in self._qmeta.values() for n in meta[3]])
        if probe.dtype != torch.float32:
            self.compute_dtype = probe.dtype
        return self

    def to_float(self, dtype: torch.dtype | None = None) -> nn.Module:
        """The float experts module this replaced (its class, built from ``config``), with the quantized weights
        dequantized to ``dtype`` (default: ``compute_dtype``); biases, activation and norm shared."""
        meta = [n for meta in self._qmeta.values() for n in meta[3] if self._buffers[n].is_meta]
        if meta:
            raise ValueError(f"QExperts: {meta[0]} is on the meta device (not loaded)")
        with torch.device("meta"):
            new = self._float_type(self.config)
        dtype = dtype or self.compute_dtype
        for name in expert_weights(self):
            w = qt.dequantize(self.qtensor(name), dtype=dtype) if name in self._qmeta else getattr(self, name)
            new._parameters[name] = w if isinstance(w, nn.Parameter) else nn.Parameter(w, requires_grad=False)
        for key, p in self._parameters.items():
            if key not in expert_weights(self):
                new._parameters[key] = p
        for key, child in self.named_children():
            new._modules[key] = child
        return new.train(self.training)

    def prepare(self) -> "QExperts":
        """Nothing to pack ahead (each forward dequantizes the experts it reaches); for the loaders' symmetry."""
        return self

    def extra_repr(self) -> str:
        parts = [f"num_experts={self.num_experts}", f"from={self.float_class}"]
        for name in expert_weights(self):
            quantized = name in self._qmeta
            parts.append(weight_repr(name, self.qtensor(name) if quantized else None,
                                     None if quantized else getattr(self, name)))
            if name in self._act:
                parts.append(f"{name}.input={self._act[name]}")
        return ", ".join(parts)

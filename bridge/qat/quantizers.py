"""The trainable fake quantizers :func:`bridge.qat.prepare` puts on a float model, and how they attach.

* :class:`WeightFakeQuant`: a parametrization (``torch.nn.utils.parametrize``) of a module's ``weight``: the
  module computes with ``learn.fake_quantize(weight, LearnedRange(lo, hi, spec))``, bit for bit the weight's
  quantize/dequantize round trip under the stored parameters of ``[lo, hi]``; the float weight stays the
  module's trainable parameter (``<module>.parametrizations.weight.original``), ``lo`` and ``hi`` (float32, the
  spec's grid) are parameters of the parametrization, trained by LSQ/LSQ+ gradients. The spec is the *stored*
  tensor's (the plan's: GPT-2's ``Conv1D`` stores its weight (in, out), its spec has the axes swapped).
* :class:`ActFakeQuant`: an input (forward pre-hook) or output (forward hook) quantizer, a submodule of the
  module it serves (``qat_input`` / ``qat_output``). It applies to the activation as the quantized modules'
  do (:mod:`bridge.modules.actquant`): the (tokens, features) matrix for linear layers and embeddings, the
  activation as it is for convolutions. Dynamic specs fit their parameters to each activation
  (``qt.fake_quantize(x, qt.choose_qparams(x.detach(), spec), range_grad=True)``); static ones learn their
  range (one per block of one token's grid, shared by every token).

>>> import torch, qtransform as qt
>>> from qtransform import learn
>>> lin = torch.nn.Linear(8, 2)
>>> spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(4))
>>> attach_weight(lin, WeightFakeQuant(learn.learnable(lin.weight, spec)))
>>> torch.equal(lin.weight, qt.dequantize(qt.quantize(lin.parametrizations.weight.original,
...                                                   qt.choose_qparams(lin.parametrizations.weight.original, spec))))
True
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

import qtransform as qt
from qtransform import learn

__all__ = ["WeightFakeQuant", "ActFakeQuant", "ACT_NAMES", "attach_weight", "weight_quantizer", "attach_activation",
           "detach_weight", "detach_activation", "token_view"]

#: The submodule name of each role's activation quantizer.
ACT_NAMES = {"input": "qat_input", "output": "qat_output"}

#: The observer of dynamic quantizers, made once (``torch.compile`` traces its statistics, not the registry).
_DYNAMIC = qt.make_observer("minmax")


def _range_parameters(module: nn.Module, r: learn.LearnedRange) -> None:
    trainable = learn.ranged(r.spec)  # a cast's scale is 1 whatever the range: nothing to learn
    module.lo = nn.Parameter(r.lo.detach().clone(), requires_grad=trainable)
    module.hi = nn.Parameter(r.hi.detach().clone(), requires_grad=trainable)


class WeightFakeQuant(nn.Module):
    """``weight -> learn.fake_quantize(weight, self.learned())`` (see the module docstring). ``path``: the
    weight's tree path, named by errors; ``zero_point``: ``learn.fake_quantize``'s (``"ste"``: LSQ+)."""

    def __init__(self, r: learn.LearnedRange, *, path: str | None = None, zero_point: str = "ste"):
        super().__init__()
        if not isinstance(r, learn.LearnedRange):
            raise TypeError(f"WeightFakeQuant: expected a qtransform.learn.LearnedRange, got {type(r).__name__}")
        if zero_point not in learn.ZERO_POINTS:
            raise ValueError(f"zero_point must be one of {list(learn.ZERO_POINTS)}, got {zero_point!r}")
        self.spec, self.path, self.zero_point = r.spec, path, zero_point
        _range_parameters(self, r)

    def learned(self) -> learn.LearnedRange:
        """The current ranges, as the core's pytree (``learn.to_qparams`` of it: what convert stores)."""
        return learn.LearnedRange(lo=self.lo, hi=self.hi, spec=self.spec)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return learn.fake_quantize(weight, self.learned(), zero_point=self.zero_point, path=self.path)

    def extra_repr(self) -> str:
        return f"{self.spec}, grid={tuple(self.lo.shape)}"


def token_view(x: torch.Tensor, tokens: bool) -> torch.Tensor:
    """The tensor an activation spec applies to (as :func:`bridge.modules.actquant.activation_view`): the
    (tokens, features) matrix when ``tokens``, else ``x`` itself (convolutions)."""
    if not tokens or x.dim() == 2:
        return x
    return x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)


class ActFakeQuant(nn.Module):
    """An activation's fake quantizer: ``spec`` dynamic (no parameter) or static with a learned range ``r``
    (its grid: one token's, see :func:`static_range`). ``tokens``: whether the activation is viewed as its
    (tokens, features) matrix (linear layers, embeddings) or kept as it is (convolutions)."""

    def __init__(self, spec: qt.QuantSpec, *, tokens: bool = True, r: learn.LearnedRange | None = None,
                 site: str | None = None, zero_point: str = "ste"):
        super().__init__()
        if spec.dynamic == (r is not None):
            raise ValueError(f"{site or 'ActFakeQuant'}: a dynamic spec takes no range, a static one needs one")
        self.spec, self.tokens, self.site, self.zero_point = spec, tokens, site, zero_point
        if r is not None:
            _range_parameters(self, r)

    def learned(self) -> learn.LearnedRange | None:
        return None if self.spec.dynamic else learn.LearnedRange(lo=self.lo, hi=self.hi, spec=self.spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        view = token_view(x, self.tokens)
        if self.spec.dynamic:
            qp = qt.choose_qparams(view.detach(), self.spec, observer=_DYNAMIC, path=self.site)
            return qt.fake_quantize(view, qp, range_grad=True, path=self.site).reshape(x.shape)
        r = self.learned()
        return learn.fake_quantize(view, r, zero_point=self.zero_point, path=self.site).reshape(x.shape)

    def extra_repr(self) -> str:
        return f"{self.spec}" + ("" if self.spec.dynamic else f", grid={tuple(self.lo.shape)}")


#: The attribute recording a parametrized module's parameter order (``state_dict`` order), restored on detach.
_ORDER = "_qt_qat_order"


def attach_weight(module: nn.Module, quantizer: WeightFakeQuant) -> None:
    """Parametrize ``module.weight`` by ``quantizer`` (the float weight stays its trainable ``original``)."""
    order = tuple(module._parameters)
    parametrize.register_parametrization(module, "weight", quantizer, unsafe=True)
    setattr(module, _ORDER, order)


def weight_quantizer(module: nn.Module) -> WeightFakeQuant | None:
    """``module``'s weight fake quantizer, or ``None``."""
    if not parametrize.is_parametrized(module, "weight"):
        return None
    return next((p for p in module.parametrizations.weight if isinstance(p, WeightFakeQuant)), None)


def detach_weight(module: nn.Module) -> None:
    """Remove the weight's parametrization, keeping the trained float weight (a parameter of ``module`` again).

    torch removes the ``weight`` property from the module's parametrized class, which a deep copy shares with
    the module it was copied from: ``module`` gets a class of its own first, so that the other keeps working."""
    cls = type(module)
    module.__class__ = type(cls.__name__, cls.__bases__,
                            {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")})
    parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
    order = module.__dict__.pop(_ORDER, ())  # the weight back at its place: state_dict (and tree) order as before
    params = module._parameters
    rest = [n for n in params if n not in order]
    module._parameters = type(params)((n, params[n]) for n in [*(n for n in order if n in params), *rest])


def _quantize_input(module: nn.Module, args, kwargs):
    """Forward pre-hook: the first tensor argument fake-quantized by ``module.qat_input``."""
    q = module.qat_input
    if args and isinstance(args[0], torch.Tensor):
        return (q(args[0]), *args[1:]), kwargs
    key = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
    if key is None:
        raise ValueError(f"{q.site}: the call passes no tensor to fake-quantize")
    return args, {**kwargs, key: q(kwargs[key])}


def _quantize_output(module: nn.Module, args, output):
    """Forward hook: the output fake-quantized by ``module.qat_output``."""
    return module.qat_output(output)


_HOOKS = {"input": _quantize_input, "output": _quantize_output}


def attach_activation(module: nn.Module, role: str, quantizer: ActFakeQuant) -> None:
    """Give ``module`` the activation quantizer of ``role`` (a submodule and its hook)."""
    if role not in ACT_NAMES:
        raise ValueError(f"role must be one of {list(ACT_NAMES)}, got {role!r}")
    module.add_module(ACT_NAMES[role], quantizer)
    if role == "input":
        module.register_forward_pre_hook(_quantize_input, with_kwargs=True)
    else:
        module.register_forward_hook(_quantize_output)


def detach_activation(module: nn.Module, role: str) -> ActFakeQuant | None:
    """Remove ``module``'s activation quantizer of ``role`` and its hook; returns it (``None``: it had none)."""
    quantizer = module._modules.pop(ACT_NAMES[role], None)
    hooks = module._forward_pre_hooks if role == "input" else module._forward_hooks
    for key in [k for k, fn in hooks.items() if fn is _HOOKS[role]]:
        del hooks[key]
        getattr(module, "_forward_pre_hooks_with_kwargs", {}).pop(key, None)
    return quantizer

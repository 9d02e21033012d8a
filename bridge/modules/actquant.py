"""Input/output activation quantization of quantized modules (optional, per module).

A module may quantize its input and/or output with a :class:`~qtransform.QuantSpec`:

* a *dynamic* spec (``dynamic=True``): quantization parameters are fitted to each
  activation at run time;
* static :class:`~qtransform.QParams` (from calibration): stored as buffers named
  ``input_scale``, ``input_zero_point``... (``output_...``), so they travel with the
  state dict.

By default the module fake-quantizes (``dequantize(quantize(x))``); a real low-precision
kernel (fp8 ``_scaled_mm``) consumes the quantized input directly when it applies.

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

import torch
from torch import nn

import qtransform as qt
from qtransform import QParams

__all__ = ["ROLES", "attach", "qparams_for", "apply"]

ROLES = ("input", "output")


def attach(module: nn.Module, role: str, quant) -> None:
    """Give ``module`` an activation quantizer for ``role`` (``"input"`` or ``"output"``).

    ``quant`` is ``None``, a dynamic :class:`~qtransform.QuantSpec` or static :class:`~qtransform.QParams`.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    for f in QParams.FIELDS:
        module._buffers.pop(f"{role}_{f}", None)
    if quant is None:
        setattr(module, f"{role}_spec", None)
        return
    if isinstance(quant, qt.QuantSpec):
        if not quant.dynamic:
            raise ValueError(f"{role}_quant: a QuantSpec must be dynamic (dynamic=True); pass static "
                             "QParams from calibration for static activation quantization")
        setattr(module, f"{role}_spec", quant)
        return
    if isinstance(quant, QParams):
        if quant.spec.dynamic:
            raise ValueError(f"{role}_quant: QParams of a dynamic spec; pass the spec itself")
        setattr(module, f"{role}_spec", quant.spec)
        for f, t in quant.tensors().items():
            module.register_buffer(f"{role}_{f}", t)
        return
    raise TypeError(f"{role}_quant must be None, a dynamic QuantSpec or QParams, got {type(quant).__name__}")


def qparams_for(module: nn.Module, role: str, x: torch.Tensor) -> QParams | None:
    """The QParams that quantize ``x`` in ``role`` (fitted to ``x`` when dynamic), or ``None``."""
    spec = getattr(module, f"{role}_spec", None)
    if spec is None:
        return None
    if spec.dynamic:
        return qt.choose_qparams(x.detach(), spec)
    fields = {f: module._buffers[f"{role}_{f}"] for f in QParams.FIELDS if f"{role}_{f}" in module._buffers}
    return QParams(spec=spec, **fields)


def apply(module: nn.Module, role: str, x: torch.Tensor) -> torch.Tensor:
    """Fake-quantize ``x`` for ``role`` when ``module`` has a quantizer there."""
    qp = qparams_for(module, role, x)
    return x if qp is None else qt.fake_quantize(x, qp)

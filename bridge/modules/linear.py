"""``QLinear``: quantized ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2).

>>> import torch, qtransform as qt
>>> lin = torch.nn.Linear(64, 32)
>>> w = lin.weight.detach()
>>> q = qt.quantize(w, qt.choose_qparams(w, qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))))
>>> m = QLinear.from_float(lin, q, kernel="dequant")
>>> m
QLinear(in_features=64, out_features=32, bias=True, weight=int8 channel(axis=0) sym [8.500 bits/element], kernel=dequant)
>>> x = torch.randn(3, 64)
>>> torch.allclose(m(x), torch.nn.functional.linear(x, qt.dequantize(q), lin.bias))
True
"""

from __future__ import annotations

import torch
from torch import nn

import qtransform as qt
from qtransform import QTensor

from .. import kernels
from .base import QModule, register_quantized_class

__all__ = ["QLinear", "is_conv1d"]


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2): a linear layer whose weight is stored (in, out)."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(module, Conv1D)


class QLinear(QModule):
    """Quantized ``nn.Linear`` (and transformers ``Conv1D``, ``transposed=True``: weight (in, out))."""

    KERNELS = kernels.LINEAR_KERNELS

    def __init__(self, qweight: QTensor, bias: torch.Tensor | None = None, *, transposed: bool = False, **kw):
        self.transposed = bool(transposed)
        self._set_hyper(qweight, kw)
        self.in_features, self.out_features = self.weight_shape[::-1] if not transposed else self.weight_shape
        super().__init__(qweight, **kw)
        self._set_bias(bias)

    @classmethod
    def from_float(cls, module: nn.Module, qweight: QTensor, **kw) -> "QLinear":
        """From an ``nn.Linear`` or a transformers ``Conv1D`` (the bias is shared, not copied)."""
        cls._check_from(module, qweight)
        return cls(qweight, module.bias, transposed=is_conv1d(module), **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._io(x, self._linear)
        return y

    def _linear(self, x):
        y = self._run(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _grad_input(self, grad: torch.Tensor, shape: torch.Size, **kw) -> torch.Tensor:
        w = qt.dequantize(self.qweight, dtype=grad.dtype)  # (out, in), or (in, out) transposed
        return (grad @ (w.t() if self.transposed else w)).reshape(shape)

    def extra_repr(self) -> str:
        t = ", transposed=True" if self.transposed else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}{t}, {self._describe()}")


register_quantized_class("Linear", lambda m: type(m) is nn.Linear, QLinear)
register_quantized_class("Conv1D", is_conv1d, QLinear)

"""``QLinear``: quantized ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2).

A ``QLinear`` may carry a low-rank correction of its quantization error (the ``lowrank`` step,
:class:`qtransform.LowRank`): buffers ``lowrank_a`` ``(r, in)`` and ``lowrank_b`` ``(out, r)`` in the
logical layout (``Conv1D`` too), added after whatever kernel runs: ``y = kernel(x) + (x aᵀ) bᵀ``.

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
        a = self._buffers.get("lowrank_a")
        if a is not None:  # the low-rank correction, after the kernel
            y = y + (x.to(a.dtype) @ a.T @ self._buffers["lowrank_b"].T).to(y.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @property
    def lowrank(self) -> qt.LowRank | None:
        """The low-rank correction this layer runs (``None``: none)."""
        a = self._buffers.get("lowrank_a")
        return None if a is None else qt.LowRank(a=a, b=self._buffers["lowrank_b"])

    def set_lowrank(self, c: qt.LowRank | None) -> None:
        """Run the correction ``c`` (``a`` ``(r, in)``, ``b`` ``(out, r)``; kept in its dtype) after the
        kernel, or none (``None``)."""
        if c is None:
            self._buffers.pop("lowrank_a", None)
            self._buffers.pop("lowrank_b", None)
            return
        if not isinstance(c, qt.LowRank):
            raise TypeError(f"QLinear.set_lowrank: expected a qtransform.LowRank or None, got {type(c).__name__}")
        if c.a.shape[1] != self.in_features or c.b.shape[0] != self.out_features:
            raise ValueError(f"QLinear.set_lowrank: a {tuple(c.a.shape)} and b {tuple(c.b.shape)} do not fit a "
                             f"layer of {self.in_features} inputs and {self.out_features} outputs")
        self.register_buffer("lowrank_a", c.a)
        self.register_buffer("lowrank_b", c.b)

    def _grad_input(self, grad: torch.Tensor, shape: torch.Size, **kw) -> torch.Tensor:
        w = qt.dequantize(self.qweight, dtype=grad.dtype)  # (out, in), or (in, out) transposed
        return (grad @ (w.t() if self.transposed else w)).reshape(shape)

    def extra_repr(self) -> str:
        t = ", transposed=True" if self.transposed else ""
        t += f", lowrank={self.lowrank.rank}" if "lowrank_a" in self._buffers else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}{t}, {self._describe()}")


register_quantized_class("Linear", lambda m: type(m) is nn.Linear, QLinear)
register_quantized_class("Conv1D", is_conv1d, QLinear)

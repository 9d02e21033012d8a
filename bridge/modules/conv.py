"""``QConv2d`` and ``QConvTranspose2d``: quantized 2-D convolutions (any padding mode, groups, dilation)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qtransform import QTensor

from .. import kernels
from .base import QModule, register_quantized_class

__all__ = ["QConv2d", "QConvTranspose2d"]


class _QConv(QModule):
    KERNELS = kernels.CONV_KERNELS
    _HYPER = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
              "padding_mode")
    _NDIM = 4

    def __init__(self, qweight: QTensor, bias=None, **kw):
        self._set_hyper(qweight, kw)
        super().__init__(qweight, **kw)
        self._set_bias(bias)

    @classmethod
    def from_float(cls, module: nn.Module, qweight: QTensor, **kw):
        cls._check_from(module, qweight)
        return cls(qweight, module.bias, **{k: getattr(module, k) for k in cls._HYPER}, **kw)

    def forward(self, x: torch.Tensor, *args) -> torch.Tensor:
        return self._io(x, lambda v: self._run(v, extra=args))

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, bias={self.bias is not None}, {self._describe()}")


class QConv2d(_QConv):
    """Quantized ``nn.Conv2d`` (any padding mode, groups, dilation)."""

    def _conv(self, x, w, extra=()):
        b = None if self.bias is None else self.bias.to(x.dtype)
        if self.padding_mode != "zeros":
            pad = tuple(p for p in reversed(self.padding) for _ in range(2))
            x = F.pad(x, pad, mode=self.padding_mode)
            return F.conv2d(x, w, b, self.stride, 0, self.dilation, self.groups)
        return F.conv2d(x, w, b, self.stride, self.padding, self.dilation, self.groups)


class QConvTranspose2d(_QConv):
    """Quantized ``nn.ConvTranspose2d``; ``forward(x, output_size=None)`` as in torch."""

    _HYPER = _QConv._HYPER + ("output_padding",)

    def _conv(self, x, w, extra=()):
        output_size = extra[0] if extra else None
        out_pad = nn.ConvTranspose2d._output_padding(self, x, output_size, self.stride, self.padding,
                                                     self.kernel_size, 2, self.dilation)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.conv_transpose2d(x, w, b, self.stride, self.padding, out_pad, self.groups, self.dilation)


register_quantized_class("Conv2d", lambda m: type(m) is nn.Conv2d, QConv2d)
register_quantized_class("ConvTranspose2d", lambda m: type(m) is nn.ConvTranspose2d, QConvTranspose2d)

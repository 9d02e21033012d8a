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
    token_activations = False  # activation specs apply to the (N, C, H, W) tensor as it is

    def __init__(self, qweight: QTensor, bias=None, **kw):
        self._set_hyper(qweight, kw)
        super().__init__(qweight, **kw)
        self._set_bias(bias)

    @classmethod
    def from_float(cls, module: nn.Module, qweight: QTensor, **kw):
        cls._check_from(module, qweight)
        return cls(qweight, module.bias, **{k: getattr(module, k) for k in cls._HYPER}, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._io(x, self._run)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, bias={self.bias is not None}, {self._describe()}")


class QConv2d(_QConv):
    """Quantized ``nn.Conv2d`` (any padding mode, groups, dilation)."""

    def _conv(self, x, w):
        b = None if self.bias is None else self.bias.to(x.dtype)
        if self.padding_mode != "zeros":
            pad = tuple(p for p in reversed(self.padding) for _ in range(2))
            x = F.pad(x, pad, mode=self.padding_mode)
            return F.conv2d(x, w, b, self.stride, 0, self.dilation, self.groups)
        return F.conv2d(x, w, b, self.stride, self.padding, self.dilation, self.groups)


class QConvTranspose2d(_QConv):
    """Quantized ``nn.ConvTranspose2d``; ``forward(x, output_size=None)`` as in torch (positional or
    keyword; ``(H, W)`` or the full ``(N, C, H, W)``)."""

    _HYPER = _QConv._HYPER + ("output_padding",)

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        return self._io(x, self._run, output_size=output_size)

    def _conv(self, x, w, output_size=None):
        if output_size is not None and (not isinstance(output_size, (list, tuple)) or not all(
                isinstance(n, int) and not isinstance(n, bool) for n in output_size)):
            raise TypeError(f"{type(self).__name__}: output_size must be None or a list/tuple of ints ((H, W) or "
                            f"(N, C, H, W)), got {output_size!r}")
        try:
            out_pad = nn.ConvTranspose2d._output_padding(self, x, output_size, self.stride, self.padding,
                                                         self.kernel_size, 2, self.dilation)
        except ValueError as e:  # torch's message (a size out of reach, a wrong length) without the name
            raise ValueError(f"{type(self).__name__}: output_size {list(output_size)}: {e}") from None
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.conv_transpose2d(x, w, b, self.stride, self.padding, out_pad, self.groups, self.dilation)


register_quantized_class("Conv2d", lambda m: type(m) is nn.Conv2d, QConv2d)
register_quantized_class("ConvTranspose2d", lambda m: type(m) is nn.ConvTranspose2d, QConvTranspose2d)

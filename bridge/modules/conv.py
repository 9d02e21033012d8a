"""Quantized convolutions of any dimensionality: ``QConv1d``, ``QConv2d``, ``QConv3d`` and ``QConvTranspose1d``,
``QConvTranspose2d``, ``QConvTranspose3d`` (any padding mode, groups, dilation; grouped and depthwise alike).

Their activations keep the ``(N, C, *spatial)`` layout (``token_activations = False``, see
:mod:`bridge.modules.actquant`): a static per-tensor input scale is stored with one axis per dimension of
that tensor (``(1, 1, 1)`` for ``Conv1d``, ``(1, 1, 1, 1)`` for ``Conv2d``...), ``PerChannel(1)`` per channel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qtransform import QTensor

from .. import kernels
from .base import QModule, register_quantized_class

__all__ = ["QConv1d", "QConv2d", "QConv3d", "QConvTranspose1d", "QConvTranspose2d", "QConvTranspose3d"]


class _QConv(QModule):
    KERNELS = kernels.CONV_KERNELS
    _HYPER = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
              "padding_mode")
    _SPATIAL = 2  # spatial dimensions (1, 2, 3); the weight has two more
    _NDIM = 4
    token_activations = False  # activation specs apply to the (N, C, *spatial) tensor as it is

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


class _QConvForward(_QConv):
    _FN = staticmethod(F.conv2d)

    def _conv(self, x, w):
        b = None if self.bias is None else self.bias.to(x.dtype)
        if self.padding_mode != "zeros":
            pad = tuple(p for p in reversed(self.padding) for _ in range(2))
            x = F.pad(x, pad, mode=self.padding_mode)
            return self._FN(x, w, b, self.stride, 0, self.dilation, self.groups)
        return self._FN(x, w, b, self.stride, self.padding, self.dilation, self.groups)


class QConv1d(_QConvForward):
    """Quantized ``nn.Conv1d`` (any padding mode, groups, dilation)."""

    _SPATIAL, _NDIM, _FN = 1, 3, staticmethod(F.conv1d)


class QConv2d(_QConvForward):
    """Quantized ``nn.Conv2d`` (any padding mode, groups, dilation)."""

    _SPATIAL, _NDIM, _FN = 2, 4, staticmethod(F.conv2d)


class QConv3d(_QConvForward):
    """Quantized ``nn.Conv3d`` (any padding mode, groups, dilation)."""

    _SPATIAL, _NDIM, _FN = 3, 5, staticmethod(F.conv3d)


class _QConvTranspose(_QConv):
    """``forward(x, output_size=None)`` as in torch (positional or keyword; the spatial sizes or the full
    ``(N, C, *spatial)``)."""

    _HYPER = _QConv._HYPER + ("output_padding",)
    _FN = staticmethod(F.conv_transpose2d)

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        return self._io(x, self._run, output_size=output_size)

    def _conv(self, x, w, output_size=None):
        if output_size is not None and (not isinstance(output_size, (list, tuple)) or not all(
                isinstance(n, int) and not isinstance(n, bool) for n in output_size)):
            raise TypeError(f"{type(self).__name__}: output_size must be None or a list/tuple of ints (the spatial "
                            f"sizes or the full (N, C, *spatial)), got {output_size!r}")
        try:
            out_pad = nn.ConvTranspose2d._output_padding(self, x, output_size, self.stride, self.padding,
                                                         self.kernel_size, self._SPATIAL, self.dilation)
        except ValueError as e:  # torch's message (a size out of reach, a wrong length) without the name
            raise ValueError(f"{type(self).__name__}: output_size {list(output_size)}: {e}") from None
        b = None if self.bias is None else self.bias.to(x.dtype)
        return self._FN(x, w, b, self.stride, self.padding, out_pad, self.groups, self.dilation)


class QConvTranspose1d(_QConvTranspose):
    """Quantized ``nn.ConvTranspose1d``; ``forward(x, output_size=None)`` as in torch."""

    _SPATIAL, _NDIM, _FN = 1, 3, staticmethod(F.conv_transpose1d)


class QConvTranspose2d(_QConvTranspose):
    """Quantized ``nn.ConvTranspose2d``; ``forward(x, output_size=None)`` as in torch (positional or
    keyword; ``(H, W)`` or the full ``(N, C, H, W)``)."""

    _SPATIAL, _NDIM, _FN = 2, 4, staticmethod(F.conv_transpose2d)


class QConvTranspose3d(_QConvTranspose):
    """Quantized ``nn.ConvTranspose3d``; ``forward(x, output_size=None)`` as in torch."""

    _SPATIAL, _NDIM, _FN = 3, 5, staticmethod(F.conv_transpose3d)


#: ``{torch class: quantized class}`` of the convolutions, in registration order.
CONV_CLASSES = {nn.Conv1d: QConv1d, nn.Conv2d: QConv2d, nn.Conv3d: QConv3d, nn.ConvTranspose1d: QConvTranspose1d,
                nn.ConvTranspose2d: QConvTranspose2d, nn.ConvTranspose3d: QConvTranspose3d}

for _float, _cls in CONV_CLASSES.items():
    register_quantized_class(_float.__name__, lambda m, t=_float: type(m) is t, _cls)

"""Quantized modules: ``QLinear``, ``QConv2d``, ``QConvTranspose2d``, ``QEmbedding``, ``QEmbeddingBag``.

Each holds its weight as a :class:`~qtransform.QTensor` spread over buffers (see
:mod:`bridge.qstate`): ``weight`` (the packed codes), ``weight_scale``,
``weight_zero_point``... so ``state_dict``, ``load_state_dict`` and ``.to(device)`` work,
and ``module.qweight`` rebuilds the QTensor (no copy). The spec, logical width and
dequantized dtype are static attributes.

``.to(dtype)`` sets the *compute* dtype: the bias and other float parameters are cast,
the quantized buffers never are (casting a scale would change the quantization).
Linear and conv modules compute in the input's dtype; embeddings return
``compute_dtype`` (initially the dtype of the original weight).

Invariant: ``module(x)`` equals the float op on ``dequantize(module.qweight)`` (``F.linear``,
``F.conv2d``, ...) to float rounding (bf16 rounding for the packed CPU kernels, see
:mod:`bridge.kernels`). Optional input/output quantizers follow :mod:`bridge.actquant`.

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
import torch.nn.functional as F
from torch import nn

from qtransform.qtypes import QTensor

from . import actquant, kernels
from .qstate import dtype_name, from_named, named_tensors

__all__ = ["QModule", "QLinear", "QConv2d", "QConvTranspose2d", "QEmbedding", "QEmbeddingBag",
           "is_conv1d", "quantized_class"]


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2): a linear layer whose weight is stored (in, out)."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(module, Conv1D)


class QModule(nn.Module):
    """Base of the quantized modules: QTensor buffers, kernel choice, dtype-safe ``_apply``."""

    KERNELS: dict = {}
    transposed = False
    _HYPER: tuple[str, ...] = ()  # hyper-parameters copied from the float module (conv, embedding)
    _NDIM = 2  # weight dimensions

    def _set_hyper(self, qweight: QTensor, kw: dict) -> None:
        """Pop ``_HYPER`` from ``kw`` into attributes and record the weight shape (before ``__init__``)."""
        missing = [k for k in self._HYPER if k not in kw]
        if missing:
            raise TypeError(f"{type(self).__name__}: missing hyper-parameter(s) {missing}")
        for k in self._HYPER:
            setattr(self, k, kw.pop(k))
        self.weight_shape = tuple(qweight.shape)
        if len(self.weight_shape) != self._NDIM:
            raise ValueError(f"{type(self).__name__}: weight must be {self._NDIM}-D, got shape {self.weight_shape}")

    def _set_bias(self, bias) -> None:
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)

    def __init__(self, qweight: QTensor, *, kernel: str = "auto", input_quant=None, output_quant=None):
        super().__init__()
        self._qnames: tuple[str, ...] = ()
        self._kernel_request = "auto"
        self._cache = None  # (key, kernel name, prepared state)
        self.compute_dtype = qweight.dtype if isinstance(qweight, QTensor) else None
        self.set_qweight(qweight)
        actquant.attach(self, "input", input_quant)
        actquant.attach(self, "output", output_quant)
        self.kernel = kernel

    # ------------------------------------------------------------------ weight
    def set_qweight(self, q: QTensor) -> None:
        """Replace the quantized weight (its shape must fit the module)."""
        if not isinstance(q, QTensor):
            raise TypeError(f"{type(self).__name__}: qweight must be a qtransform QTensor, got {type(q).__name__}")
        self._check_shape(tuple(q.shape))
        for name in self._qnames:
            self._buffers.pop(name, None)
        tensors = named_tensors("weight", q)
        for name, t in tensors.items():
            self.register_buffer(name, t)
        self._qnames = tuple(tensors)
        self.spec, self.weight_width, self.weight_dtype = q.spec, q.width, q.dtype
        self._cache = None

    @staticmethod
    def _check_from(module: nn.Module, q) -> None:
        want = tuple(module.weight.shape)
        if tuple(q.shape) != want:
            raise ValueError(f"quantized weight has shape {tuple(q.shape)}, the {type(module).__name__} "
                             f"needs {want}")

    def _check_shape(self, shape: tuple[int, ...]) -> None:
        if shape != self.weight_shape:
            raise ValueError(f"{type(self).__name__}: quantized weight has shape {shape}, the module needs "
                             f"{self.weight_shape}")

    @property
    def qweight(self) -> QTensor:
        """The weight as a QTensor over this module's buffers (no copy)."""
        return from_named("weight", self._buffers, spec=self.spec, width=self.weight_width, dtype=self.weight_dtype)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight (materialized; for inspection and reference checks)."""
        from qtransform import dequantize
        return dequantize(self.qweight, dtype=dtype)

    # ------------------------------------------------------------------ kernels
    @property
    def kernel(self) -> str:
        """The forward path that runs (see :mod:`bridge.kernels`)."""
        return self._resolve()[1]

    @kernel.setter
    def kernel(self, request: str) -> None:
        if not isinstance(request, str):
            raise TypeError(f"kernel must be a string, got {type(request).__name__}")
        if request != "auto":
            kernels.choose(self, self.KERNELS, request)  # validates now, with a clear reason
        self._kernel_request = request
        self._cache = None

    def available_kernels(self) -> tuple[str, ...]:
        """Kernels that apply to this module on its current device, fastest first."""
        return kernels.eligible(self, self.KERNELS)

    def _key(self):
        return tuple((id(b), b._version, b.device) for b in (self._buffers[n] for n in self._qnames))

    def _resolve(self):
        key = self._key()
        if self._cache is None or self._cache[0] != key:
            name = kernels.choose(self, self.KERNELS, self._kernel_request)
            self._cache = (key, name, None)
        return self._cache

    def _run(self, x: torch.Tensor, **kw) -> torch.Tensor:
        key, name, state = self._resolve()
        k = self.KERNELS[name]
        if state is None and k.prepare is not None:
            with torch.no_grad():
                state = k.prepare(self)
            self._cache = (key, name, state)
        return k.run(self, state, x, **kw)

    # ------------------------------------------------------------------ torch.nn plumbing
    def _apply(self, fn, recurse=True):
        dev = self.weight.device
        p32, p64 = (fn(torch.empty(0, dtype=d, device=dev)) for d in (torch.float32, torch.float64))
        casts = p32.dtype != torch.float32 or p64.dtype != torch.float64
        held = {n: self._buffers.pop(n) for n in self._qnames}
        try:
            super()._apply(fn, recurse)
        finally:
            for n, b in held.items():
                self._buffers[n] = b.to(device=p32.device) if casts else fn(b)
        if casts:
            self.compute_dtype = p32.dtype if p32.dtype != torch.float32 else p64.dtype
        self._cache = None
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        for n in self._qnames:
            key = prefix + n
            if key in state_dict:
                got, want = state_dict[key], self._buffers[n]
                if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
                    error_msgs.append(f"{key}: quantized buffer has shape {tuple(got.shape)} and dtype "
                                      f"{dtype_name(got.dtype)}, expected {tuple(want.shape)} and "
                                      f"{dtype_name(want.dtype)} ({self.spec})")
                    return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        self._cache = None

    def _describe(self) -> str:
        q = self.qweight
        try:
            bits = f" [{q.bits_per_element():.3f} bits/element]"
        except RuntimeError:
            bits = ""
        act = "".join(f", {r}={getattr(self, r + '_spec')}" for r in actquant.ROLES if getattr(self, r + "_spec"))
        return f"weight={self.spec}{bits}{act}, kernel={self._kernel_request if self.weight.is_meta else self.kernel}"

    def _io(self, x, fn, **kw):
        if not self.KERNELS[self._resolve()[1]].quantizes_input:
            x = actquant.apply(self, "input", x)
        return actquant.apply(self, "output", fn(x, **kw))


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

    def extra_repr(self) -> str:
        t = ", transposed=True" if self.transposed else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}{t}, {self._describe()}")


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


class _QEmbed(QModule):
    KERNELS = kernels.EMBEDDING_KERNELS
    _HYPER = ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
              "sparse")

    def __init__(self, qweight: QTensor, **kw):
        self._set_hyper(qweight, kw)
        super().__init__(qweight, **kw)

    @classmethod
    def from_float(cls, module: nn.Module, qweight: QTensor, **kw):
        cls._check_from(module, qweight)
        return cls(qweight, **{k: getattr(module, k) for k in cls._HYPER}, **kw)

    def _pad(self, rows):
        if self.padding_idx is None or rows is None:
            return self.padding_idx
        hit = (rows == self.padding_idx).nonzero()
        return int(hit[0, 0]) if hit.numel() else None

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self._describe()}"


class QEmbedding(_QEmbed):
    """Quantized ``nn.Embedding``: by default dequantizes only the rows looked up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return actquant.apply(self, "output", self._run(x))

    def _lookup(self, idx, w, rows):
        # padding_idx only shapes gradients, and the quantized weight has none: no lookup needed
        return F.embedding(idx, w, None, self.max_norm, self.norm_type)


class QEmbeddingBag(_QEmbed):
    """Quantized ``nn.EmbeddingBag``: ``forward(input, offsets=None, per_sample_weights=None)``."""

    _HYPER = _QEmbed._HYPER + ("mode", "include_last_offset")

    def forward(self, x: torch.Tensor, offsets=None, per_sample_weights=None) -> torch.Tensor:
        y = self._run(x, offsets=offsets, per_sample_weights=per_sample_weights)
        return actquant.apply(self, "output", y)

    def _lookup(self, idx, w, rows, offsets=None, per_sample_weights=None):
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.to(w.dtype)
        return F.embedding_bag(idx, w, offsets, self.max_norm, self.norm_type, False, self.mode, False,
                               per_sample_weights, self.include_last_offset, self._pad(rows))


_MAP = ((nn.Linear, QLinear), (nn.Conv2d, QConv2d), (nn.ConvTranspose2d, QConvTranspose2d),
        (nn.Embedding, QEmbedding), (nn.EmbeddingBag, QEmbeddingBag))


def quantized_class(module: nn.Module) -> type[QModule] | None:
    """The quantized class that replaces ``module`` (``None`` if unsupported)."""
    if isinstance(module, QModule):
        return type(module)
    if is_conv1d(module):
        return QLinear
    return next((q for f, q in _MAP if type(module) is f), None)



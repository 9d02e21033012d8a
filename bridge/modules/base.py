"""The base of the quantized modules, and the table of which float module each replaces.

A quantized module holds its weight as a :class:`~qtransform.QTensor` spread over buffers named
by the native checkpoint layout (:mod:`bridge.checkpoint.layout`): ``weight`` (the packed codes),
``weight_scale``, ``weight_zero_point``... so ``state_dict``, ``load_state_dict`` and
``.to(device)`` work, and ``module.qweight`` rebuilds the QTensor (no copy). The spec, logical
width and dequantized dtype are static attributes.

``.to(dtype)`` sets the *compute* dtype: the bias and other float parameters are cast,
the quantized buffers never are (casting a scale would change the quantization).
Linear and conv modules compute in the input's dtype; embeddings return
``compute_dtype`` (initially the dtype of the original weight).

Invariant: ``module(x)`` equals the float op on ``dequantize(module.qweight)`` (``F.linear``,
``F.conv2d``, ...) to float rounding (bf16 rounding for the packed CPU kernels, see
:mod:`bridge.kernels`). Optional input/output quantizers follow :mod:`bridge.modules.actquant`.

:data:`QUANTIZED_CLASSES` maps a float module to its quantized class by a predicate, in
registration order (``Linear``, transformers' ``Conv1D``, ``Conv2d``...)."""

from __future__ import annotations

import torch
from torch import nn

import qtransform as qt
from qtransform import QTensor

from .. import kernels
from ..checkpoint.layout import NATIVE, dtype_name
from . import actquant

__all__ = ["QModule", "QUANTIZED_CLASSES", "register_quantized_class", "quantized_class", "apply_moving_codes", "weight_repr", "store_codes"]


class QModule(nn.Module):
    """Base of the quantized modules: QTensor buffers, kernel choice, dtype-safe ``_apply``."""

    KERNELS: dict = {}
    transposed = False
    token_activations = True  # activation specs apply to the (tokens, features) matrix (see actquant)
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
        tensors = NATIVE.parts("weight", q)
        for name, t in tensors.items():
            self.register_buffer(name, t)
        self._qnames = tuple(tensors)
        self.spec, self.weight_width, self.weight_dtype = q.spec, q.width, q.dtype
        self._cache = None

    def set_activation(self, role: str, quant) -> None:
        """Give the module an activation quantizer for ``role`` (``"input"``/``"output"``): ``None``, a
        dynamic :class:`~qtransform.QuantSpec` or static :class:`~qtransform.QParams` (see
        :mod:`bridge.modules.actquant`); the forward path is chosen again."""
        actquant.attach(self, role, quant)
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
        return NATIVE.assemble("weight", self._buffers, spec=self.spec, width=self.weight_width, dtype=self.weight_dtype)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight (materialized; for inspection and reference checks)."""
        return qt.dequantize(self.qweight, dtype=dtype)

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
        if torch.compiler.is_compiling() and self._cache is not None:
            return self._cache  # chosen outside the trace: no guards on buffer identities
        key = self._key()
        if self._cache is None or self._cache[0] != key:
            name = kernels.choose(self, self.KERNELS, self._kernel_request)
            self._cache = (key, name, None)
        return self._cache

    @torch.compiler.disable
    def _prepared(self):
        """The kernel choice and its prepared state, computed eagerly (outside any compiled graph)."""
        key, name, state = self._resolve()
        k = self.KERNELS[name]
        if state is None:  # kernels with nothing to prepare get an empty state: "prepared"
            with torch.no_grad():
                state = {} if k.prepare is None else k.prepare(self)
            self._cache = (key, name, state)
        return self._cache

    def prepare(self) -> "QModule":
        """Choose the kernel and derive its packed state now (it is otherwise derived on first use).

        Loading a checkpoint and :func:`bridge.to_module` call it, so that ``torch.compile`` traces
        a forward with no data-dependent work: after ``.to(...)`` or ``load_state_dict`` the state
        is derived again on the next eager call, or by calling ``prepare()`` before compiling (a
        compiled forward that finds no prepared state runs this step outside its graph, which
        ``fullgraph=True`` refuses). No-op on the ``meta`` device. Returns ``self``."""
        if not any(self._buffers[n].is_meta for n in self._qnames):
            self._prepared()
        return self

    def _run(self, x: torch.Tensor, **kw) -> torch.Tensor:
        cache = self._cache
        if not (torch.compiler.is_compiling() and cache is not None and cache[2] is not None):
            cache = self._prepared()
        k = self.KERNELS[cache[1]]
        if torch.is_grad_enabled() and x.requires_grad:
            return _KernelGrad.apply(x, self, k, cache[2], kw)
        return k.run(self, cache[2], x, **kw)

    def _grad_input(self, grad: torch.Tensor, shape: torch.Size, **kw) -> torch.Tensor:
        """The gradient of ``_run`` with respect to its (floating) input of ``shape``, given the
        output's gradient: the vector-Jacobian product of the reference (``dequant``) path, which is
        affine in the input, so it is evaluated at zero. Subclasses override it with a closed form."""
        ref = self.KERNELS["dequant"]
        with torch.enable_grad():
            x = grad.new_zeros(shape, requires_grad=True)
            y = ref.run(self, None, x, **kw)
            return torch.autograd.grad(y, x, grad)[0]

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
        act = "".join(f", {r}={getattr(self, r + '_spec')}" for r in qt.spec.ROLES if getattr(self, r + "_spec"))
        return f"weight={self.spec}{bits}{act}, kernel={self._kernel_request if self.weight.is_meta else self.kernel}"

    def input_qparams(self, x: torch.Tensor):
        """The QParams that quantize the input ``x`` (fitted to it when dynamic), or ``None``: they describe
        ``actquant.activation_view(self, x)``, the (tokens, features) matrix for linear layers."""
        return actquant.qparams_for(self, "input", x)

    def _io(self, x, fn, **kw):
        with actquant.value_checks(x):  # no host synchronisation per call off the CPU
            if not self.KERNELS[self._resolve()[1]].quantizes_input:
                x = actquant.apply(self, "input", x)
            return actquant.apply(self, "output", fn(x, **kw))


class _KernelGrad(torch.autograd.Function):
    """Any kernel forward, with the gradient with respect to the input through the dequantized
    weight (recomputed in ``backward``, never kept: the quantized weight is frozen, QLoRA-style)."""

    @staticmethod
    def forward(ctx, x, module, kernel, state, kw):
        ctx.module, ctx.kw, ctx.shape = module, kw, x.shape
        return kernel.run(module, state, x, **kw)

    @staticmethod
    def backward(ctx, grad):
        gx = ctx.module._grad_input(grad, ctx.shape, **ctx.kw)
        return gx, None, None, None, None


def _check_entry(name: str, entry) -> None:
    match, cls = entry
    if not callable(match) or not (isinstance(cls, type) and issubclass(cls, QModule)):
        raise TypeError(f"register_quantized_class {name}: expected (predicate, QModule subclass)")


#: ``name -> (matches(module) -> bool, QModule subclass)``: which quantized class replaces a module.
QUANTIZED_CLASSES = qt.Registry("quantized module class", check=_check_entry)


def register_quantized_class(name: str, matches, cls: type) -> None:
    """``cls`` replaces the modules for which ``matches(module)`` is true."""
    QUANTIZED_CLASSES.register(name, (matches, cls))


def quantized_class(module: nn.Module) -> type[QModule] | None:
    """The quantized class that replaces ``module`` (``None`` if unsupported)."""
    if isinstance(module, QModule):
        return type(module)
    return next((cls for match, cls in QUANTIZED_CLASSES.values() if match(module)), None)


def apply_moving_codes(module: nn.Module, fn, recurse: bool, names) -> torch.Tensor:
    """``nn.Module._apply`` for a module (a direct ``nn.Module`` subclass) holding the quantized buffers ``names``:
    they move with ``fn``'s device and are never cast; the rest as torch applies ``fn``. Returns what ``fn`` makes
    of an empty float32 tensor (its dtype tells a cast)."""
    held = {n: module._buffers.pop(n) for n in names}
    dev = next(iter(held.values())).device if held else None
    probe = fn(torch.empty(0, dtype=torch.float32, device=dev or "cpu"))
    try:
        nn.Module._apply(module, fn, recurse)
    finally:
        for n, b in held.items():
            module._buffers[n] = b.to(device=probe.device)
    return probe


def weight_repr(name: str, q: QTensor | None, float_weight: torch.Tensor | None) -> str:
    """``name=<spec> [b bits/element]`` of a quantized weight ``q``, else ``name=float <dtype>`` (for ``extra_repr``)."""
    if q is None:
        return f"{name}=float {dtype_name(float_weight.dtype)}"
    try:
        bits = f" [{q.bits_per_element():.3f} bits/element]"
    except RuntimeError:
        bits = ""
    return f"{name}={q.spec}{bits}"


def store_codes(module: nn.Module, name: str, q: QTensor) -> None:
    """Hold ``q`` in ``module`` (a direct ``nn.Module`` subclass with a ``_qmeta`` dict) as the checkpoint's buffers
    of weight ``name``, in place of its float parameter and of an earlier quantized form; ``_qmeta[name]`` records
    what reassembles it (``NATIVE.assemble(name, module._buffers, spec=, width=, dtype=)``)."""
    module._parameters.pop(name, None)
    for old in module._qmeta.get(name, (None, None, None, ()))[3]:
        module._buffers.pop(old, None)
    parts = NATIVE.parts(name, q)
    for key, t in parts.items():
        module.register_buffer(key, t)
    module._qmeta[name] = (q.spec, q.width, q.dtype, tuple(parts))

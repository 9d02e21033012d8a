"""W8A8 int8 with dynamic per-token inputs on CPU: the activation quantizer fused, and an int8 GEMV.

The dynamic input quantizer of an int8 ``PerChannel(0)`` spec (one scale per token of the
(tokens, features) matrix; ``w8a8-int8-dynamic``, ``quarot-w4a8``...) runs through the general
``choose_qparams`` / ``quantize`` path at about half a millisecond per call (Python, checks, a
dozen small ops): a decode step of SmolLM2-135M calls it 210 times. For exactly this case
:func:`token_quantize` computes the same codes, scales and zero points in one pass: a small C++
routine (``int8dyn_avx2.cpp``, built at first use by :mod:`.native`) or, where it cannot run, a
few torch ops. The case (:func:`fused_reason` is ``None``): ``int8`` codes, ``PerChannel(0)``,
dynamic, round half to even, ``float32`` scales (no power of two), saturating; symmetric (full or
restricted range) or asymmetric with an integer zero point. Its definitions, from
``qtransform``'s min/max observer and affine scheme (``lo``, ``hi``: the token's min and max):

* symmetric: ``scale = max(max(-lo, hi) / D, tiny)``, ``D`` 127.5 (full) or 127 (restricted),
  ``code = rne(clamp(x / scale, qmin, 127))``, ``qmin`` -128 or -127;
* asymmetric: ``lo, hi = min(lo, 0), max(hi, 0)``, ``scale = max((hi - lo) / 255, tiny)``,
  ``zero_point = clamp(-128 - rne(lo / scale), -128, 127)`` (int8),
  ``code = rne(clamp(x / scale + zero_point, -128, 127))``;

with ``tiny`` the smallest normal float32 (an all-zero token gets it) and inputs taken in float32.
A token with a non-finite value goes to the general path, which raises its ``ValueError``.
:mod:`bridge.modules.actquant` uses it for every forward path (so fake-quantizing costs a few
microseconds), and the kernel ``int8_dynamic_cpu`` (registered here, chosen by ``auto`` before
``int8pack_cpu``) runs the whole layer in the C++ routine for up to :data:`MAX_ROWS` tokens:
quantize each token, exact int32 dot products with the int8 weight codes (widened to int16,
``_mm256_madd_epi16``), ``float(acc - zero_point * rowsum) * scale * weight_scale``: the numbers of
``torch._int_mm`` on the same codes (``int8_int_mm_cpu``), which equal the fake-quantized
reference to float rounding. It reads 8 bits per weight, a quarter of fp32's bytes (decode is
bound by reading the weights). From :data:`MAX_ROWS` tokens on, or without the C++ build, it
fake-quantizes the input (fused) and runs ``F.linear`` on the weight dequantized into a reused
buffer (:mod:`.dense`), as ``int8pack_cpu`` does there. ``bench/bench_w8a8.py`` measures it.

>>> import torch, qtransform as qt
>>> spec = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0), dynamic=True, symmetric=False)
>>> x = torch.tensor([[0.0, 0.5, 1.0], [-2.0, 0.0, 2.0]])
>>> codes, scale, zp = token_quantize(x, spec)
>>> ref = qt.quantize(x, qt.choose_qparams(x, spec))
>>> torch.equal(codes, ref.codes), torch.equal(scale, ref.qparams.scale), torch.equal(zp, ref.qparams.zero_point)
(True, True, True)
"""

from __future__ import annotations

import functools

import torch

import qtransform as qt
from qtransform.formats import IntCodec

from . import dense, native
from .base import LINEAR_KERNELS, Kernel, linear_common, register_kernel, rows
from .int8mm import _weight_reason

__all__ = ["MAX_ROWS", "fused_reason", "native_reason", "token_quantize", "token_fake_quantize", "int8_dynamic_linear"]

#: Tokens below which the layer runs in the C++ GEMV; from here on fake-quantize + F.linear. Measured on SmolLM2's
#: up and down projections (1 thread, AVX2 code on an AVX-512 EPYC): the GEMV beats both F.linear paths (fp32 on the
#: float weight, and on the dequantized one) at 4 to 64 tokens; from 128 on it is compute-bound (16 int16 products
#: per instruction) and the float GEMM takes over.
MAX_ROWS = 64
#: Least multiply-adds (tokens x weights) per thread chunk of the C++ GEMV: smaller layers run on one thread.
PARALLEL_CHUNK = 1 << 16
_TINY = torch.finfo(torch.float32).tiny


@functools.lru_cache(maxsize=64)
def fused_reason(spec) -> str | None:
    """Why the dynamic activation spec ``spec`` cannot take the fused per-token path (``None``: it can)."""
    if not isinstance(spec, qt.QuantSpec) or not spec.dynamic:
        return "not a dynamic QuantSpec"
    codec = spec.fmt.codec
    if spec.format != "int8" or not isinstance(codec, IntCodec):
        return f"the codes are not int8 ({spec.format})"
    if spec.granularity != qt.PerChannel(0):
        return f"not per token (PerChannel(0)): {spec.granularity}"
    if spec.rounding != "half_even":
        return f"rounding {spec.rounding!r} (the fused path rounds half to even)"
    if spec.scale_dtype != "float32" or spec.power_of_two:
        return f"scales are not plain float32 ({spec.scale_dtype}, power_of_two={spec.power_of_two})"
    if not spec.saturate:
        return "saturate=False"
    if not spec.symmetric and spec.zero_point_domain != "int":
        return f"a {spec.zero_point_domain} zero point (the fused path has integer zero points)"
    return None


@functools.cache
def _build():
    return native.build_extension("int8dyn_avx2.cpp", "qtransform_int8dyn_avx2", env="QTRANSFORM_NO_INT8_KERNEL")


def native_reason() -> str | None:
    """Why the C++ routine cannot run here (``None``: it can); builds or loads it on the first call."""
    return _build()[1]


def _consts(spec) -> tuple[float, float]:
    """``(qmin, D)``: the lowest code and the symmetric half-width (``D`` unused when asymmetric)."""
    qlo, qhi = spec.fmt.codec.qrange(symmetric=spec.symmetric, restricted=spec.restricted)
    return qlo, (qhi - qlo) / 2


def _torch_quantize(xf: torch.Tensor, spec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The fused quantizer in torch ops (no C++ build): float32 ``(M, K)`` -> codes, scale, zero point."""
    lo, hi = torch.aminmax(xf, dim=1, keepdim=True)
    if not bool(torch.isfinite(lo).all() & torch.isfinite(hi).all()):
        return None
    qlo, half = _consts(spec)
    if spec.symmetric:
        s = (torch.maximum(-lo, hi) / half).clamp_(min=_TINY)
        return (xf / s).clamp_(qlo, 127).round_().to(torch.int8), s, None
    lo, hi = lo.clamp_(max=0), hi.clamp_(min=0)
    width = hi - lo
    s = torch.where(torch.isinf(width), hi / 255.0 - lo / 255.0, width / 255.0).clamp_(min=_TINY)
    z = (-128.0 - torch.round(lo / s)).clamp_(-128, 127)
    codes = torch.addcdiv(z, xf, s).clamp_(-128, 127).round_().to(torch.int8)
    return codes, s, z.to(torch.int8)


def token_quantize(x2: torch.Tensor, spec, *, use_native: bool | None = None):
    """Per-token int8 ``(codes, scale, zero_point)`` of the ``(tokens, features)`` matrix ``x2`` under
    ``spec`` (:func:`fused_reason` must be ``None``), equal to ``qt.quantize(x2, qt.choose_qparams(x2,
    spec))``'s codes, ``scale`` (float32 ``(M, 1)``) and ``zero_point`` (int8 ``(M, 1)``; ``None`` when
    symmetric); ``None`` when ``x2`` holds a non-finite value (the general path raises for it).
    ``use_native``: the C++ routine (default: when it builds here) or the torch ops."""
    if x2.dim() != 2:
        raise ValueError(f"token_quantize: x2 must be the 2-D (tokens, features) matrix, got shape {tuple(x2.shape)}")
    xf = x2.detach().to(torch.float32).contiguous()
    ext = _build()[0] if use_native is not False and xf.device.type == "cpu" else None
    if use_native and ext is None:
        raise ValueError(f"token_quantize: use_native=True but the C++ routine cannot run: {native_reason()}")
    if ext is None or xf.shape[0] == 0:
        return _torch_quantize(xf, spec) if xf.shape[0] else (xf.to(torch.int8), xf.new_empty(0, 1),
                                                               None if spec.symmetric else xf.new_empty(0, 1, dtype=torch.int8))
    qlo, half = _consts(spec)
    codes, s, z, ok = ext.quantize_tokens(xf, spec.symmetric, qlo, half)
    if not ok:
        return None
    return codes, s, None if spec.symmetric else z.to(torch.int8)


def token_fake_quantize(x2: torch.Tensor, spec, *, use_native: bool | None = None) -> torch.Tensor | None:
    """``dequantize(quantize(x2))`` through :func:`token_quantize` (``None`` for non-finite input), in
    ``x2.dtype``: ``(code - zero_point) * scale``, clamped to the dtype's largest finite value as the
    general path clamps it (a no-op but for data at float32's limit)."""
    q = token_quantize(x2, spec, use_native=use_native)
    if q is None:
        return None
    codes, s, z = q
    y = codes.to(torch.float32)
    if z is not None:
        y = y.sub_(z)
    limit = min(float(torch.finfo(x2.dtype).max), float(torch.finfo(torch.float32).max))
    return y.mul_(s).clamp_(-limit, limit).to(x2.dtype)


def int8_dynamic_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, rowsum: torch.Tensor,
                        spec) -> torch.Tensor | None:
    """``x @ (codes * scale[:, None]).T`` with ``x`` quantized per token by ``spec`` inside the C++ routine:
    ``(..., K) -> (..., N)`` in ``x.dtype``; ``codes`` int8 ``(N, K)``, ``scale`` float32 ``(N,)``,
    ``rowsum`` int32 ``(N,)`` (``codes.sum(1)``). ``None`` for non-finite input. Needs the C++ build."""
    ext = _build()[0]
    if ext is None:
        raise ValueError(f"int8_dynamic_linear: the C++ routine cannot run here: {native_reason()}")
    k = x.shape[-1]
    n = codes.shape[0]
    xf = rows(x, k).to(torch.float32).contiguous()
    qlo, half = _consts(spec)
    y, ok = ext.linear(xf, codes, scale, rowsum, spec.symmetric, qlo, half, PARALLEL_CHUNK)
    if not ok:
        return None
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def _check(module, forced: bool) -> str | None:
    if module.weight.device.type != "cpu":
        return "not on CPU"
    if (r := linear_common(module)) is not None:
        return r
    r = _weight_reason(module)
    if r is None and not module.qweight.spec.fmt.codec.signed:
        r = "uint8 weight codes"
    if r is None:
        spec = getattr(module, "input_spec", None)
        r = "no dynamic input quantizer" if spec is None or not spec.dynamic else fused_reason(spec)
    return r or native_reason()


def _prepare(module):
    q = module.qweight
    n, _ = q.shape
    codes = qt.unpacked_codes(q).contiguous()
    s, _ = q.qparams.effective()
    s = s.to(torch.float32).reshape(-1).expand(n).contiguous()
    return {"codes": codes, "scale": s, "rowsum": codes.sum(dim=1, dtype=torch.int32),
            "dense": {"codes": None, "dense_scale": s.reshape(n, 1), "dense_offset": torch.zeros(n, 1), "signed": True}}


def _fake_quantized(module, x):
    x2 = rows(x, x.shape[-1])
    f = None if torch.compiler.is_compiling() else token_fake_quantize(x2, module.input_spec)
    if f is None:  # compiling, or non-finite input: the general path (which raises for the latter)
        return qt.fake_quantize(x2, module.input_qparams(x)).reshape(x.shape)
    return f.reshape(x.shape)


def _run(module, st, x, **kw):
    n = st["codes"].shape[0]
    if x.numel() == 0:
        return x.new_zeros(*x.shape[:-1], n)
    if not torch.compiler.is_compiling() and x.numel() < MAX_ROWS * x.shape[-1]:
        y = int8_dynamic_linear(x, st["codes"], st["scale"], st["rowsum"], module.input_spec)
        if y is not None:
            return y
    d = st["dense"]
    return dense.dense_linear(_fake_quantized(module, x), st["codes"], d["dense_scale"], d["dense_offset"], signed=True)


register_kernel(LINEAR_KERNELS, Kernel("int8_dynamic_cpu", _check, _prepare, _run, quantizes_input=True))

"""CPU W8A8 int8: a real integer matmul, ``torch._int_mm`` (int8 x int8 -> int32), for QLinear with
8-bit integer weight codes (symmetric, per-channel or per-tensor scales) and an 8-bit integer input
quantizer (dynamic per-token or per-tensor, or static per-tensor; symmetric, or asymmetric with an
integer zero point).

With activation codes ``a`` (tokens M, K), their zero point ``za`` (per token or per tensor) and
scale ``sa``, weight codes ``b`` (N, K) and scale ``sb`` (per channel or per tensor)::

    y[m, n] = sa[m] * sb[n] * (sum_k a[m, k] * b[n, k] - za[m] * sum_k b[n, k])

Everything inside the parentheses is computed in int32 and is exact (``in_features`` at most
65535 keeps every term below 2^31), so the output equals the fake-quantized reference
``F.linear(dequantize(quantize(x)), dequantize(W))`` to float rounding (the reference rounds the
dequantized activations and weights and its float sums; here only the final int32 -> float
conversion and the two rescaling products round).

On a CPU without int8 dot-product instructions (AVX2 without VNNI) ``torch._int_mm`` is slower
than the weight-only ``int8pack_cpu`` at every size and than the dequant reference beyond a few
tokens (``bench/bench_w8a8.py``; see :mod:`bridge.kernels.base`), so ``auto`` never chooses this kernel: ``kernel="int8_int_mm_cpu"`` selects it (anywhere on CPU). CPUs
with AMX-int8 or AVX512-/AVX-VNNI (:func:`int8_dot_cpu`), where oneDNN has an int8 GEMM, may well
make it pay; it has not been measured on one, so it stays opt-in until ``bench/bench_w8a8.py``
shows it there.
``torch._int_mm`` on CPU takes any M, K, N (no multiple-of-8 or M > 16 rule as on CUDA).

On CUDA (``int8_int_mm_cuda``, compute capability >= 8.0) the same math runs through cuBLASLt's int8
GEMM, and ``auto`` chooses it for W8A8 int8 modules. ``aten/src/ATen/native/cuda/Blas.cpp``'s
``_int_mm_out_cuda`` asks for ``M > 16`` rows, ``K`` and ``N`` multiples of 8 (``K``/``N``: refused by
reason at the choice; ``M``: fewer token rows are padded with zero codes up to :data:`CUDA_PAD_ROWS`
and the padding is cut off the int32 result), and takes the weight as ``codes.t()``, a column-major
view of the contiguous ``(N, K)`` codes (no copy).
"""

from __future__ import annotations

import functools

import torch

import qtransform as qt
from qtransform.formats import IntCodec

from .base import LINEAR_KERNELS, Kernel, grid, int_codec, linear_common, register_kernel, rows

__all__ = ["MAX_IN_FEATURES", "INT8_DOT_FEATURES", "CUDA_MIN_ROWS", "CUDA_PAD_ROWS", "CUDA_MIN_CAPABILITY",
           "int8_dot_cpu", "int8_int_mm_linear"]

#: Largest ``in_features``: every int32 term of the accumulation stays below 2^31 (|term| <= 2^15 K).
MAX_IN_FEATURES = 2 ** 16 - 1
#: CPU capabilities (``torch.cpu.get_capabilities()``) that give oneDNN an int8 dot-product GEMM.
INT8_DOT_FEATURES = ("amx_int8", "avx512_vnni", "avx_vnni")
_TOKEN_GRIDS = (qt.PerTensor(), qt.PerChannel(0))
#: ``torch._int_mm`` on CUDA needs more than 16 rows ...
CUDA_MIN_ROWS = 17
#: ... so fewer token rows are padded with zero codes up to this many (a multiple of 8 and of 16).
CUDA_PAD_ROWS = 32
#: int8 tensor-core GEMMs through cuBLASLt: Ampere and newer (the only GPUs this path was written for).
CUDA_MIN_CAPABILITY = (8, 0)


@functools.lru_cache(maxsize=1)
def int8_dot_cpu() -> bool:
    """Whether this CPU has int8 dot-product instructions (see :data:`INT8_DOT_FEATURES`).

    >>> isinstance(int8_dot_cpu(), bool)
    True
    """
    get = getattr(torch.cpu, "get_capabilities", None)
    caps = get() if get is not None else {}
    return any(bool(caps.get(f, False)) for f in INT8_DOT_FEATURES)


def _shift(codec) -> int:
    """What maps the codes onto int8: 0 for int8, 128 for uint8."""
    return 0 if codec.signed else 128


def _weight_reason(module) -> str | None:
    codec = int_codec(module)
    if codec is None or codec.bits != 8:
        return f"weight codes are not 8-bit integers ({module.spec.format})"
    n, k = module.qweight.shape
    if k > MAX_IN_FEATURES:
        return f"in_features {k} exceeds {MAX_IN_FEATURES} (int32 accumulation could overflow)"
    if grid(module) not in ((n, 1), (1, 1)):
        return "weight scales are not per-channel (axis 0) or per-tensor"
    if module.spec.zero_point_domain == "offset":
        return "asymmetric weights (an offset zero point)"
    _, z = module.qweight.qparams.effective()
    if z is not None:
        if z.device.type == "meta":
            return "weight zero points not loaded yet"
        if not bool((z == _shift(codec)).all()):
            return "asymmetric weights (zero points other than the symmetric one)"
    return None


def _input_reason(module) -> str | None:
    spec = getattr(module, "input_spec", None)
    if spec is None:
        return "no input quantizer (int8 _int_mm is W8A8)"
    codec = spec.fmt.codec
    if not isinstance(codec, IntCodec) or codec.bits != 8:
        return f"the input quantizer's codes are not 8-bit integers ({spec.format})"
    if spec.granularity not in _TOKEN_GRIDS:
        return f"the input quantizer is not per-tensor or per-token (PerChannel(0)): {spec.granularity}"
    if spec.rounding == "stochastic":
        return "the input quantizer rounds stochastically"
    if not spec.symmetric and spec.zero_point_domain != "int":
        return f"the input quantizer has a {spec.zero_point_domain} zero point"
    z = None if spec.dynamic else module._buffers.get("input_zero_point")
    if z is None:
        return None
    if z.device.type == "meta":
        return "input zero points not loaded yet"
    z = z.to(torch.float32)
    if spec.symmetric:
        ok = z == _shift(codec)
    else:
        ok = (z == z.round()) & (z >= codec.qmin) & (z <= codec.qmax)
    return None if bool(ok.all()) else "the input zero point is not an integer inside the code range"


def _common(module) -> str | None:
    if (r := linear_common(module)) is not None:
        return r
    if not hasattr(torch, "_int_mm"):
        return "this torch has no _int_mm"
    return _weight_reason(module) or _input_reason(module)


def _check(module, forced: bool) -> str | None:
    if module.weight.device.type != "cpu":
        return "not on CPU"
    if (r := _common(module)) is not None:
        return r
    if not forced:  # opt-in until measured faster somewhere (see the module docstring)
        return ("chosen only when forced (kernel='int8_int_mm_cpu'): _int_mm measured slower than int8pack_cpu "
                "(bench/bench_w8a8.py)" + ("" if int8_dot_cpu() else "; this CPU has no VNNI/AMX int8 dot products"))
    return None


def _check_cuda(module, forced: bool) -> str | None:
    dev = module.weight.device
    if dev.type != "cuda":
        return "not on CUDA"
    if (r := _common(module)) is not None:
        return r
    if torch.cuda.get_device_capability(dev) < CUDA_MIN_CAPABILITY:
        c = CUDA_MIN_CAPABILITY
        return f"needs compute capability >= {c[0]}.{c[1]}"
    n, k = module.qweight.shape
    if k % 8 or n % 8:
        return f"in_features {k} and out_features {n} must be multiples of 8 (torch._int_mm on CUDA)"
    return None


def _prepare(module):
    q = module.qweight
    n, _ = q.shape
    codes = (qt.unpacked_codes(q).to(torch.int16) - _shift(int_codec(module))).to(torch.int8).contiguous()
    s, _ = q.qparams.effective()
    return {"codes": codes, "rowsum": codes.sum(dim=1, dtype=torch.int32),
            "scale": s.to(torch.float32).reshape(1, -1).expand(1, n).contiguous()}


def int8_int_mm_linear(a: torch.Tensor, a_scale: torch.Tensor, a_zero_point: torch.Tensor | None,
                       b: torch.Tensor, b_scale: torch.Tensor, *, b_rowsum: torch.Tensor | None = None,
                       out_dtype: torch.dtype = torch.float32, min_rows: int = 0) -> torch.Tensor:
    """``((a - a_zero_point) * a_scale) @ (b * b_scale).T`` with an int32 accumulation (``torch._int_mm``).

    Args:
        a: int8 activation codes (M, K).
        a_scale: float scale of shape (M, 1) (per token) or (1, 1) / () (per tensor).
        a_zero_point: ``None`` or integer-valued zero point of ``a_scale``'s shape, in the int8 code domain.
        b: int8 weight codes (N, K).
        b_scale: float scale of shape (N, 1) / (1, N) (per channel) or (1, 1) / () (per tensor).
        b_rowsum: ``b.sum(1)`` in int32 (N,), when precomputed (used only with a zero point).
        out_dtype: the floating dtype of the result.
        min_rows: fewer rows of ``a`` are padded with zero codes up to ``max(min_rows, 32)`` for
            ``torch._int_mm`` (CUDA: :data:`CUDA_MIN_ROWS`), the padding dropped from its result.

    Returns:
        (M, N) in ``out_dtype``.

    >>> a = torch.tensor([[1, -2], [3, 4]], dtype=torch.int8)
    >>> b = torch.tensor([[2, 1]], dtype=torch.int8)
    >>> int8_int_mm_linear(a, torch.tensor([[1.0], [0.5]]), None, b, torch.tensor([[0.25]]))
    tensor([[0.0000],
            [1.2500]])
    >>> int8_int_mm_linear(a, torch.tensor(1.0), torch.tensor(1.0), b, torch.tensor(1.0))  # (a - 1) @ b.T
    tensor([[-3.],
            [ 7.]])
    >>> int8_int_mm_linear(a, torch.tensor(1.0), torch.tensor(1.0), b, torch.tensor(1.0), min_rows=17)
    tensor([[-3.],
            [ 7.]])
    """
    m = a.shape[0]
    a = a.contiguous()
    if m < min_rows:
        a = torch.cat([a, a.new_zeros(max(min_rows, CUDA_PAD_ROWS) - m, a.shape[1])])
    acc = torch._int_mm(a, b.t())[:m]
    if a_zero_point is not None:
        rs = b.sum(dim=1, dtype=torch.int32) if b_rowsum is None else b_rowsum
        acc = acc - a_zero_point.reshape(-1, 1).to(torch.int32) * rs.reshape(1, -1)
    y = acc.to(torch.float32).mul_(a_scale.to(torch.float32).reshape(-1, 1))
    y = y.mul_(b_scale.to(torch.float32).reshape(1, -1))
    return y.to(out_dtype)


def _run(module, st, x, **kw):
    k = x.shape[-1]
    n = st["codes"].shape[0]
    x2 = rows(x, k)  # the (tokens, features) matrix: the view the input quantizer's spec describes
    if x2.shape[0] == 0:
        return x.new_zeros(*x.shape[:-1], n)
    qp = module.input_qparams(x)  # the same scales as the dequant path's (actquant.activation_view)
    codes = qt.quantize(x2, qp).codes
    sa, za = qp.effective()
    shift = _shift(qp.spec.fmt.codec)
    if shift:
        codes = (codes.to(torch.int16) - shift).to(torch.int8)
    # symmetric: the zero point is none (int8) or the shift itself (uint8); else an integer by the spec
    za = None if (za is None or qp.spec.symmetric) else za - shift
    y = int8_int_mm_linear(codes, sa, za, st["codes"], st["scale"], b_rowsum=st["rowsum"], out_dtype=x.dtype,
                           min_rows=CUDA_MIN_ROWS if x.device.type == "cuda" else 0)
    return y.reshape(*x.shape[:-1], n)


# the CUDA kernel first (the fastest on its device), then the CPU one (opt-in): their checks never both pass
register_kernel(LINEAR_KERNELS, Kernel("int8_int_mm_cuda", _check_cuda, _prepare, _run, quantizes_input=True))
register_kernel(LINEAR_KERNELS, Kernel("int8_int_mm_cpu", _check, _prepare, _run, quantizes_input=True))

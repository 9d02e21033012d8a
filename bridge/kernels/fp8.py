"""GPU W8A8 fp8: ``torch._scaled_mm`` for float8_e4m3fn weights with per-tensor/per-channel scales and a
symmetric float8_e4m3fn input quantizer (per tensor or per token; compute capability >= 8.9).

``_scaled_mm``'s rules (``aten/src/ATen/native/cuda/Blas.cpp`` / ``ScaledBlas.cpp``), and how they are met:

- ``a`` row-major ``(M, K)`` (the quantized tokens, made contiguous), ``b`` column-major ``(K, N)``:
  ``w_codes.t()`` of the contiguous ``(N, K)`` codes is exactly that (no copy);
- ``K`` and ``N`` multiples of 16 (checked at the choice; ``M`` is free);
- scales float32: per tensor, one element each (then any ``out_dtype``); row-wise, ``scale_a``
  ``(M, 1)`` and ``scale_b`` ``(1, N)``, contiguous, and a bf16 output (the CUTLASS row-wise kernel
  takes no other; cast to the input's dtype after). One per-tensor and one per-row scale are both
  made row-wise (the per-tensor one expanded). Some builds take per-tensor scales only on some devices
  (torch 2.11 on CPU): :func:`rowwise_scales` asks the device once, and the check refuses by reason.

The output matches the fake-quantized reference ``F.linear(fake_quantize(x), dequantize(W))``: the
products of fp8 codes are exact in the fp32 accumulation, so only the accumulation order, the
scaling and the output rounding (bf16 for row-wise scales) differ."""

from __future__ import annotations

import functools

import torch

import qtransform as qt

from .base import LINEAR_KERNELS, Kernel, grid, linear_common, register_kernel, rows

__all__ = ["fp8_linear", "rowwise_scales"]


@functools.lru_cache(maxsize=64)
def _decode_is_cast(spec: qt.QuantSpec) -> bool:
    """The codec's decode of float8_e4m3fn codes is the plain cast (so _scaled_mm may consume them)."""
    codec = spec.fmt.codec
    if codec.code_dtype != torch.float8_e4m3fn:
        return False
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn)
    plain = codes.to(torch.float32)
    ok = torch.isfinite(plain)
    return bool(torch.equal(codec.decode(codes)[ok], plain[ok]))


@functools.lru_cache(maxsize=16)
def rowwise_scales(device: torch.device) -> bool:
    """Whether this torch's ``_scaled_mm`` takes row-wise scales on ``device`` (a 16x16 probe, once per
    device; torch 2.11's CPU ``_scaled_mm`` takes per-tensor scales only).

    >>> isinstance(rowwise_scales(torch.device("cpu")), bool)
    True
    """
    a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
    s = torch.ones(16, 1, device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=s, scale_b=s.reshape(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _fp8_check(module, forced: bool) -> str | None:
    if (r := linear_common(module)) is not None:
        return r
    if not hasattr(torch, "_scaled_mm"):
        return "this torch has no _scaled_mm"
    dev = module.weight.device
    if not forced:
        if dev.type != "cuda" or torch.cuda.get_device_capability(dev) < (8, 9):
            return "needs a CUDA device with compute capability >= 8.9"
    q = module.qweight
    if not _decode_is_cast(q.spec) or q.qparams.zero_point is not None or q.qparams.global_scale is not None:
        return f"weights are not plain float8_e4m3fn codes with float scales ({q.spec.format})"
    n, k = q.shape
    if n % 16 or k % 16:
        return "in/out features are not multiples of 16"
    if grid(module) not in ((n, 1), (1, 1)):
        return "weight scales are not per-tensor or per-channel"
    spec = getattr(module, "input_spec", None)
    if spec is None or not _decode_is_cast(spec) or spec.granularity not in (qt.PerTensor(), qt.PerChannel(0)):
        return "no float8_e4m3fn per-tensor/per-token input quantizer (fp8 _scaled_mm is W8A8)"
    if not spec.symmetric or spec.rounding == "stochastic":
        return "the input quantizer is asymmetric or rounds stochastically"
    if (grid(module) == (n, 1) or spec.granularity == qt.PerChannel(0)) and not rowwise_scales(dev):
        return (f"this torch's _scaled_mm takes per-tensor scales only on {dev.type}, and the weight "
                "(per channel) or input (per token) scales are row-wise")
    return None


def _fp8_prepare(module):
    q = module.qweight
    n = q.shape[0]
    sw, _ = q.qparams.effective()
    sw = sw.to(torch.float32)
    return {"w_scale": sw.reshape(()) if sw.numel() == 1 else sw.reshape(1, n).contiguous()}


def fp8_linear(x_codes, x_scale, w_codes, w_scale, *, out_dtype: torch.dtype) -> torch.Tensor:
    """``(x_codes * x_scale) @ (w_codes * w_scale).T`` via ``torch._scaled_mm``.

    ``x_codes`` (M, K) and ``w_codes`` (N, K) float8_e4m3fn; scales float32 of shape () / (1, 1)
    (per tensor) or (M, 1) / (N, 1) (per row). Returns (M, N) in ``out_dtype``.
    """
    m, n = x_codes.shape[0], w_codes.shape[0]
    x_codes = x_codes.contiguous()
    sa, sb = x_scale.to(torch.float32), w_scale.to(torch.float32)
    if sa.numel() == 1 and sb.numel() == 1:
        return torch._scaled_mm(x_codes, w_codes.t(), scale_a=sa.reshape(()), scale_b=sb.reshape(()),
                                out_dtype=out_dtype)
    sa = sa.reshape(-1, 1).expand(m, 1).contiguous()
    sb = sb.reshape(1, -1).expand(1, n).contiguous()
    y = torch._scaled_mm(x_codes, w_codes.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    return y.to(out_dtype)


def _fp8_run(module, st, x, **kw):
    k = x.shape[-1]
    x2 = rows(x, k)  # the (tokens, features) matrix: the view the input quantizer's spec describes
    qp = module.input_qparams(x)  # the same scales as the dequant path's (actquant.activation_view)
    qx = qt.quantize(x2, qp)
    sx, _ = qp.effective()
    w = module.qweight.codes  # (N, K) contiguous: .t() is the column-major b operand
    y = fp8_linear(qx.codes, sx, w, st["w_scale"], out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])


register_kernel(LINEAR_KERNELS, Kernel("fp8_scaled_mm", _fp8_check, _fp8_prepare, _fp8_run, quantizes_input=True))

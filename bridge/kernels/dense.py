"""Many tokens at once: dequantize the weight into a reused buffer, then one float GEMM.

The packed CPU kernels (:mod:`.cpu`) win while few tokens share a weight (decode): they read
4 or 8 bits per weight instead of 32. With many tokens the GEMM dominates, and the packed
kernels compute it slower than the float ``F.linear`` of the same shape (bf16 with AVX2, no
AVX-512: ~3x slower at 512 tokens). Above :data:`PREFILL_ROWS` rows the int4/int8 kernels
therefore dequantize the weight in the input's dtype (4-bit codes to float32: one AVX2 pass of
``dense_avx2.cpp``, built at first use by :mod:`.native`; otherwise plain tensor ops), into a buffer
kept per thread and reused by every layer (allocating a fresh weight-sized tensor costs more
than filling it: page faults), and call ``F.linear``: the prefill of a quantized model runs
at the float model's GEMM speed plus one dequantization per layer per call.

The threshold is a row count, not a shape: the packed kernel costs ``a * rows * n * k`` and
this path ``b * n * k + c * rows * n * k``, so the crossover ``b / (a - c)`` rows is the same for
every shape to first order. ``bench/bench_prefill.py`` measures it (``docs/performance.md``); set
``PREFILL_ROWS[name]`` to change it (``None`` disables this path for that kernel).

>>> import torch, qtransform as qt
>>> w = torch.randn(64, 256)
>>> q = qt.quantize(w, qt.choose_qparams(w, qt.QuantSpec(format="uint4", granularity=qt.PerGroup(64),
...                                                         symmetric=False)))
>>> s, off = affine_params(q)
>>> w_ = dequantize_int(q.codes, s, off, 256, torch.float32, signed=False)
>>> bool(torch.allclose(w_, qt.dequantize(q), atol=1e-6))
True
"""

from __future__ import annotations

import threading

import torch

import qtransform as qt

from . import native

__all__ = ["PREFILL_ROWS", "affine_params", "dequantize_int", "dense_linear", "prefill_linear", "release_buffers"]

#: ``kernel name -> rows`` at and above which the kernel dequantizes and runs ``F.linear``. ``int4pack_cuda``: 256,
#: measured on an H200 (``bench/gpu_crossover.py``, Llama-3-8B's linears, one layer: tinygemm 2.0 ms against
#: 2.8 ms at 128 rows, 3.9 against 2.6 at 256, 30.3 against 3.4 at 2048; bench/results/gpu_crossover.md).
PREFILL_ROWS: dict[str, int | None] = {"int4pack_cpu": 32, "int8pack_cpu": 32, "int4pack_cuda": 256}

_local = threading.local()


def _buffer(role: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A per-thread buffer of ``shape`` (grown, never shrunk; :func:`release_buffers` frees them)."""
    bufs = _local.__dict__.setdefault("bufs", {})
    numel = 1
    for d in shape:
        numel *= d
    b = bufs.get((role, dtype, device))
    if b is None or b.numel() < numel:
        b = bufs[(role, dtype, device)] = torch.empty(numel, dtype=dtype, device=device)
    return b[:numel].view(shape)


def release_buffers() -> None:
    """Free this thread's dequantization buffers (the largest layer's weight in the compute dtype)."""
    _local.__dict__.pop("bufs", None)


def affine_params(q: qt.QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, offset)``, each ``(rows, groups)`` float32, with ``value = code * scale + offset``
    (``offset = -zero_point * scale``; the zero point itself for ``zero_point_domain="offset"``) for an
    integer-coded ``q``."""
    s, z = q.qparams.effective()
    n = q.shape[0]
    s = s.to(torch.float32).expand(n, -1)
    if z is None:
        return s.contiguous(), torch.zeros_like(s)
    z = z.to(torch.float32).expand(n, -1)
    return s.contiguous(), (z if q.spec.zero_point_domain == "offset" else -z * s).contiguous()


def dequantize_int(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, k: int,
                   dtype: torch.dtype, *, signed: bool) -> torch.Tensor:
    """The ``(n, k)`` weight ``code * scale + offset`` from integer codes: 4-bit codes packed two per
    byte (low nibble first, ``codes`` ``(n, k / 2)`` uint8; two's complement when ``signed``) or
    unpacked codes (``(n, k)`` int8/uint8), and ``(n, groups)`` ``scale``/``offset`` from
    :func:`affine_params` (``groups`` divides ``k``).

    Eager calls write into this thread's reused buffers (the result is valid until the next
    call); under ``torch.compile`` plain tensor ops that the compiler fuses."""
    n, groups = scale.shape
    four = codes.shape[-1] * 2 == k
    s, off = scale.to(dtype)[..., None], offset.to(dtype)[..., None]
    if torch.compiler.is_compiling():  # plain ops: the compiler fuses them into one pass
        if not four:
            return (codes.view(n, groups, k // groups).to(dtype) * s + off).view(n, k)
        bits = codes ^ 0x88 if signed else codes  # signed: the stored nibble with its sign bit flipped is code + 8
        bits = torch.stack([bits & 15, bits >> 4], dim=-1).reshape(n, k)
        return (bits.view(n, groups, k // groups).to(dtype) * s + (off - 8 * s if signed else off)).view(n, k)
    dev = codes.device
    w = _buffer("weight", (n, k), dtype, dev)
    if four and dtype == torch.float32 and dev.type == "cpu" and (k // groups) % 2 == 0:
        ext, _ = native.build_extension("dense_avx2.cpp", "qtransform_dense_avx2")
        if ext is not None:  # one AVX2 pass (5x the plain ops below)
            ext.dequant_int4(codes.contiguous(), scale.to(torch.float32).contiguous(),
                             offset.to(torch.float32).contiguous(), bool(signed), w)
            return w
    if four:
        bits = codes
        if signed:  # the stored nibble with its sign bit flipped is code + 8
            bits = torch.bitwise_xor(bits, 0x88, out=_buffer("flipped", (n, k // 2), torch.uint8, dev))
            off = off - 8 * s
        lo, hi = _buffer("low", (n, k // 2), torch.uint8, dev), _buffer("high", (n, k // 2), torch.uint8, dev)
        torch.bitwise_and(bits, 15, out=lo)
        torch.bitwise_right_shift(bits, 4, out=hi)
        pairs = w.view(n, k // 2, 2)
        pairs[..., 0].copy_(lo)
        pairs[..., 1].copy_(hi)
    else:
        w.copy_(codes)
    return w.view(n, groups, k // groups).mul_(s).add_(off).view(n, k)


def dense_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, *,
                 signed: bool) -> torch.Tensor:
    """``F.linear(x, W)`` with ``W = dequantize_int(codes, scale, offset, x.shape[-1], x.dtype, signed=...)``."""
    w = dequantize_int(codes, scale, offset, x.shape[-1], x.dtype, signed=signed)
    return torch.nn.functional.linear(x, w)


def prefill_linear(module, name: str, st: dict, x: torch.Tensor) -> torch.Tensor | None:
    """The dequantize + ``F.linear`` path when ``x`` has at least ``PREFILL_ROWS[name]`` rows, else ``None``.

    ``st``: ``"codes"`` (4-bit codes packed two per byte, or ``None``: unpacked from ``module.qweight``),
    ``"dense_scale"``/``"dense_offset"`` per kernel group (:func:`affine_params`) and ``"signed"``."""
    limit = PREFILL_ROWS.get(name)
    if limit is None or x.numel() < limit * x.shape[-1]:
        return None
    codes = st["codes"] if st["codes"] is not None else qt.unpacked_codes(module.qweight)
    return dense_linear(x, codes, st["dense_scale"], st["dense_offset"], signed=st["signed"])

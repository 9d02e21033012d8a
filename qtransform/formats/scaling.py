"""Scaling schemes: per-block ranges -> stored scale tensors, and back to effective values.

Every :class:`~qtransform.formats.Format` carries its scheme object (``Format.scheme``):
:data:`AFFINE` for most formats (float, power-of-two and two-level fp8 scales), :data:`UNIT`
for the plain casts, and the shared-exponent schemes of MX4/6/9 and BFP16
(:mod:`qtransform.formats.shared_exp`). A scheme never imports the spec: the spec and the
quantization parameters are handed to it and read by attribute, so formats sit below
``qtransform.spec`` in the import order.

``scheme.from_range(lo, hi, spec)`` returns the quantization parameters as a dict of
``QParams`` fields (``scale``, ``zero_point``, ``global_scale``, ``micro_exponent``);
``scheme.effective(qparams)`` the float32 ``(scale, zero_point)`` that quantize and
dequantize broadcast over blocks (the zero point in the spec's domain: for ``"offset"`` the
value of code 0, added after scaling).

Conventions of the affine scheme (REFERENCE.md):

* symmetric: ``scale = amax / D`` with ``D = (hi_c - lo_c) / 2`` the half-width of the
  element range (int4 full 7.5, restricted 7; fp8_e4m3 448; NF4 1);
* asymmetric, integer zero point: ``scale = (max⁺ - min⁻) / (qmax - qmin)``,
  ``zero_point = clamp(qmin - round(min⁻ / scale))`` with ``min⁻ = min(min, 0)``;
* asymmetric, float zero point: ``scale = (max - min) / (qmax - qmin)``,
  ``zero_point = qmin - min / scale`` (not rounded, range need not contain 0);
* asymmetric, offset: ``zero_point = min - qmin * scale`` rounded down to the scale dtype (the value
  of code 0: ``min`` for unsigned codes), ``scale = (max - zero_point) / qmax`` rounded up; the
  values are ``code * scale + zero_point`` (GGUF Q4_1), not ``(code - zero_point) * scale``;
* power of two (``scale_rule``): ``floor`` = ``2^(floor(log2 A) - emax)`` (OCP MX),
  ``even`` = the same after rounding ``A`` to the element's mantissa width (Quark),
  ``ceil`` = the smallest power of two ``>= amax / D`` (never clips), with ``A`` the amax;
* a zero range maps to the smallest scale (never 0 or NaN); other scales are rounded
  *up* to the scale dtype, so that storing them never clips.
"""

from __future__ import annotations

import abc
import math
import types
from typing import Mapping

import torch

from .._checks import under_transform, where

__all__ = ["Scheme", "AffineScheme", "UnitScheme", "AFFINE", "UNIT", "SCALE_DTYPES", "decode_scale",
           "pow2_exponent", "round_up_to", "round_down_to", "FP8_E4M3_MAX", "E8M0_BIAS", "check_e8m0", "to_e8m0"]

#: name -> (storage dtype, bits). "e8m0" is a power of two stored as a biased uint8 exponent.
SCALE_DTYPES: Mapping[str, tuple[torch.dtype, int]] = types.MappingProxyType({
    "float32": (torch.float32, 32),
    "float16": (torch.float16, 16),
    "bfloat16": (torch.bfloat16, 16),
    "e8m0": (torch.uint8, 8),
    "float8_e4m3fn": (torch.float8_e4m3fn, 8),
})

FP8_E4M3_MAX = 448.0
FP8_E4M3_TINY = 2.0 ** -6
E8M0_BIAS = 127


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """Exact ``floor(log2(a))`` for positive finite ``a`` (int32); 128 for ``+inf`` (a width or a
    rounded amax beyond the largest float32, which is below ``2^129``)."""
    e = torch.frexp(a)[1] - 1
    return torch.where(torch.isinf(a), torch.full_like(e, 128), e)


def _ceil_log2(a: torch.Tensor) -> torch.Tensor:
    m, e = torch.frexp(a)
    return e - (m == 0.5).to(e.dtype)


def _round_mantissa(a: torch.Tensor, mbits: int) -> torch.Tensor:
    """Round positive fp32 ``a`` to ``mbits`` mantissa bits (half up on the bit pattern)."""
    if mbits >= 23:
        return a
    drop = 23 - mbits
    bits = a.contiguous().view(torch.int32)
    bits = (bits + (1 << (drop - 1))) & ~((1 << drop) - 1)
    return bits.view(torch.float32)


def pow2_exponent(amax: torch.Tensor, ideal: torch.Tensor, spec, *, path: str | None = None) -> torch.Tensor:
    """Exponent ``k`` (int32) of the power-of-two scale ``2^k`` under ``spec.scale_rule``.

    ``amax`` is the magnitude the element range must hold (``+inf`` when it exceeds float32), ``ideal``
    the exact float scale ``amax / D``. A zero ``amax`` gives the smallest exponent; an exponent above
    127 (data at float32's limit that the rule cannot hold without clipping) raises ``ValueError``.
    """
    codec = spec.fmt.codec
    rule = spec.scale_rule
    if rule == "ceil":
        k = _ceil_log2(ideal)
    elif rule == "floor":
        k = _floor_log2(amax) - codec.emax
    elif rule == "even":
        amax = _round_mantissa(amax, codec.mbits)  # a tiny subnormal amax may round to 0
        k = _floor_log2(amax) - codec.emax
    else:  # validated by QuantSpec
        raise ValueError(f"unknown scale_rule {rule!r}")
    lo = -127 if spec.scale_dtype == "e8m0" else -126
    k = torch.where(amax > 0, k, torch.full_like(k, lo))
    if not under_transform(k) and bool((k > 127).any()):
        first = tuple(int(i) for i in (k > 127).nonzero()[0])
        raise ValueError(f"{where(path)}the block at grid index {first} needs the power-of-two scale "
                         f"2^{int(k[first])} (scale_rule={rule!r}, ideal scale {float(ideal[first]):.4g}), beyond the "
                         f"largest power of two {spec.scale_dtype} holds (2^127): format {spec.format} cannot hold "
                         "data this close to float32's limit without clipping")
    return k.clamp(lo, 127)


def round_up_to(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast positive ``s`` to ``dtype`` rounding toward +inf (so a stored scale never clips)."""
    if dtype == torch.float32:
        return s
    low = s.to(dtype)
    if low.element_size() == 2:  # float16/bfloat16: nextafter (torch 2.11's vmap has no rule for a bit view)
        up = torch.nextafter(low, torch.full_like(low, float("inf")))
    else:  # 1-byte floats, which nextafter does not take: the next code above a positive one
        up = (low.view(torch.uint8) + 1).view(dtype)
    return torch.where(low.to(torch.float32) < s, up, low)


def round_down_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast finite ``x`` (any sign) to ``dtype`` rounding toward -inf (an offset stored this way
    never lies above the value it stands for)."""
    if dtype == torch.float32:
        return x
    low = x.to(dtype)
    down = torch.nextafter(low, torch.full_like(low, float("-inf")))
    return torch.where(low.to(torch.float32) > x, down, low)


def check_e8m0(scale, spec, *, name: str = "qparams.scale") -> None:
    """Stored E8M0 scales must be uint8 biased exponents, without the NaN code 255."""
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.uint8:
        got = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(f"format {spec.format}: {name} holds E8M0 scales as uint8 biased exponents "
                        f"(2^(code - 127)), got {got}; convert power-of-two float scales with to_e8m0")
    if not under_transform(scale) and bool((scale == 255).any()):
        first = tuple(int(i) for i in (scale == 255).nonzero()[0])
        raise ValueError(f"format {spec.format}: {name} holds the E8M0 NaN code 255 (first at index {first})")


def to_e8m0(scale: torch.Tensor, *, name: str = "scale") -> torch.Tensor:
    """Power-of-two float scales in ``[2^-127, 2^127]`` -> E8M0 codes (uint8 ``log2(scale) + 127``).

    Raises ``ValueError`` naming the first scale that is not a power of two or lies outside
    E8M0's range (zero, negative, non-finite included).

    >>> import torch
    >>> from qtransform.formats import to_e8m0
    >>> to_e8m0(torch.tensor([1.0, 0.25, 2.0 ** 127])).tolist()
    [127, 125, 254]
    """
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point():
        raise TypeError(f"to_e8m0: {name} must be a floating-point tensor, got "
                        f"{scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__}")
    s = scale.detach().to(torch.float64)
    mant, exp = torch.frexp(s)
    k = exp - 1
    bad = ~torch.isfinite(s) | (mant != 0.5) | (k < -E8M0_BIAS) | (k > E8M0_BIAS)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0]) if s.dim() else ()
        raise ValueError(f"to_e8m0: {name} value {s[first].item()!r} at index {first} is not a power of two "
                         "in E8M0's range [2^-127, 2^127]")
    return (k + E8M0_BIAS).to(torch.uint8)


def decode_scale(scale: torch.Tensor, spec, global_scale=None) -> torch.Tensor:
    """Stored scale -> float32 (e8m0 exponents, two-level fp8, or a plain float cast)."""
    if spec.scale_dtype == "e8m0":
        return torch.exp2(scale.to(torch.float32) - E8M0_BIAS)
    s = scale.to(torch.float32)
    return s * global_scale if global_scale is not None else s


def _store_scale(s: torch.Tensor, amax: torch.Tensor, ideal: torch.Tensor, spec,
                 path: str | None):
    """Float32 ideal scale -> (stored scale, float32 value of the stored scale)."""
    if spec.power_of_two:
        k = pow2_exponent(amax, ideal, spec, path=path)
        value = torch.exp2(k.to(torch.float32))
        if spec.scale_dtype == "e8m0":
            return (k + E8M0_BIAS).to(torch.uint8), value
        return value.to(SCALE_DTYPES[spec.scale_dtype][0]), value
    dtype = SCALE_DTYPES[spec.scale_dtype][0]
    finfo = torch.finfo(dtype)
    s = s.clamp(min=finfo.tiny)
    if not under_transform(s) and bool((s > finfo.max).any()):  # finite float32 scales fit: not float32
        raise ValueError(f"{where(path)}a scale of {float(s.max()):.4g} overflows scale_dtype="
                         f"{spec.scale_dtype!r} (max {finfo.max:.4g}); use scale_dtype='float32'")
    stored = round_up_to(s, dtype)
    return stored, stored.to(torch.float32)


def _check_finite_scale(ideal: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, span: float, spec, path) -> None:
    """A block whose range ``[lo, hi]`` is wider than float32 can scale (``(hi - lo) / steps`` beyond
    the largest float32) has no scale: say so instead of storing Inf."""
    if under_transform(ideal) or bool(torch.isfinite(ideal).all()):
        return
    first = tuple(int(i) for i in (~torch.isfinite(ideal)).nonzero()[0])
    raise ValueError(f"{where(path)}the block at grid index {first} spans [{float(lo[first]):.4g}, "
                     f"{float(hi[first]):.4g}]: its scale (max - min) / {span:g} "
                     f"exceeds the largest float32 ({torch.finfo(torch.float32).max:.4g}), so format {spec.format} "
                     "cannot hold it; use a format with more levels")


class Scheme(abc.ABC):
    """How a format's scales are made from per-block ranges and read back."""

    @abc.abstractmethod
    def from_range(self, lo: torch.Tensor, hi: torch.Tensor, spec, *, path: str | None = None) -> dict:
        """Grid-shaped float32 ranges ``[lo, hi]`` -> ``{QParams field: tensor}``."""

    @abc.abstractmethod
    def effective(self, qparams) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Float32 ``(scale, zero_point)`` per block (zero point ``None`` when absent)."""


class AffineScheme(Scheme):
    """Float, power-of-two, E8M0 and two-level fp8 scales with an optional zero point."""

    def from_range(self, lo, hi, spec, *, path=None) -> dict:
        codec = spec.fmt.codec
        qlo, qhi = codec.qrange(symmetric=spec.symmetric, restricted=spec.restricted)
        if spec.scale_dtype == "float8_e4m3fn":
            return _two_level_from_range(lo, hi, qhi)
        if spec.symmetric:
            amax = torch.maximum(-lo, hi)
            half = (qhi - qlo) / 2
            stored, s = _store_scale(amax / half, amax, amax / half, spec, path)
            if qlo < 0:
                return {"scale": stored}
            # an element range without negatives (uint): the zero point sits mid-range
            mid = -(-(qlo + qhi) // 2)  # ceil: 2^(N-1) for uint, full or restricted
            return {"scale": stored,
                    "zero_point": torch.full(s.shape, int(mid), dtype=codec.code_dtype, device=s.device)}
        span = qhi - qlo
        if spec.zero_point_domain == "offset":
            return _offset_from_range(lo, hi, qlo, qhi, spec, path)
        if spec.zero_point_domain == "int":
            lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        width = hi - lo
        ideal = width / span
        # a width beyond float32 (a range near +-float32 max): the scale without forming hi - lo
        ideal = torch.where(torch.isinf(width), hi / span - lo / span, ideal)
        _check_finite_scale(ideal, lo, hi, span, spec, path)
        if spec.zero_point_domain == "float":
            ideal = torch.maximum(ideal, torch.maximum(lo.abs(), hi.abs()) * _float_zero_floor(spec))
        stored, s = _store_scale(ideal, width, ideal, spec, path)
        if spec.zero_point_domain == "int":
            zp = (qlo - torch.round(lo / s)).clamp(qlo, qhi).to(codec.code_dtype)
        else:  # float zero points are stored like the scale (HQQ keeps both in fp16)
            zp = (qlo - lo / s).to(SCALE_DTYPES[spec.scale_dtype][0])
        return {"scale": stored, "zero_point": zp}

    def effective(self, qparams):
        spec = qparams.spec
        if spec.scale_dtype == "e8m0":
            check_e8m0(qparams.scale, spec)
        s = decode_scale(qparams.scale, spec, qparams.global_scale)
        if spec.scale_dtype == "float8_e4m3fn":
            # a hand-made zero fp8 block scale reads as the smallest normal float32; a positive product
            # below it (subnormal data: a global scale at float32's smallest normal) is kept as it is
            s = torch.where(s > 0, s, torch.finfo(torch.float32).tiny)
        z = None if qparams.zero_point is None else qparams.zero_point.to(torch.float32)
        return s, z


def _float_zero_floor(spec) -> float:
    """The smallest scale of a float-zero-point block, relative to its largest magnitude.

    A (near-)constant block's ideal scale tends to 0 and ``lo / scale`` to infinity. The zero point
    ``qmin - lo / scale`` must stay finite in its dtype (fp16: below 65504), and small enough
    (``2^20`` at most) that float32 arithmetic on ``x / scale + zero_point`` keeps a sixteenth of a
    code: then quantizing the dequantized values gives the same codes. The floor costs at most
    ``amax * 2^-21`` of error on blocks narrower than ``amax * 2^-20 * steps``.
    """
    top = int(math.floor(math.log2(torch.finfo(SCALE_DTYPES[spec.scale_dtype][0]).max))) - 1
    return 2.0 ** -min(20, top)


def _offset_from_range(lo, hi, qlo: float, qhi: float, spec, path) -> dict:
    """``x = code * scale + offset`` (GGUF Q4_1's ``d * q + m``). The offset, the value of code 0, is
    ``lo - qlo * scale`` rounded *down* to the scale dtype (``lo`` itself for unsigned codes), then the
    scale ``(hi - offset) / qhi`` rounded *up*: storing either never clips ``[lo, hi]``. Codes whose
    top is 0 (int1: -1, 0) anchor the offset at ``hi`` (rounded up) instead."""
    span = qhi - qlo
    width = hi - lo
    ideal = torch.where(torch.isinf(width), hi / span - lo / span, width / span)
    _check_finite_scale(ideal, lo, hi, span, spec, path)
    dtype = SCALE_DTYPES[spec.scale_dtype][0]
    top = qhi <= 0
    target = hi if top else lo if qlo == 0 else lo - qlo * ideal
    if qlo < 0 < qhi:  # a value inside [lo, hi] whose terms may overflow: form it at half size there
        target = torch.where(torch.isinf(target), (lo * 0.5 - qlo * (ideal * 0.5)) * 2, target)
    finfo = torch.finfo(dtype)
    if not under_transform(target) and bool((target.abs() > finfo.max).any()):
        first = tuple(int(i) for i in (target.abs() > finfo.max).nonzero()[0])
        raise ValueError(f"{where(path)}the block at grid index {first} needs the offset {float(target[first]):.4g}, "
                         f"beyond scale_dtype={spec.scale_dtype!r} (max {finfo.max:.4g})"
                         + ("; use scale_dtype='float32'" if dtype != torch.float32 else ""))
    offset = -round_down_to(-target, dtype) if top else round_down_to(target, dtype)
    m = offset.to(torch.float32)
    reach, steps = (m - lo, -qlo) if top else (hi - m, qhi)
    # a reach beyond float32 (a range near +-float32 max): the scale without forming it
    need = torch.where(torch.isinf(reach), (m / steps - lo / steps) if top else (hi / steps - m / steps), reach / steps)
    stored, _ = _store_scale(need, need, need, spec, path)
    return {"scale": stored, "zero_point": offset}


def _two_level_from_range(lo, hi, elem_max: float) -> dict:
    """fp8 block scales under one fp32 tensor scale (NVFP4).

    As torchao's ``nvfp4_quantize`` and compressed-tensors: ``g = amax_tensor / (448 * elem_max)``
    (1 for an all-zero tensor) and block scale ``fp8(amax_b / elem_max / g)`` rounded to nearest
    even after clamping to ``[2^-6, 448]`` (the smallest normal fp8: never a zero scale).
    """
    amax = torch.maximum(-lo, hi)
    tensor_amax = amax.amax()
    g = torch.where(tensor_amax > 0, tensor_amax / (FP8_E4M3_MAX * elem_max), torch.ones_like(tensor_amax))
    g = g.clamp(min=torch.finfo(torch.float32).tiny)
    block = (amax / elem_max / g).clamp(FP8_E4M3_TINY, FP8_E4M3_MAX)
    return {"scale": block.to(torch.float8_e4m3fn), "global_scale": g.to(torch.float32)}


class UnitScheme(AffineScheme):
    """Scale 1 for every block: the format is its own range (bf16, fp16 casts)."""

    def from_range(self, lo, hi, spec, *, path=None) -> dict:
        return {"scale": torch.ones_like(lo, dtype=torch.float32)}


AFFINE = AffineScheme()
UNIT = UnitScheme()

"""Minifloat element formats from one generic codec (fp8, fp6, fp4, fp16, bf16, user formats).

A minifloat has a sign bit, ``exponent_bits`` of biased exponent and ``mantissa_bits``
of fraction. Exponent field 0 holds the subnormals ``0.M * 2^(1 - bias)``; the others
``1.M * 2^(E - bias)``. What the top codes mean is the ``special`` encoding:

==========  =====================================================  ==================
special     codes that are not finite numbers                      examples
==========  =====================================================  ==================
``"ieee"``  exponent all ones: ±Inf (mantissa 0), NaN (otherwise)   fp8_e5m2, fp16, bf16
``"fn"``    exponent and mantissa all ones: NaN; no Inf             fp8_e4m3 (e4m3fn)
``"fnuz"``  ``0x80`` (negative zero): the one NaN; no Inf, no -0    fp8_e4m3fnuz, fp8_e5m2fnuz
``"none"``  none: every code is a finite number                     fp6_e3m2, fp6_e2m3, fp4_e2m1
==========  =====================================================  ==================

Rounding is on the mantissa: to nearest, ties to even (``"half_even"``, as the
hardware casts), ties away from zero, or stochastic; subnormals are kept. Values beyond
the largest finite magnitude saturate to it (default); with ``saturate=False`` they
overflow IEEE-style (a value that rounds past the largest finite one becomes ±Inf, or
NaN where the format has no Inf; formats with neither always saturate). Non-finite
inputs are rejected before they reach a codec (the NaN/Inf policy of
:mod:`qtransform._checks`, the same for every format).

Codes are stored exactly: in the torch dtype of the format where there is one
(``torch.float8_e4m3fn``... ``torch.bfloat16``), else as bit patterns in uint8 (bit-packed
when narrower than 8 bits: fp4 two per byte, fp6 four per three bytes). The round-trip
error bound is half the grid spacing around the element value: ``2^-(m+1)`` relative in the
normal range, ``2^(1 - bias - m) / 2`` absolute below it, exact saturation beyond.

A new minifloat is one line, ``qt.register_format(qt.minifloat("fp8_e3m4", exponent_bits=3,
mantissa_bits=4))``, after which ``QuantSpec(format="fp8_e3m4")`` works like the built-ins:

>>> import torch, qtransform as qt
>>> e3m4 = qt.minifloat("fp8_e3m4", exponent_bits=3, mantissa_bits=4)
>>> e3m4.codec.max_value, e3m4.codec.bits
(31.0, 8)
>>> qt.FORMATS["fp8_e4m3"].codec.round(torch.tensor([300.0, 1e-3, -0.3]), rounding="half_even").tolist()
[288.0, 0.001953125, -0.3125]
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .._checks import under_transform
from .base import Codec

__all__ = ["MinifloatCodec", "SPECIALS"]

SPECIALS = ("ieee", "fn", "fnuz", "none")

_TWO23 = 8388608.0  # adding 2^23 to x in [0, 2^22] rounds it to an integer, half to even,
_TWO23_BITS = 0x4B000000  # and leaves that integer in the low bits of the float32 pattern
_EXP_MASK = 0x7F800000  # float32 exponent field: bits & mask is 2^floor(log2 |x|)


def _clamp(t: torch.Tensor, lo=None, hi=None) -> torch.Tensor:
    """Clamp a temporary in place, except under vmap (no batching rule for ``clamp_``)."""
    if lo is None and hi is None:
        return t
    return t.clamp(lo, hi) if under_transform(t) else t.clamp_(lo, hi)


@dataclasses.dataclass(frozen=True)
class MinifloatCodec(Codec):
    """Sign, ``exponent_bits`` biased exponent, ``mantissa_bits`` fraction.

    Args:
        exponent_bits: 1..8 (8 only as bf16 is: ``bias=127``, ``special="ieee"``, the float32 range).
        mantissa_bits: 0..10 (0..7 with an 8-bit exponent); codes are at most 16 bits.
        bias: exponent bias (``2^(exponent_bits-1) - 1`` by default).
        special: ``"ieee"``, ``"fn"``, ``"fnuz"`` or ``"none"`` (see the module docstring).
        storage: torch dtype holding one code (a float8 dtype, ``torch.float16``,
            ``torch.bfloat16``), or ``None`` for integer bit patterns (uint8 up to 8 bits,
            int16 above).
    """

    exponent_bits: int
    mantissa_bits: int
    bias: int | None = None
    special: str = "none"
    storage: torch.dtype | None = None

    def __post_init__(self):
        e, m = self.exponent_bits, self.mantissa_bits
        for name, val in (("exponent_bits", e), ("mantissa_bits", m)):
            if not isinstance(val, int) or isinstance(val, bool):
                raise TypeError(f"MinifloatCodec: {name} must be an int, got {val!r}")
        if not 1 <= e <= 8:
            raise ValueError(f"MinifloatCodec: exponent_bits must be in 1..8, got {e}")
        bias = (1 << (e - 1)) - 1 if self.bias is None else self.bias
        if not isinstance(bias, int) or isinstance(bias, bool):
            raise TypeError(f"MinifloatCodec: bias must be an int, got {bias!r}")
        object.__setattr__(self, "bias", bias)
        if self.special not in SPECIALS:
            raise ValueError(f"MinifloatCodec: special must be one of {list(SPECIALS)}, got {self.special!r}")
        if e == 8:
            if bias != 127 or not 0 <= m <= 7 or self.special != "ieee":
                raise ValueError("MinifloatCodec: an 8-bit exponent needs bias=127, special='ieee' (the float32 "
                                 f"range) and mantissa_bits in 0..7, got bias={bias}, special={self.special!r}, "
                                 f"mantissa_bits={m}")
        elif not 0 <= m <= 10:
            raise ValueError(f"MinifloatCodec: mantissa_bits must be in 0..10, got {m}")
        if self.special == "fn" and m == 0:
            raise ValueError("MinifloatCodec: special='fn' (NaN at all-ones) needs mantissa_bits >= 1")
        if self.special == "ieee" and e == 1:
            raise ValueError("MinifloatCodec: special='ieee' needs exponent_bits >= 2")
        if e < 8 and not (-126 + m <= 1 - bias and self._top_exponent - bias <= 127):
            raise ValueError(f"MinifloatCodec: bias {bias} puts exponents outside what float32 holds exactly")
        if self.storage is not None:
            if not isinstance(self.storage, torch.dtype):
                raise TypeError(f"MinifloatCodec: storage must be a torch.dtype or None, got {self.storage!r}")
            if torch.empty((), dtype=self.storage).element_size() * 8 != self.bits:
                raise ValueError(f"MinifloatCodec: storage {self.storage} does not hold {self.bits}-bit codes")
            codes = torch.arange(1 << self.bits, dtype=torch.int32).to(
                torch.int16 if self.bits == 16 else torch.uint8).view(self.storage)
            ours, torchs = self.decode_bits(codes), codes.to(torch.float32)
            if not bool(((ours == torchs) | (ours.isnan() & torchs.isnan())).all()):
                raise ValueError(f"MinifloatCodec: storage {self.storage} does not encode e{e}m{m}, bias {bias}, "
                                 f"special={self.special!r}")

    # ------------------------------------------------------------------ layout
    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def code_dtype(self) -> torch.dtype:
        if self.storage is not None:
            return self.storage
        return torch.uint8 if self.bits <= 8 else torch.int16

    @property
    def _top_exponent(self) -> int:
        """Largest exponent field holding finite numbers."""
        top = (1 << self.exponent_bits) - 1
        return top - 1 if self.special == "ieee" else top

    @property
    def max_code(self) -> int:
        """Magnitude bits (sign cleared) of the largest finite value."""
        mant = (1 << self.mantissa_bits) - 1
        if self.special == "fn":
            mant -= 1
        return (self._top_exponent << self.mantissa_bits) | mant

    @property
    def max_value(self) -> float:
        """Largest finite magnitude (448 for fp8_e4m3, 6 for fp4_e2m1)."""
        m = self.mantissa_bits
        mant = self.max_code & ((1 << m) - 1)
        return (1 + mant / (1 << m)) * 2.0 ** (self._top_exponent - self.bias)

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value (``1 - bias``)."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        return self._top_exponent - self.bias

    @property
    def mbits(self) -> int:
        return self.mantissa_bits

    @property
    def overflow(self) -> str | None:
        return {"ieee": "inf", "fn": "nan", "fnuz": "nan", "none": None}[self.special]

    @property
    def bound(self) -> str:
        return (f"relative 2^-{self.mantissa_bits + 1} in the normal range, "
                f"2^{self.emin - self.mantissa_bits - 1} absolute below 2^{self.emin} (times the scale), "
                "saturation to ±max·scale")

    @property
    def _same_range_as_fp32(self) -> bool:
        return self.exponent_bits == 8

    def qrange(self, *, symmetric, restricted):
        return -self.max_value, self.max_value

    # ------------------------------------------------------------------ rounding
    def _split(self, a: torch.Tensor, rounding: str, noise, hi):
        """Round magnitudes ``a`` (a float32 temporary, overwritten) onto the grid.

        Returns ``(n, p)``: ``n`` (float32) holds ``k + 2^23`` for the integer ``k`` of grid
        steps (its int32 view is ``0x4B000000 + k``), ``p`` (int32) the float32 bit pattern of the
        grid spacing ``2^(max(floor(log2 a), emin) - m)``. The magnitude is ``k * spacing``.
        """
        a = _clamp(a, None, hi)
        p = torch.bitwise_and(a.view(torch.int32), _EXP_MASK)
        spacing = _clamp(p.view(torch.float32), 2.0 ** self.emin).mul_(2.0 ** -self.mantissa_bits)
        n = a.div_(spacing)  # exact: a power of two; n in [0, 2^(m+1)]
        if rounding == "half_even":
            n.add_(_TWO23)
        elif rounding == "half_away":
            n.add_(0.5).floor_().add_(_TWO23)
        elif rounding == "stochastic":
            if noise is None:
                raise ValueError("rounding='stochastic' needs noise: pass generator= (a torch.Generator or an int seed) to quantize")
            n.add_(noise).floor_().add_(_TWO23)
        else:
            raise ValueError(f"unknown rounding {rounding!r}")
        return n, spacing.view(torch.int32)

    def _round_bits(self, v: torch.Tensor, rounding: str, noise, hi) -> torch.Tensor:
        """Formats with float32's exponent range (bf16): round the bit pattern of the temporary ``v``.

        Returns the rounded float32 bit patterns (int32, sign bit included), a view of ``v``.
        """
        drop = 23 - self.mantissa_bits
        bits = _clamp(v, None if hi is None else -hi, hi).view(torch.int32)
        if rounding == "half_even":
            bits.add_(torch.bitwise_and(bits >> drop, 1)).add_((1 << (drop - 1)) - 1)
        elif rounding == "half_away":
            bits.add_(1 << (drop - 1))
        elif rounding == "stochastic":
            if noise is None:
                raise ValueError("rounding='stochastic' needs noise: pass generator= (a torch.Generator or an int seed) to quantize")
            bits.add_((noise * float(1 << drop)).to(torch.int32))
        else:
            raise ValueError(f"unknown rounding {rounding!r}")
        return bits.bitwise_and_(~((1 << drop) - 1))

    def _overflowed(self, q: torch.Tensor, hi) -> torch.Tensor:
        """Non-saturating: magnitudes past the largest finite one become Inf or NaN."""
        if hi is not None or self.overflow is None:
            return q
        return torch.where(q > self.max_value, float("inf") if self.overflow == "inf" else float("nan"), q)

    def round(self, v, *, rounding, noise=None, lo=None, hi=None):
        v = v.detach().to(torch.float32)
        if self._same_range_as_fp32:
            return self._round_bits(v.clone(), rounding, noise, hi).view(torch.float32)
        n, p = self._split(v.abs(), rounding, noise, hi)
        q = n.sub_(_TWO23).mul_(p.view(torch.float32))
        return self._overflowed(q, hi).copysign_(v)

    # ------------------------------------------------------------------ codes
    def encode(self, v, *, rounding, noise=None, lo=None, hi=None):
        v = v.detach()
        if v.dtype != torch.float32:
            v = v.to(torch.float32)
        if rounding == "half_even" and hi is not None:
            codes = self._encode_by_cast(v, hi)
            if codes is not None:
                return codes
        return self.encode_bits(v, rounding=rounding, noise=noise, hi=hi)

    @property
    def _cast_target(self):
        """``(fp8 dtype, bias)`` of a torch float8 type whose grid contains this format's grid
        exponent for exponent once rescaled by ``2^(bias - target_bias)`` (fp6 E2M3 in E4M3,
        fp6 E3M2 in E5M2), or None."""
        if self.special != "none" or self.storage is not None:
            return None
        top = (1 << self.exponent_bits) - 1
        if self.mantissa_bits == 3 and top <= 14:
            return torch.float8_e4m3fn, 7
        if self.mantissa_bits == 2 and top <= 30:
            return torch.float8_e5m2, 15
        return None

    def _encode_by_cast(self, v: torch.Tensor, hi: float):
        """Saturating round-half-even through torch's float8 casts, where they round exactly as
        :meth:`encode_bits` does (the tests check it); None where no cast applies."""
        if self.storage is not None:  # torch's casts round half to even, subnormals kept
            return _clamp(v, -hi, hi).to(self.storage)
        target = self._cast_target
        if target is None:
            return None
        dtype, bias = target
        b = _clamp(v, -hi, hi).mul_(2.0 ** (self.bias - bias)).to(dtype).view(torch.uint8)
        return b.sub_((b >> 7).mul_(128 - (1 << (self.bits - 1))))  # move the sign bit down

    def encode_bits(self, v, *, rounding, noise=None, hi=None):
        """The reference encoder, by arithmetic: any rounding, saturating (``hi``) or not.

        ``v`` (float32) is a temporary and may be overwritten. Returns codes in ``code_dtype``.

        >>> import torch, qtransform as qt
        >>> fp4 = qt.FORMATS["fp4_e2m1"].codec
        >>> fp4.encode_bits(torch.tensor([0.25, 0.75, 2.5, -7.0]), rounding="half_even", hi=6.0).tolist()
        [0, 2, 4, 15]
        """
        if self._same_range_as_fp32:
            bits = self._round_bits(v, rounding, noise, hi) >> (32 - self.bits)
            return self._store(bits)
        sign = torch.signbit(v)
        n, p = self._split(v.abs_() if not under_transform(v) else v.abs(), rounding, noise, hi)
        m = self.mantissa_bits
        # code magnitude = (e - emin) << m + k, with e - m + 127 the exponent field of the spacing
        code = p.bitwise_right_shift_(23 - m).add_(n.view(torch.int32))
        code.sub_(_TWO23_BITS + ((self.emin - m + 127) << m))
        if hi is None and self.overflow is not None:
            e = self.exponent_bits
            if self.special == "fnuz":  # the one NaN code 0x80 carries no sign
                over = code > self.max_code
                return self._store(code.masked_fill_(over, 0), sign & ~over & (code != 0), nan=over)
            top = ((1 << e) - 1) << m if self.special == "ieee" else (1 << (e + m)) - 1  # Inf or NaN
            code = code.clamp_(max=top)
        if self.special == "fnuz":  # no negative zero
            sign = sign & (code != 0)
        return self._store(code, sign)

    def _store(self, code: torch.Tensor, sign=None, nan=None) -> torch.Tensor:
        """Magnitude codes (int32) plus sign (bool) -> the storage container."""
        wide = self.bits > 8
        c = code.to(torch.int16 if wide else torch.uint8)
        if sign is not None:
            c.bitwise_or_(sign.to(c.dtype) << (self.bits - 1))
        if nan is not None:
            c.masked_fill_(nan, 1 << (self.bits - 1))
        return c.view(self.storage) if self.storage is not None else c

    def decode(self, codes):
        if self.storage is not None and codes.dtype == self.storage:
            return codes.to(torch.float32)
        if self.bits <= 8:  # one gather from the 2^bits-entry table of decode_bits
            if codes.is_floating_point():
                codes = codes.view(torch.uint8)
            idx = codes.reshape(-1).to(torch.int32)
            if codes.dtype != torch.uint8:
                idx = idx.bitwise_and_((1 << self.bits) - 1)
            return torch.index_select(_table(self, codes.device), 0, idx).reshape(codes.shape)
        return self.decode_bits(codes)

    def decode_bits(self, codes: torch.Tensor) -> torch.Tensor:
        """Bit patterns (any integer or same-width float dtype) -> float32, by arithmetic.

        The reference decoder: independent of torch's casts, defined for every code.

        >>> import torch, qtransform as qt
        >>> qt.FORMATS["fp8_e4m3"].codec.decode_bits(torch.tensor([0x01, 0x38, 0x7E, 0x7F, 0xFE])).tolist()
        [0.001953125, 1.0, 448.0, nan, -448.0]
        """
        if codes.is_floating_point():
            codes = codes.view(torch.int16 if self.bits == 16 else torch.uint8)
        e, m = self.exponent_bits, self.mantissa_bits
        c = codes.to(torch.int32) & ((1 << self.bits) - 1)
        mag = c & ((1 << (e + m)) - 1)
        field = mag >> m
        k = (mag & ((1 << m) - 1)) + ((field > 0).to(torch.int32) << m)
        val = torch.ldexp(k.to(torch.float32), field.clamp(min=1) - (self.bias + m))
        neg = (c >> (e + m)) == 1
        val = torch.where(neg, -val, val)
        if self.special == "ieee":
            top = field == (1 << e) - 1
            val = torch.where(top, torch.where(k == (1 << m), torch.where(neg, -math.inf, math.inf), math.nan), val)
        elif self.special == "fn":
            val = torch.where(mag == (1 << (e + m)) - 1, math.nan, val)
        elif self.special == "fnuz":
            val = torch.where(c == (1 << (e + m)), math.nan, val)
        return val

    def half_spacing(self, v):
        p = torch.bitwise_and(v.detach().to(torch.float32).abs().view(torch.int32), _EXP_MASK)
        return p.view(torch.float32).clamp(min=2.0 ** self.emin).mul_(2.0 ** -(self.mantissa_bits + 1))


_TABLES: dict = {}


def _table(codec: MinifloatCodec, device) -> torch.Tensor:
    """Every code's value (float32, cached per codec and device)."""
    key = (codec, str(device))
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = codec.decode_bits(torch.arange(1 << codec.bits, device=device))
    return table

"""Integer formats int1..int8 and uint1..uint8.

Codes are integers in ``[qmin, qmax]``: ``[-2^(N-1), 2^(N-1) - 1]`` signed,
``[0, 2^N - 1]`` unsigned. Quantize ``q = clamp(round(x / scale) + zero_point)``,
dequantize ``(q - zero_point) * scale``. Round-trip error bound: ``scale / 2`` for
values inside the calibrated range (``scale`` for stochastic rounding), plus the
distance to the range for clipped values.

Symmetric specs use ``symmetric_range="full"`` by default (Quark, torchao, GPTQ:
``scale = amax / ((qmax - qmin) / 2)``, int4 divides by 7.5 and uses all 16 codes) or
``"restricted"`` (``scale = amax / qmax`` with codes in ``[-qmax, qmax]``; int2 restricted
is ternary). Symmetric unsigned formats use the fixed zero point ``2^(N-1)``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .._checks import under_transform
from .base import Codec, Format, register_format, round_values

__all__ = ["IntCodec"]

_RNE_MAGIC = 12582912.0  # 1.5 * 2^23


@dataclasses.dataclass(frozen=True)
class IntCodec(Codec):
    """N-bit two's complement (``signed``) or unsigned integer codes."""

    bits: int
    signed: bool

    def __post_init__(self):
        if not 1 <= self.bits <= 8:
            raise ValueError(f"IntCodec: bits must be in 1..8, got {self.bits}")

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1)) if self.signed else 0

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.signed else (1 << self.bits) - 1

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.int8 if self.signed else torch.uint8

    @property
    def emax(self) -> int:
        return int(math.floor(math.log2(self.qmax))) if self.qmax > 0 else 0

    @property
    def mbits(self) -> int:
        return self.emax

    @property
    def bound(self) -> str:
        return "scale/2 inside the calibrated range"

    def qrange(self, *, symmetric, restricted):
        lo = self.qmin + 1 if (symmetric and restricted) else self.qmin
        return float(lo), float(self.qmax)

    def _lohi(self, lo, hi):
        return (self.qmin if lo is None else lo), (self.qmax if hi is None else hi)

    def round(self, v, *, rounding, noise=None, lo=None, hi=None):
        lo, hi = self._lohi(lo, hi)
        if rounding == "half_even" and v.dtype == torch.float32:
            # clamp first (bounds are integers, so the order does not matter), then round half
            # to even by adding and removing 1.5 * 2^23: exact for |v| < 2^22, 1.5x faster
            w = v.clamp(lo, hi)
            return w.add_(_RNE_MAGIC).sub_(_RNE_MAGIC)
        return round_values(v, rounding, noise).clamp(lo, hi)

    def encode(self, v, *, rounding, noise=None, lo=None, hi=None):
        lo, hi = self._lohi(lo, hi)
        if rounding == "half_even" and v.dtype == torch.float32:
            w = v.clamp(lo, hi) if under_transform(v) else v.clamp_(lo, hi)  # no vmap rule for clamp_
            return w.add_(_RNE_MAGIC).sub_(_RNE_MAGIC).to(self.code_dtype)
        return self.round(v, rounding=rounding, noise=noise, lo=lo, hi=hi).to(self.code_dtype)

    def decode(self, codes):
        return codes.to(torch.float32)

    def half_spacing(self, v):
        return torch.full_like(v, 0.5)


for _bits in range(1, 9):
    register_format(Format(
        name=f"int{_bits}", codec=IntCodec(_bits, True), family="int",
        description=f"signed {_bits}-bit integer",
    ))
    register_format(Format(
        name=f"uint{_bits}", codec=IntCodec(_bits, False), family="int",
        description=f"unsigned {_bits}-bit integer",
    ))

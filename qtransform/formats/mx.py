"""OCP Microscaling (MX v1.0): blocks of 32 sharing one E8M0 power-of-two scale.

=============  ==================  ======  ===============  =================
format         element             emax    max element      bits per element
=============  ==================  ======  ===============  =================
mxfp8_e4m3     fp8 E4M3 (fn)       8       448              8.25
mxfp8_e5m2     fp8 E5M2            15      57344            8.25
mxfp6_e3m2     fp6 E3M2            4       28               6.25
mxfp6_e2m3     fp6 E2M3            2       7.5              6.25
mxfp4          fp4 E2M1            2       6                4.25
mxint8         int8 fixed point    0       127/64           8.25
=============  ==================  ======  ===============  =================

The block runs along the granularity's axis (``PerGroup(32, axis)``, the last axis by
default, so ``QuantSpec(format="mxfp4")`` just works); axis lengths that are not a
multiple of 32 are padded for the computation and cropped again. The shared exponent
follows ``scale_rule``:

* ``"floor"`` (OCP spec, default): ``floor(log2 amax) - emax``;
* ``"even"`` (Quark's default): the same after rounding amax to the element's mantissa
  width (half up on its float32 bit pattern), so the exponent goes up by one when amax's
  significand is at least ``2 - 2^-(m+1)`` (1.75 for FP4) and the block does not saturate;
* ``"ceil"``: the smallest power of two ``>= amax / max_element`` (never clips; torchao's
  and cuBLAS's RCEIL). Quark's and torchao's ``CEIL`` (``ceil(log2 amax) - emax``) is not offered.

A zero block takes the smallest scale ``2^-127``; exponents are clamped to E8M0's
``[-127, 127]``. Elements are then quantized with round half to even and saturation to
±max element (OCP allows either saturation or overflow for FP8; ``saturate=False`` gives
the latter). MXINT8 elements are two's complement codes in ``[-127, 127]`` read as
``code / 64`` (Quark's symmetric range; the spec's optional -2.0 is not used).

>>> import torch, qtransform as qt
>>> x = torch.linspace(-3, 3, 64).reshape(2, 32)
>>> spec = qt.QuantSpec(format="mxfp4")
>>> q = qt.quantize(x, qt.choose_qparams(x, spec))
>>> q.qparams.scale.dtype, q.qparams.scale.flatten().tolist(), q.codes.shape  # 2^(1 - emax) = 2^-1
(torch.uint8, [126, 126], torch.Size([2, 16]))
>>> q.bits_per_element()
4.25
"""

from __future__ import annotations

import dataclasses

import torch

from ..granularity import PerGroup
from .base import Codec, Format, get_format, register_format, round_values
from .int import _RNE_MAGIC
from .minifloat_codec import _clamp

__all__ = ["FixedPointCodec", "mx_format", "MX_BLOCK"]

MX_BLOCK = 32


@dataclasses.dataclass(frozen=True)
class FixedPointCodec(Codec):
    """Signed ``bits``-bit codes in ``[-qmax, qmax]`` read as ``code / 2^frac_bits`` (MXINT8: 8, 6)."""

    bits: int
    frac_bits: int

    def __post_init__(self):
        if not 2 <= self.bits <= 8 or not 0 <= self.frac_bits < self.bits:
            raise ValueError(f"FixedPointCodec: need 2 <= bits <= 8 and 0 <= frac_bits < bits, "
                             f"got bits={self.bits}, frac_bits={self.frac_bits}")

    code_dtype = torch.int8
    signed = True
    overflow = None

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @property
    def emax(self) -> int:
        return self.bits - 2 - self.frac_bits  # floor(log2(qmax / 2^frac))

    @property
    def mbits(self) -> int:
        return self.bits - 2

    @property
    def bound(self) -> str:
        return f"2^-{self.frac_bits + 1} (half a step) times the scale, saturation to ±{self.qmax}/2^{self.frac_bits}"

    def qrange(self, *, symmetric, restricted):
        top = self.qmax / (1 << self.frac_bits)
        return -top, top

    def encode(self, v, *, rounding, noise=None, lo=None, hi=None):
        w = v.detach().to(torch.float32).mul_(float(1 << self.frac_bits))  # v is a temporary
        q = self.qmax
        if rounding == "half_even":  # clamp first (integer bounds), then round half to even
            return _clamp(w, -q, q).add_(_RNE_MAGIC).sub_(_RNE_MAGIC).to(torch.int8)
        return _clamp(round_values(w, rounding, noise), -q, q).to(torch.int8)

    def round(self, v, *, rounding, noise=None, lo=None, hi=None):
        return self.decode(self.encode(v.detach().to(torch.float32).clone(), rounding=rounding, noise=noise))

    def decode(self, codes):
        return codes.to(torch.float32).mul_(1.0 / (1 << self.frac_bits))

    def half_spacing(self, v):
        return torch.full_like(v, 0.5 / (1 << self.frac_bits), dtype=torch.float32)


def mx_format(name: str, element: str | Codec, *, block: int = MX_BLOCK, description: str = "") -> Format:
    """An MX format: ``element`` (a registered format name or a codec) in blocks of ``block``
    along an axis, with one E8M0 scale per block. Register it with ``register_format``.

    >>> import qtransform as qt
    >>> f = qt.mx_format("mxfp8_e3m4_demo", qt.minifloat("e3m4_demo", exponent_bits=3, mantissa_bits=4).codec)
    >>> f.block, f.scale_dtypes, f.scale_rule
    (32, ('e8m0',), 'floor')
    """
    codec = get_format(element).codec if isinstance(element, str) else element
    if not isinstance(codec, Codec):
        raise TypeError(f"mx_format: element must be a format name or a Codec, got {type(element).__name__}")
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"mx_format: block must be a positive int, got {block!r}")
    return Format(name=name, codec=codec, family="mx", description=description or f"MX block {block}, {name}",
                  default_granularity=PerGroup(block), block=block, scale_dtypes=("e8m0",),
                  scale_rule="floor", symmetric_only=True)


for _name, _element in (("mxfp8_e4m3", "fp8_e4m3"), ("mxfp8_e5m2", "fp8_e5m2"), ("mxfp6_e3m2", "fp6_e3m2"),
                        ("mxfp6_e2m3", "fp6_e2m3"), ("mxfp4", "fp4_e2m1")):
    register_format(mx_format(_name, _element, description=f"OCP MX: {_element} elements, E8M0 scale per 32"))
register_format(mx_format("mxint8", FixedPointCodec(8, 6),
                          description="OCP MX: int8 elements (code/64), E8M0 scale per 32"))

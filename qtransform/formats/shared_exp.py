"""Shared-exponent block formats as AMD Quark defines them: MX4, MX6, MX9 and BFP16.

**MX4 / MX6 / MX9** (shared micro-exponents; Rouhani et al. 2023, Quark's ``mx4``/``mx6``/
``mx9``): blocks of 16 along an axis share an 8-bit exponent ``E``, the float32 exponent
of the block's amax (``floor(log2 amax)``, -127 for a zero block). Each pair of elements
has a 1-bit micro-exponent ``shift``: 1 when both of its elements' exponents are below
``E`` (the pair's amax is ``< 2^E``), else 0. An element is a signed integer code
``clamp(round(x / step), -qmax, qmax)`` with ``step = 2^(E - shift - bits + 2)``:

======  ===========  ==========  ======================================
format  code bits    qmax        bits per element
======  ===========  ==========  ======================================
mx9     8            127         8 + 8/16 + 1/2 = 9
mx6     5 (packed)   15          5 + 8/16 + 1/2 = 6
mx4     3 (packed)   3           3 + 8/16 + 1/2 = 4
======  ===========  ==========  ======================================

Storage: codes bit-packed at their width (MX9 as int8), ``E + 127`` as uint8 per block
(the scale), the shifts bit-packed one per pair along the last axis of the pair grid
(``QParams.micro_exponent``). Unlike Quark, float32 subnormal inputs are kept rather than
flushed to zero (they only matter in blocks whose amax is below ``2^-125``).

**BFP16** (Quark's ``bfp16``): blocks of 8 share one exponent stored like an E8M0 scale;
codes are int8 in ``[-128, 127]`` with ``scale = 2^(floor(log2 amax) - 6)``, doubled when the
block's largest value would round to +128 (``max >= 127.5 * scale``). 9 bits per element.

Round-trip error: half a step (``step / 2``) inside the range; MX codes saturate at ±qmax
(the block's largest values may clip by less than one step).

>>> import torch, qtransform as qt
>>> x = torch.tensor([[3.0, 2.9, 0.2, 0.1] + [0.0] * 12])
>>> qp = qt.choose_qparams(x, qt.QuantSpec(format="mx6"))
>>> qp.scale.item() - 127, qt.unpack(qp.micro_exponent, 1, 8).tolist()  # E = 1; pair 2 shifts
(1, [[0, 1, 1, 1, 1, 1, 1, 1]])
>>> qt.dequantize(qt.quantize(x, qp))[0, :4].tolist()
[3.0, 3.0, 0.25, 0.125]
"""

from __future__ import annotations

import dataclasses

import torch

from .._checks import where
from ..granularity import PerGroup
from .base import Format, register_format
from .int import IntCodec
from .packing import pack, unpack
from .scaling import E8M0_BIAS, AffineScheme, Scheme, check_e8m0

__all__ = ["SymmetricIntCodec", "MicroExponentScheme", "BlockFloatScheme", "MICROEXP_BLOCK", "BFP_BLOCK"]

MICROEXP_BLOCK = 16
BFP_BLOCK = 8


@dataclasses.dataclass(frozen=True)
class SymmetricIntCodec(IntCodec):
    """Signed integer codes restricted to ``[-qmax, qmax]`` whatever the spec (MX4/MX6/MX9)."""

    @property
    def bound(self) -> str:
        return (f"half a step 2^(E - shift - {self.bits - 2}) of the element's pair, saturation to "
                f"±{self.qmax} steps")

    def qrange(self, *, symmetric, restricted):
        return float(-self.qmax), float(self.qmax)

    def _lohi(self, lo, hi):
        return (-self.qmax if lo is None else lo), (self.qmax if hi is None else hi)


def _exponent(a: torch.Tensor) -> torch.Tensor:
    """The float32 exponent field of ``a >= 0`` minus the bias: floor(log2 a), -127 for 0 and subnormals."""
    return (a.contiguous().view(torch.int32) >> 23) - E8M0_BIAS


def _fixed_rule(spec, path):
    if spec.scale_rule != "floor":
        raise ValueError(f"{where(path)}format {spec.format} defines its own shared exponent; "
                         f"scale_rule must be 'floor' (the default), got {spec.scale_rule!r}")


class MicroExponentScheme(Scheme):
    """Block exponents (E8M0 codes) plus one bit-packed micro-exponent per pair (MX4/MX6/MX9)."""

    def from_range(self, lo, hi, spec, *, path=None) -> dict:
        """Per-pair ranges (the sub-block grid) -> block exponents and per-pair micro-exponents."""
        _fixed_rule(spec, path)
        fmt = spec.fmt
        axis = spec.granularity.axis % lo.ndim
        ratio = fmt.block // fmt.sub_block
        pair_exp = _exponent(torch.maximum(-lo, hi))
        shape = list(pair_exp.shape)
        blocked = pair_exp.reshape(shape[:axis] + [shape[axis] // ratio, ratio] + shape[axis + 1:])
        block_exp = blocked.amax(axis + 1)
        shift = (pair_exp < block_exp.repeat_interleave(ratio, dim=axis)).to(torch.uint8)
        return {"scale": (block_exp + E8M0_BIAS).to(torch.uint8), "micro_exponent": pack(shift, 1)}

    def effective(self, qparams):
        """Per-pair float32 steps ``2^(E - shift - bits + 2)`` (the sub-block grid)."""
        spec = qparams.spec
        fmt = spec.fmt
        if qparams.micro_exponent is None:
            raise ValueError(f"format {spec.format}: qparams.micro_exponent is missing (one bit per pair)")
        check_e8m0(qparams.scale, spec)
        axis = spec.granularity.axis % qparams.scale.ndim
        block_exp = qparams.scale.to(torch.int32).repeat_interleave(fmt.block // fmt.sub_block, dim=axis)
        shift = unpack(qparams.micro_exponent, 1, block_exp.shape[-1]).to(torch.int32)
        k = block_exp - shift - (E8M0_BIAS + fmt.codec.bits - 2)
        return torch.exp2(k.to(torch.float32)), None


class BlockFloatScheme(AffineScheme):
    """BFP16: ``2^(floor(log2 amax) - emax)``, doubled when the block maximum would round past qmax
    (read back as any E8M0 affine scale)."""

    def from_range(self, lo, hi, spec, *, path=None) -> dict:
        _fixed_rule(spec, path)
        codec = spec.fmt.codec
        amax = torch.maximum(-lo, hi)
        k = torch.frexp(amax)[1] - 1 - codec.emax
        k = k + (hi >= (codec.qmax + 0.5) * torch.exp2(k.to(torch.float32))).to(k.dtype)
        k = torch.where(amax > 0, k, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)
        return {"scale": (k + E8M0_BIAS).to(torch.uint8)}


MICROEXP = MicroExponentScheme()
BFP = BlockFloatScheme()

for _name, _bits in (("mx9", 8), ("mx6", 5), ("mx4", 3)):
    register_format(Format(
        name=_name, codec=SymmetricIntCodec(_bits, True), family="microexp",
        description=f"shared micro-exponents (Quark {_name}): {_bits}-bit codes, 8-bit exponent per 16, "
                    "1-bit micro-exponent per pair",
        default_granularity=PerGroup(MICROEXP_BLOCK), block=MICROEXP_BLOCK, sub_block=2,
        scale_dtypes=("e8m0",), scale_rule="floor", symmetric_only=True, scheme=MICROEXP))

register_format(Format(
    name="bfp16", codec=IntCodec(8, True), family="bfp",
    description="block floating point (Quark bfp16): int8 codes, shared exponent per 8",
    default_granularity=PerGroup(BFP_BLOCK), block=BFP_BLOCK, scale_dtypes=("e8m0",), scale_rule="floor",
    symmetric_only=True, scheme=BFP))

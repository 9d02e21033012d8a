"""Format descriptions and the registry.

A format is two things:

* a **codec**: the element number format. It maps values ``v`` of the *element
  domain* (the tensor divided by its scale, plus the zero point) to integer codes
  and back, and knows its representable range and its rounding grid;
* **scaling rules**: its :class:`~qtransform.formats.scaling.Scheme` (how scales are made and
  read back), the default granularity, the scale dtypes it allows, an intrinsic block
  (OCP MX: 32) and micro-exponent sub-blocks (MX4/MX6/MX9).

``x ≈ (decode(codes) - zero_point) * scale`` holds for every format. Adding a format
is one :func:`register_format` call with a :class:`Format` (and, for a new kind of
element, one small codec class).
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from ..granularity import Granularity, PerTensor
from ..registry import Registry
from .scaling import AFFINE, SCALE_DTYPES, Scheme

__all__ = ["Codec", "Format", "FORMATS", "register_format", "get_format", "round_values", "ROUNDINGS"]

ROUNDINGS = ("half_even", "half_away", "stochastic")


def round_values(v: torch.Tensor, rounding: str, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Round to integers: half to even, half away from zero, or stochastically.

    Stochastic rounding takes ``noise`` uniform in [0, 1) of ``v``'s shape (explicit
    randomness: no hidden global generator), rounding up with probability ``frac(v)``.
    """
    if rounding == "half_even":
        return torch.round(v)
    if rounding == "half_away":
        return torch.sign(v) * torch.floor(v.abs() + 0.5)
    if rounding == "stochastic":
        if noise is None:
            raise ValueError("rounding='stochastic' needs noise: pass generator= (a torch.Generator or an int seed) to quantize")
        return torch.floor(v + noise)
    raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")


class Codec(abc.ABC):
    """Element number format (subclasses: integer, codebook, minifloat).

    Attributes:
        bits: width of one code in storage.
        code_dtype: container of unpacked codes (``torch.int8``, ``torch.uint8``, a float8 dtype...).
        signed: integer codes are two's complement and sign-extend when unpacked.
        emax: ``floor(log2(largest magnitude))``, used by power-of-two scale rules.
        mbits: mantissa bits after the leading one of the largest values, used by the
            ``even`` power-of-two rule (round amax to this width before taking its exponent).
        bound: the round-trip error bound in words (``docs/formats.md``, ``qtransform formats``).
        overflow: what a value beyond the range becomes with ``saturate=False``: ``"inf"``,
            ``"nan"``, or ``None`` for codecs that always saturate (integers, codebooks, FP4/FP6).
    """

    bits: int
    code_dtype: torch.dtype
    signed: bool = False
    emax: int
    mbits: int
    bound: str = ""
    overflow: str | None = None

    @property
    def packed(self) -> bool:
        """Sub-byte integer codes are bit-packed along the last axis in storage."""
        return self.bits < 8 and not self.code_dtype.is_floating_point

    @abc.abstractmethod
    def qrange(self, *, symmetric: bool, restricted: bool) -> tuple[float, float]:
        """Representable element-domain interval ``[lo, hi]`` for a spec."""

    @abc.abstractmethod
    def encode(self, v: torch.Tensor, *, rounding: str, noise=None, lo=None, hi=None) -> torch.Tensor:
        """Element-domain values -> codes (saturating to ``[lo, hi]``).

        ``v`` is a temporary owned by the caller: encode may overwrite it.
        """

    @abc.abstractmethod
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes -> float32 element-domain values."""

    def round(self, v, *, rounding: str, noise=None, lo=None, hi=None) -> torch.Tensor:
        """Values on the element grid (``decode(encode(v))``, without materializing codes)."""
        return self.decode(self.encode(v, rounding=rounding, noise=noise, lo=lo, hi=hi))

    @abc.abstractmethod
    def half_spacing(self, v: torch.Tensor) -> torch.Tensor:
        """Half the distance between the grid points around ``v`` (the rounding error bound)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Format:
    """A registered number format: a codec plus its scaling rules.

    Attributes:
        name: registry key (``"int4"``, ``"mxfp4"``...).
        codec: the element format.
        family: ``"int"``, ``"codebook"``, ``"float"``, ``"mx"``...
        default_granularity: used when a spec gives none.
        block: intrinsic block length along the granularity axis (OCP MX: 32); specs of this
            format must use ``PerGroup(block, axis)``, and lengths that are not a multiple
            are padded for the computation.
        sub_block: micro-exponent sub-block length (MX4/MX6/MX9: 2), else None.
        scale_dtypes: scale dtypes this format allows (first is the default).
        scale_rule: default rule for power-of-two scales (``"floor"``, ``"ceil"``, ``"even"``).
        symmetric_only: no zero point (codebooks, minifloats, MX).
        scheme: the scaling scheme (:data:`~qtransform.formats.scaling.AFFINE` unless the family
            brings its own, as the casts and the shared-exponent formats do).
    """

    name: str
    codec: Codec
    family: str
    description: str = ""
    default_granularity: Granularity = PerTensor()
    block: int | None = None
    sub_block: int | None = None
    scale_dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16", "e8m0")
    scale_rule: str = "ceil"
    symmetric_only: bool = False
    scheme: Scheme = AFFINE

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Format: name must be a non-empty string, got {self.name!r}")
        unknown = [d for d in self.scale_dtypes if d not in SCALE_DTYPES]
        if unknown:
            raise ValueError(f"Format {self.name}: unknown scale dtype(s) {unknown}; known: {list(SCALE_DTYPES)}")
        if not isinstance(self.scheme, Scheme):
            raise TypeError(f"Format {self.name}: scheme must be a qtransform.formats.scaling.Scheme, "
                            f"got {type(self.scheme).__name__}")

    @property
    def bits(self) -> int:
        return self.codec.bits


def _check_format(name: str, fmt) -> None:
    if not isinstance(fmt, Format):
        raise TypeError(f"register_format: expected a Format, got {type(fmt).__name__}")
    if fmt.name != name:
        raise ValueError(f"register_format: format named {fmt.name!r} registered as {name!r}")


#: The registry: name -> :class:`Format` (read-only; add with :func:`register_format`).
FORMATS = Registry("format", check=_check_format)


def register_format(fmt: Format, *, replace: bool = False) -> Format:
    """Add ``fmt`` to :data:`FORMATS` (every property test picks it up). Returns ``fmt``."""
    if not isinstance(fmt, Format):
        raise TypeError(f"register_format: expected a Format, got {type(fmt).__name__}")
    return FORMATS.register(fmt.name, fmt, replace=replace)


def get_format(name: str) -> Format:
    """Look up a format by name, with a clear error listing the known names."""
    return FORMATS[name]

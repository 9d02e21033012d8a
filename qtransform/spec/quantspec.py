"""``QuantSpec``: how one tensor is quantized. Frozen, keyword-only, hashable, JSON-able.

A spec holds what *decoding* needs (the format, how scales are shared and stored, the
zero point's kind) and the few choices that shape the codes (rounding, saturation,
padding, dynamic). How parameters are *chosen* from data (the observer: minmax,
percentile, MSE...) is a calibration choice of the recipe's steps, not part of the spec
(see :mod:`qtransform.observers`). A spec never holds tensors.

Fields left as ``None`` take the format's default and are *resolved* in ``__post_init__``,
so two specs that mean the same thing compare equal and serialize the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..formats import SCALE_DTYPES, Format, get_format
from ..formats.base import ROUNDINGS
from ..granularity import (Granularity, PerBlock, PerChannel, PerGroup, PerTensor,
                          granularity_from_dict)

__all__ = ["QuantSpec", "SCALE_RULES", "ZERO_POINT_DOMAINS", "CALIBRATION_FIELDS"]

SCALE_RULES = ("floor", "ceil", "even")
#: ``"int"``: rounded zero point, ``(code - zp) * scale``; ``"float"``: unrounded, same formula;
#: ``"offset"``: ``code * scale + zp`` (the zero point is the value of code 0, stored like the scale).
ZERO_POINT_DOMAINS = ("int", "float", "offset")
#: Fields of version-1 specs that were calibration choices (moved to the observers).
CALIBRATION_FIELDS = ("observer", "percentile", "histogram_bins")
_GRANULARITIES = (PerTensor, PerChannel, PerGroup, PerBlock)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """How to quantize a tensor.

    Args:
        format: registry name (see ``qt.FORMATS``).
        granularity: ``PerTensor()``, ``PerChannel(axis)``, ``PerGroup(size, axis=-1)`` or
            ``PerBlock(shape)``; ``None`` takes the format's default (``PerGroup(32)`` for MX).
        symmetric: no zero point (signed formats) or the fixed mid-range zero point
            ``2^(N-1)`` (unsigned integers). ``False`` fits ``[min, max]`` with a zero point.
        zero_point_domain: ``"int"`` (rounded, the range always contains 0), ``"float"``
            (HQQ-style, not rounded, the range need not contain 0; ``x = (code - zero_point) * scale``)
            or ``"offset"`` (the zero point stores the value of code 0 itself, in the scale dtype:
            ``x = code * scale + zero_point``, GGUF Q4_1's ``d * q + m``, reproduced exactly with
            16-bit parameters, which ``"float"``'s ``-m / d`` is not). Asymmetric specs only.
        symmetric_range: for symmetric integer specs, ``"full"`` (default; Quark, torchao and
            GPTQ: ``amax / ((qmax - qmin) / 2)``, all codes used) or ``"restricted"``
            (``amax / qmax``, codes in ``[-qmax, qmax]``).
        scale_dtype: ``"float32"``, ``"float16"``, ``"bfloat16"``, ``"e8m0"`` (power of two
            stored as a uint8 exponent) or ``"float8_e4m3fn"`` (two-level: fp8 block scales
            times one fp32 tensor scale, as NVFP4). ``None`` takes the format's default.
            Scales are rounded *up* to the scale dtype so that rounding never clips (except
            the two-level fp8 block scales, rounded to nearest as torchao and compressed-tensors do).
        power_of_two: round scales to powers of two (implied by ``"e8m0"``).
        scale_rule: power-of-two rule: ``"floor"`` (OCP MX spec: ``2^(floor(log2 amax) - emax)``),
            ``"ceil"`` (smallest power of two that does not clip; torchao's RCEIL, not the
            ``ceil(log2 amax) - emax`` of Quark's and torchao's CEIL), ``"even"`` (Quark: round
            amax to the element's mantissa width first). ``None`` takes the format's default.
        rounding: ``"half_even"`` (default), ``"half_away"`` or ``"stochastic"`` (needs an
            explicit ``generator=`` (a generator or an int seed) when quantizing).
        dynamic: quantization parameters are computed from each input at run time.
        pad: allow group/block sizes that do not divide the axis (the last block is padded
            for the computation; results keep the original shape). Always on for formats
            with an intrinsic block (MX, NVFP4, MX4/6/9, BFP16).
        saturate: values beyond the largest representable magnitude clamp to it (default).
            ``False`` lets floating-point formats overflow to Inf (or NaN where the format
            has no Inf); formats that encode neither (integers, codebooks, fp6, fp4, MX4/6/9)
            always saturate.
    """

    format: str
    granularity: Granularity | None = None
    symmetric: bool = True
    zero_point_domain: str | None = None
    symmetric_range: str | None = None
    scale_dtype: str | None = None
    power_of_two: bool = False
    scale_rule: str | None = None
    rounding: str = "half_even"
    dynamic: bool = False
    pad: bool = False
    saturate: bool = True

    def __post_init__(self):
        fmt = get_format(self.format)
        _set = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen dataclass)
        for name in ("symmetric", "power_of_two", "dynamic", "pad", "saturate"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"QuantSpec.{name} must be a bool, got {getattr(self, name)!r}")
        _choice("rounding", self.rounding, ROUNDINGS)

        gran = fmt.default_granularity if self.granularity is None else self.granularity
        if not isinstance(gran, _GRANULARITIES):
            raise TypeError(f"QuantSpec.granularity must be one of PerTensor, PerChannel, PerGroup, "
                            f"PerBlock, got {type(gran).__name__}")
        if fmt.block is not None:
            if not (isinstance(gran, PerGroup) and gran.size == fmt.block):
                raise ValueError(f"QuantSpec: format {fmt.name} has an intrinsic block of {fmt.block}; "
                                 f"granularity must be PerGroup({fmt.block}, axis=...), got {gran}")
            _set("pad", True)
        _set("granularity", gran)

        scale_dtype = fmt.scale_dtypes[0] if self.scale_dtype is None else self.scale_dtype
        _choice("scale_dtype", scale_dtype, tuple(SCALE_DTYPES))
        if scale_dtype not in fmt.scale_dtypes:
            raise ValueError(f"QuantSpec: format {fmt.name} does not allow scale_dtype={scale_dtype!r}; "
                             f"allowed: {list(fmt.scale_dtypes)}")
        _set("scale_dtype", scale_dtype)
        if scale_dtype == "e8m0":
            _set("power_of_two", True)
        elif self.power_of_two and scale_dtype == "float8_e4m3fn":
            raise ValueError("QuantSpec: power_of_two=True contradicts scale_dtype='float8_e4m3fn'")
        if self.power_of_two:
            _set("scale_rule", fmt.scale_rule if self.scale_rule is None else self.scale_rule)
            _choice("scale_rule", self.scale_rule, SCALE_RULES)
        elif self.scale_rule is not None:
            raise ValueError(f"QuantSpec: scale_rule={self.scale_rule!r} applies to power-of-two scales "
                             "only; set power_of_two=True or scale_dtype='e8m0'")

        self._resolve_symmetry(fmt)
        if not self.saturate and fmt.codec.overflow is None:
            raise ValueError(f"QuantSpec: format {fmt.name} always saturates (it encodes neither Inf nor NaN); "
                             "saturate=False applies to formats that do (fp8, fp16, bf16)")

    def _resolve_symmetry(self, fmt: Format) -> None:
        _set = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        if self.symmetric:
            if self.zero_point_domain is not None:
                raise ValueError(f"QuantSpec: zero_point_domain={self.zero_point_domain!r} contradicts "
                                 "symmetric=True (symmetric specs have no fitted zero point)")
            if fmt.family == "int":
                _set("symmetric_range", self.symmetric_range or "full")
                _choice("symmetric_range", self.symmetric_range, ("full", "restricted"))
                codec = fmt.codec
                if codec.bits == 1:  # int1: codes -1, 0; uint1: codes 0, 1 around the zero point 1
                    raise ValueError(f"QuantSpec: {fmt.name} cannot hold a symmetric range (its two codes "
                                     "give only -scale and 0); use uint1 with symmetric=False, or int2 with "
                                     "symmetric_range='restricted' (ternary)")
            elif self.symmetric_range is not None:
                raise ValueError(f"QuantSpec: symmetric_range applies to integer formats, not {fmt.name}")
        else:
            if fmt.symmetric_only:
                raise ValueError(f"QuantSpec: format {fmt.name} is symmetric only (no zero point)")
            if self.symmetric_range is not None:
                raise ValueError("QuantSpec: symmetric_range applies to symmetric specs only")
            _set("zero_point_domain", self.zero_point_domain or "int")
            _choice("zero_point_domain", self.zero_point_domain, ZERO_POINT_DOMAINS)
            if self.power_of_two and self.zero_point_domain != "int":
                raise ValueError(f"QuantSpec: a {self.zero_point_domain} zero point with power-of-two scales is not "
                                 "supported; use zero_point_domain='int'")
            if self.scale_dtype == "float8_e4m3fn":
                raise ValueError("QuantSpec: two-level fp8 scales are symmetric only")

    # ------------------------------------------------------------------ helpers
    @property
    def fmt(self) -> Format:
        """The registered :class:`Format` this spec names."""
        return get_format(self.format)

    @property
    def restricted(self) -> bool:
        return self.symmetric_range == "restricted"

    def replace(self, **changes: Any) -> "QuantSpec":
        """A copy with ``changes`` applied (and re-validated)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """JSON-able dict; ``QuantSpec.from_dict(spec.to_dict()) == spec``."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["granularity"] = self.granularity.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "QuantSpec":
        if not isinstance(d, dict):
            raise TypeError(f"QuantSpec.from_dict expects a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        moved = sorted(set(unknown) & set(CALIBRATION_FIELDS))
        if moved:
            raise ValueError(f"QuantSpec.from_dict: {moved} are calibration choices, no longer part of a spec: "
                             "choose the observer where parameters are computed (qt.init_stats(spec, "
                             "observer=...), qt.choose_qparams(x, spec, observer=...) or the 'rtn' step's "
                             "options)")
        if unknown:
            raise ValueError(f"QuantSpec.from_dict: unknown field(s) {unknown}; known: {sorted(known)}")
        if "format" not in d:
            raise ValueError("QuantSpec.from_dict: missing required field 'format'")
        d = dict(d)
        if d.get("granularity") is not None:
            d["granularity"] = granularity_from_dict(d["granularity"])
        return cls(**d)

    def __str__(self) -> str:
        g = self.granularity
        gtxt = {PerTensor: lambda: "tensor", PerChannel: lambda: f"channel(axis={g.axis})",
                PerGroup: lambda: f"g{g.size}" + ("" if g.axis == -1 else f"(axis={g.axis})"),
                PerBlock: lambda: "block" + "x".join(map(str, g.shape))}[type(g)]()
        sym = "sym" if self.symmetric else f"asym({self.zero_point_domain} zp)"
        return f"{self.format} {gtxt} {sym}"


def _choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"QuantSpec.{name} must be one of {list(allowed)}, got {value!r}")

"""Minifloat formats: the :func:`minifloat` factory and the built-in fp8, fp6 and fp4 formats.

The element codec is :class:`~qtransform.formats.minifloat_codec.MinifloatCodec`; a format adds its
scaling rules (symmetric, per tensor with a float32 scale ``amax / max_value`` unless told
otherwise). A new minifloat is one line and is property-tested like the built-ins:

>>> import qtransform as qt
>>> f = qt.minifloat("fp8_e3m4_demo", exponent_bits=3, mantissa_bits=4)
>>> f.codec.max_value, f.codec.emin, f.family
(31.0, -2, 'float')
"""

from __future__ import annotations

import torch

from .base import Format, register_format
from .minifloat_codec import MinifloatCodec

__all__ = ["minifloat"]


def minifloat(name: str, *, exponent_bits: int, mantissa_bits: int, bias: int | None = None,
              special: str = "none", storage: torch.dtype | None = None, description: str = "",
              **format_options) -> Format:
    """A :class:`Format` for a minifloat element type (register it with ``register_format``).

    Args:
        name: registry name.
        exponent_bits, mantissa_bits, bias, special, storage: see :class:`MinifloatCodec`.
        description: one line for listings.
        **format_options: other :class:`Format` fields (``default_granularity``, ``scale_dtypes``...).

    The format is symmetric (no zero point), per tensor with a float32 scale
    ``amax / max_value`` unless told otherwise.
    """
    codec = MinifloatCodec(exponent_bits, mantissa_bits, bias, special, storage)
    options = {"family": "float", "symmetric_only": True, **format_options}
    desc = description or f"minifloat e{exponent_bits}m{mantissa_bits}, bias {codec.bias}, special={special}"
    return Format(name=name, codec=codec, description=desc, **options)


_BUILTINS = (
    # name, e, m, bias, special, storage, description
    ("fp8_e4m3", 4, 3, 7, "fn", torch.float8_e4m3fn, "OCP FP8 E4M3 (e4m3fn), max 448, NaN only"),
    ("fp8_e5m2", 5, 2, 15, "ieee", torch.float8_e5m2, "OCP FP8 E5M2, max 57344, Inf and NaN"),
    ("fp8_e4m3fnuz", 4, 3, 8, "fnuz", torch.float8_e4m3fnuz, "FP8 E4M3 FNUZ (AMD MI300), max 240"),
    ("fp8_e5m2fnuz", 5, 2, 16, "fnuz", torch.float8_e5m2fnuz, "FP8 E5M2 FNUZ (AMD MI300), max 57344"),
    ("fp6_e3m2", 3, 2, 3, "none", None, "OCP FP6 E3M2, max 28"),
    ("fp6_e2m3", 2, 3, 1, "none", None, "OCP FP6 E2M3, max 7.5"),
    ("fp4_e2m1", 2, 1, 1, "none", None, "OCP FP4 E2M1, values ±{0, .5, 1, 1.5, 2, 3, 4, 6}"),
)

for _name, _e, _m, _bias, _special, _storage, _desc in _BUILTINS:
    register_format(minifloat(_name, exponent_bits=_e, mantissa_bits=_m, bias=_bias, special=_special,
                              storage=_storage, description=_desc))

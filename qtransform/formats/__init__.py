"""Number formats: how numbers are stored. A codec and its scaling scheme per family, the
registry, and bit packing. Importing this package registers the built-ins.

This package imports nothing of ``qtransform.spec``: a scheme reads the spec it is handed.
"""

from .base import FORMATS, Codec, Format, get_format, register_format
from . import int as _int  # noqa: F401  (registers int1..int8, uint1..uint8)
from . import codebook as _codebook  # noqa: F401  (registers nf4)
from . import floats as _floats  # noqa: F401  (registers fp8/fp6/fp4 minifloats)
from . import casts as _casts  # noqa: F401  (registers bf16, fp16)
from . import mx as _mx  # noqa: F401  (registers the OCP MX formats)
from . import shared_exp as _shared_exp  # noqa: F401  (registers mx4, mx6, mx9, bfp16)
from . import nvfp4 as _nvfp4  # noqa: F401  (registers nvfp4)
from .int import IntCodec
from .codebook import CodebookCodec, NF4_VALUES
from .minifloat_codec import MinifloatCodec
from .floats import minifloat
from .mx import FixedPointCodec, mx_format
from .shared_exp import SymmetricIntCodec
from .packing import AWQ_ORDER, pack, unpack
from .scaling import (AFFINE, SCALE_DTYPES, UNIT, AffineScheme, Scheme, UnitScheme, check_e8m0,
                      to_e8m0)

__all__ = ["FORMATS", "Codec", "Format", "get_format", "register_format", "IntCodec",
           "CodebookCodec", "NF4_VALUES", "MinifloatCodec", "minifloat",
           "FixedPointCodec", "mx_format", "SymmetricIntCodec", "AWQ_ORDER", "pack", "unpack",
           "Scheme", "AffineScheme", "UnitScheme", "AFFINE", "UNIT", "SCALE_DTYPES", "check_e8m0", "to_e8m0"]

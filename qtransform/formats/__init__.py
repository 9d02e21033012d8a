"""Number formats and their registry. Importing this package registers the built-ins."""

from .base import FORMATS, Codec, Format, get_format, register_format
from . import int as _int  # noqa: F401  (registers int1..int8, uint1..uint8)
from . import codebook as _codebook  # noqa: F401  (registers nf4)
from .int import IntCodec
from .codebook import CodebookCodec, NF4_VALUES

__all__ = ["FORMATS", "Codec", "Format", "get_format", "register_format", "IntCodec",
           "CodebookCodec", "NF4_VALUES"]

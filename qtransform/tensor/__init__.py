"""Quantized tensors: ``QParams`` / ``QTensor``, quantize / dequantize / fake_quantize, block
views of every granularity, round-trip error bounds and storage footprints."""

from .types import QParams, QTensor
from .quantize import dequantize, element_range, fake_quantize, quantize, roundtrip_blocks, unpacked_codes
from .bounds import error_bound
from .footprint import bits_per_element
from .transpose import transposed_qparams
from .conform import conform_qparams
from . import stacked

__all__ = ["QParams", "QTensor", "quantize", "dequantize", "fake_quantize", "unpacked_codes", "element_range",
           "roundtrip_blocks", "error_bound", "bits_per_element", "transposed_qparams", "stacked",
           "conform_qparams"]

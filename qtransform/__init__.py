"""qtransform: quantization as pure functions over tensors and parameter trees.

>>> import torch, qtransform as qt
>>> w = torch.randn(64, 256)
>>> spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(128), symmetric=False)
>>> qp = qt.compute_qparams(qt.observe(qt.init_stats(spec), w), spec)
>>> q = qt.quantize(w, qp)
>>> qt.dequantize(q).shape, q.codes.dtype, q.codes.shape
(torch.Size([64, 256]), torch.uint8, torch.Size([64, 128]))
"""

from .formats import FORMATS, Codec, Format, get_format, minifloat, mx_format, register_format
from .granularity import PerBlock, PerChannel, PerGroup, PerTensor
from .spec import QuantSpec
from .qtypes import HistogramStats, MinMaxStats, QParams, QTensor
from .observe import init_stats, merge_stats, observe
from .qparams import choose_qparams, compute_qparams
from .quantize import dequantize, fake_quantize, quantize, unpacked_codes
from .bounds import error_bound
from .footprint import bits_per_element
from .packing import pack, unpack
from .recipe import Match, Recipe, as_recipe
from .presets import Preset, from_hqq_config, get_preset, presets, recipe_from_dict
from .tree import (dequantize_tree, is_qtensor, merge_stats_tree, observe_tree, qparams_tree,
                   quantize_tree)

__version__ = "0.1.0"

__all__ = [
    "FORMATS", "Codec", "Format", "get_format", "register_format", "minifloat", "mx_format",
    "PerBlock", "PerChannel", "PerGroup", "PerTensor", "QuantSpec",
    "HistogramStats", "MinMaxStats", "QParams", "QTensor",
    "init_stats", "merge_stats", "observe", "choose_qparams", "compute_qparams",
    "dequantize", "fake_quantize", "quantize", "unpacked_codes", "error_bound", "bits_per_element", "pack", "unpack",
    "Match", "Recipe", "as_recipe", "Preset", "from_hqq_config", "get_preset", "presets", "recipe_from_dict",
    "dequantize_tree", "is_qtensor", "merge_stats_tree", "observe_tree", "qparams_tree", "quantize_tree",
]

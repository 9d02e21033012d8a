"""qtransform: quantization as pure functions over tensors and parameter trees.

>>> import torch, qtransform as qt
>>> w = torch.randn(64, 256)
>>> spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(128), symmetric=False)
>>> qp = qt.compute_qparams(qt.observe(qt.init_stats(spec), w), spec)
>>> q = qt.quantize(w, qp)
>>> qt.dequantize(q).shape, q.codes.dtype, q.codes.shape
(torch.Size([64, 256]), torch.uint8, torch.Size([64, 128]))

The packages follow the data flow: ``formats`` (how numbers are stored) -> ``spec`` (what to
quantize: QuantSpec, Recipe, Plan) -> ``tensor`` (QParams/QTensor, quantize) -> ``observers``
(statistics) -> ``algorithms`` (steps: new weights and quantization parameters) ->
``pipeline`` (steps in order, presets, recipe files) -> ``tree`` (whole parameter trees);
``rotation`` (Hadamard and orthogonal matrices) and ``fold_norm`` (BatchNorm folded into the conv or linear
before it: ``fold_norms``) stand beside them.
"""

from .registry import Registry
from ._checks import data_checks
from .formats import FORMATS, Codec, Format, get_format, minifloat, mx_format, pack, register_format, unpack
from .granularity import PerBlock, PerChannel, PerGroup, PerTensor
from .spec import (Match, Plan, QuantSpec, Recipe, Site, Step, as_plan, as_recipe, module_of, transposed_spec,
                   stacked_spec, matrix_spec)
from .tensor import (QParams, QTensor, bits_per_element, conform_qparams, dequantize, error_bound, fake_quantize, quantize,
                     stacked, transposed_qparams, unpacked_codes)
from .observers import (OBSERVERS, HistogramStats, MinMaxStats, Observer, choose_qparams, compute_qparams,
                        finalize_stats, init_stats, make_observer, merge_stats, observe, register_observer)
from .algorithms import (ALGORITHMS, Algorithm, Block, BlockInputs, Context, Fit, LowRank, ModelLoss, SiteStats, apply_fit,
                         check_algorithm_options, get_algorithm, register_algorithm, OUTPUT_KINDS, OutputKind,
                         register_output_kind)
from .pipeline import (PRESETS, Calibrator, Preset, activation_quantizers, check_activation_spec, check_steps,
                       from_hqq_config, get_preset, presets, recipe_from_dict, register_preset,
                       run_steps)
from .parallel import SERIAL, Parallel
from .rotation import OnlineRotation, hadamard, hadamard_transform, orthogonal, rotate
from . import learn
from .fold_norm import NormFold, fold_norms
from .tree import (dequantize_tree, flatten_tree, is_qtensor, merge_stats_tree, observe_tree, qparams_tree,
                   quantize_tree)

__version__ = "0.3.0"

__all__ = [
    "Registry", "data_checks",
    "FORMATS", "Codec", "Format", "get_format", "register_format", "minifloat", "mx_format", "pack", "unpack",
    "PerBlock", "PerChannel", "PerGroup", "PerTensor",
    "QuantSpec", "Recipe", "Step", "Plan", "Match", "Site", "as_plan", "as_recipe", "module_of", "transposed_spec", "transposed_qparams",
    "stacked_spec", "matrix_spec", "stacked",
    "QParams", "QTensor", "conform_qparams", "quantize", "dequantize", "fake_quantize", "unpacked_codes", "error_bound",
    "bits_per_element",
    "OBSERVERS", "Observer", "register_observer", "make_observer", "init_stats", "observe", "merge_stats",
    "finalize_stats", "compute_qparams", "choose_qparams", "MinMaxStats", "HistogramStats",
    "activation_quantizers", "check_activation_spec", "ALGORITHMS", "Algorithm", "Block", "BlockInputs", "Context", "Fit", "LowRank", "ModelLoss", "SiteStats", "apply_fit", "check_algorithm_options",
    "get_algorithm", "register_algorithm", "OUTPUT_KINDS", "OutputKind", "register_output_kind", "Parallel", "SERIAL",
    "PRESETS", "Preset", "Calibrator", "check_steps", "run_steps", "from_hqq_config", "get_preset", "presets",
    "recipe_from_dict", "register_preset",
    "hadamard", "hadamard_transform", "orthogonal", "rotate", "OnlineRotation",
    "dequantize_tree", "flatten_tree", "is_qtensor", "merge_stats_tree", "observe_tree", "qparams_tree",
    "quantize_tree", "learn", "NormFold", "fold_norms",
]

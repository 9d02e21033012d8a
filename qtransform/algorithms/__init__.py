"""Algorithms: pure steps from weights (and statistics) to new weights and quantization parameters.

``ALGORITHMS`` names them for recipes, recipe files, the command line and quantize-on-load
(:mod:`.base` has the contract). Built-ins: ``rtn`` (round to nearest with a chosen observer),
``hqq`` (half-quadratic optimization, calibration-free) and ``smoothquant`` (activation outliers
folded into the weights, block by block on calibration data; :mod:`.smoothing` has the groups),
``gptq``, ``awq`` (activation-aware scales and clipping), ``rotate`` (QuaRot's rotations) and
``spinquant`` (rotations learned on the quantized model's loss).
"""

from .base import (ALGORITHMS, Algorithm, Block, BlockInputs, Context, Fit, ModelLoss, SiteStats, apply_fit, batch_tokens,
                   check_algorithm_options, get_algorithm, register_algorithm)
from . import rtn, hqq, smoothing, smoothquant, gptq_solver, gptq, awq_search, awq, rotate, spinquant

__all__ = ["ALGORITHMS", "Algorithm", "Block", "BlockInputs", "ModelLoss", "batch_tokens", "Context", "Fit", "SiteStats", "apply_fit", "check_algorithm_options",
           "get_algorithm", "register_algorithm", "rtn", "hqq", "smoothing", "smoothquant", "gptq_solver", "gptq",
           "awq_search", "awq", "rotate", "spinquant"]

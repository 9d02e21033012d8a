"""Algorithms: pure steps from weights (and statistics) to new weights and quantization parameters.

``ALGORITHMS`` names them for recipes, recipe files, the command line and quantize-on-load
(:mod:`.base` has the contract). Built-ins: ``rtn`` (round to nearest with a chosen observer)
and ``hqq`` (half-quadratic optimization, calibration-free).
"""

from .base import (ALGORITHMS, Algorithm, Block, BlockInputs, Context, Fit, SiteStats, apply_fit,
                   check_algorithm_options, get_algorithm, register_algorithm)
from . import rtn, hqq

__all__ = ["ALGORITHMS", "Algorithm", "Block", "BlockInputs", "Context", "Fit", "SiteStats", "apply_fit", "check_algorithm_options",
           "get_algorithm", "register_algorithm", "rtn", "hqq"]

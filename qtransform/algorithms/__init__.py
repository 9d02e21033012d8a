"""Algorithms that compute quantization parameters: pure math over tensors and trees.

Each returns ordinary :class:`~qtransform.QParams` (by path, for whole trees) that
``qt.quantize_tree(params, recipe, qparams=...)`` accepts. ``ALGORITHMS`` names them
for recipes and the command line.
"""

from . import hqq
from .registry import ALGORITHMS, check_algorithm_options, get_algorithm, register_algorithm, rtn_qparams_tree

__all__ = ["hqq", "ALGORITHMS", "check_algorithm_options", "get_algorithm", "register_algorithm",
           "rtn_qparams_tree"]

"""Algorithms: pure steps from weights (and statistics) to new weights and quantization parameters.

``ALGORITHMS`` names them for recipes, recipe files, the command line and quantize-on-load
(:mod:`.base` has the contract). Built-ins: ``rtn`` (round to nearest with a chosen observer),
``hqq`` (half-quadratic optimization, calibration-free), ``smoothquant`` (activation outliers
folded into the weights, block by block on calibration data), ``gptq``, ``awq`` (activation-aware
scales and clipping), ``rotate`` (QuaRot's rotations), ``spinquant`` (rotations learned on the
quantized model's loss), ``signround`` (AutoRound: rounding and clipping learned by signed gradient descent),
``qat`` (quantization-aware training block by block: weights and learned ranges, EfficientQAT's Block-AP)
and ``lowrank`` (rank-r corrections of the quantization error, EoRA). What a step returns beside tensors and
quantization parameters is a registered kind of step output (:mod:`.outputs`: ``lowrank``'s corrections).

The convention, one for every algorithm:

* ``<name>.py`` is the registered step ``<name>``: its module docstring explains the method and
  its options, its entry point is the function ``step`` (``fn(params, plan, *, context, options)
  -> Fit``, ``options`` an instance of the module's ``Options`` dataclass, where the defaults live),
  registered at the bottom of the module with ``register_algorithm("<name>", step, options=Options, ...)``;
* ``<name>_math.py`` beside it holds the step's tensor-level math (pure functions over tensors and
  specs: ``gptq_math``, ``awq_math``, ``smoothquant_math``, ``hqq_math``); a math module never imports
  a step module (math imports math: ``gptq_math`` and ``awq_math`` use ``hqq_math``);
* math that several steps share has a plain name: :mod:`.smoothing` (smoothing groups and their folds:
  ``smoothquant``, ``awq``), :mod:`.clip_search` (clipping ranges: ``awq``, ``gptq``); the rotations'
  math (Hadamard matrices, the residual-stream rotation of a tree, online rotations) is its own package,
  :mod:`qtransform.rotation`, read by ``rotate`` and ``spinquant``; ``rtn`` needs none beyond
  :mod:`qtransform.observers`.
"""

from .base import (ALGORITHMS, Algorithm, Block, BlockInputs, Context, Fit, ModelLoss, SiteStats, apply_fit,
                   check_algorithm_options, get_algorithm, register_algorithm)
from .lowrank_math import LowRank
from .outputs import OUTPUT_KINDS, OutputKind, register_output_kind
from . import (outputs, rtn, hqq_math, hqq, smoothing, smoothquant_math, smoothquant, gptq_math, gptq, awq_math, awq, rotate,
               spinquant, signround_math, signround, lowrank_math, lowrank, block_training, qat)

__all__ = ["LowRank", "OUTPUT_KINDS", "OutputKind", "register_output_kind", "outputs", "ALGORITHMS", "Algorithm", "Block", "BlockInputs", "ModelLoss", "Context", "Fit", "SiteStats",
           "apply_fit", "check_algorithm_options", "get_algorithm", "register_algorithm", "rtn", "hqq_math", "hqq",
           "smoothing", "smoothquant_math", "smoothquant", "gptq_math", "gptq", "awq_math", "awq", "rotate",
           "spinquant", "signround_math", "signround", "lowrank_math", "lowrank", "block_training", "qat"]

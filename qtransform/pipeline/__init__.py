"""The pipeline: a recipe's steps run in order (``run_steps``), named presets, recipe files."""

from .run import Calibrator, check_steps, run_steps
from .activations import activation_quantizers, check_activation_spec
from .presets import (DEFAULT_EXCLUDE, LINEAR_TYPES, PRESETS, Preset, get_preset, hqq_spec,
                      linear_recipe, presets, register_preset)
from .recipe_files import from_hqq_config, recipe_from_dict
from .parts import block_by_block_refusal, rotates_block_by_block, tensor_by_tensor

__all__ = ["Calibrator", "check_steps", "run_steps", "activation_quantizers", "check_activation_spec", "Preset",
           "PRESETS", "register_preset", "presets", "get_preset", "hqq_spec", "linear_recipe",
           "LINEAR_TYPES", "DEFAULT_EXCLUDE", "from_hqq_config", "recipe_from_dict",
           "tensor_by_tensor", "rotates_block_by_block", "block_by_block_refusal"]

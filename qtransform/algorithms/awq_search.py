"""Moved: AWQ's scale search lives in :mod:`qtransform.algorithms.awq_math` now (this module re-exports it
for one version)."""

from .awq_math import (QUANTIZERS, ScaleChoice, candidate_scales, input_mean, quantize_weight, scaled_weights,
                       search_scales, weight_mean)

__all__ = ["QUANTIZERS", "candidate_scales", "weight_mean", "input_mean", "quantize_weight", "scaled_weights",
           "ScaleChoice", "search_scales"]

"""Calibration: forward passes over calibration data that fold the statistics the pipeline's steps
ask for (hooks on named activation sites), or hand a step one block at a time with its inputs."""

from .sites import evaluating, first_tensor, fold_sites, run_batch, untied
from .blocks import blockwise, capture_inputs, find_blocks
from .calibrator import ModelCalibrator

__all__ = ["ModelCalibrator", "evaluating", "first_tensor", "fold_sites", "run_batch", "untied", "blockwise",
           "capture_inputs", "find_blocks"]

"""Calibration: forward passes over calibration data that fold the statistics the pipeline's steps
ask for (hooks on named activation sites)."""

from .sites import ModelCalibrator, first_tensor, run_batch

__all__ = ["ModelCalibrator", "first_tensor", "run_batch"]

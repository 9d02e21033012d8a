"""Quantizing checkpoints larger than memory: shard to shard for steps without data, block by block for
the others, resumable, with the block being calibrated on any device (:func:`quantize_checkpoint`)."""

from .driver import quantize_checkpoint
from .source import Source

__all__ = ["quantize_checkpoint", "Source"]

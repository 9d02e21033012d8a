"""Checks of quantized tensors that need no data: a :class:`~qtransform.QTensor`'s parts fit
together, and an output dtype is a floating dtype.

>>> import torch
>>> from qtransform.tensor.checks import check_out_dtype
>>> check_out_dtype(torch.int32, name="dequantize: dtype")
Traceback (most recent call last):
...
TypeError: dequantize: dtype must be a floating-point torch.dtype (torch.float32, torch.bfloat16, ...), got torch.int32
"""

from __future__ import annotations

import torch

from . import blocks

__all__ = ["check_out_dtype", "check_qtensor"]


def check_out_dtype(dtype, *, name: str) -> None:
    """Raise ``TypeError`` unless ``dtype`` is a real floating-point ``torch.dtype``."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype (e.g. torch.float16, not the string 'float16'), "
                        f"got {type(dtype).__name__} {dtype!r}")
    if not dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point torch.dtype (torch.float32, torch.bfloat16, ...), "
                        f"got {dtype}")


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def check_qtensor(codes, qparams, width, dtype) -> None:
    """Raise ``TypeError``/``ValueError`` naming the field unless ``codes`` (storage form),
    ``width`` (logical last axis), ``dtype`` and ``qparams`` (a QParams: grid-shaped) belong together."""
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"QTensor: codes must be a torch.Tensor, got {type(codes).__name__}")
    if isinstance(width, bool) or not isinstance(width, (int, torch.SymInt)) or width < 1:
        raise ValueError(f"QTensor: width (the logical size of the last axis) must be a positive int, got {width!r}")
    check_out_dtype(dtype, name="QTensor: dtype")
    spec = qparams.spec
    codec = spec.fmt.codec
    stored = torch.uint8 if codec.packed else codec.code_dtype
    if codes.dtype != stored:
        raise TypeError(f"QTensor: codes of {spec.format} are stored as {stored}, got {codes.dtype}")
    if codes.dim() == 0:
        raise ValueError("QTensor: codes must have at least one dimension, got a 0-d tensor")
    last = -(-width * codec.bits // 8) if codec.packed else width
    if codes.shape[-1] != last:
        what = f"{last} bytes of packed {codec.bits}-bit codes" if codec.packed else f"{last} codes"
        raise ValueError(f"QTensor: codes of shape {_shape(codes)} do not fit width={width}: the last axis "
                         f"must hold {what}")
    shape = (*codes.shape[:-1], width)
    try:
        grid = blocks.tiling(shape, spec).grid  # stored per block (MX4/6/9 decode per sub-block)
    except ValueError as e:
        raise ValueError(f"QTensor: codes of logical shape {shape}: {e}") from None
    for name in ("scale", "zero_point"):
        t = getattr(qparams, name)
        if t is not None and _shape(t) != grid:
            raise ValueError(f"QTensor: qparams.{name} has shape {_shape(t)}, but codes of logical shape {shape} "
                             f"under {spec} need the grid {grid}")

"""Storage cost of a spec: bits per element, scales, zero points and micro-exponents included.

``bits_per_element(spec, shape)`` is exactly ``8 * quantize(x, qp).nbytes() / x.numel()`` for
any ``x`` of that shape (codes in their packed container, plus every tensor of the
``QParams``). Without a shape it is the figure the format is known by: element bits plus
the per-block overheads, for a tensor large enough that per-tensor and per-channel
parameters vanish (MXFP4 4.25, NVFP4 4.5, MX6 6, int4 with groups of 128 and float32
scales and zero points... 4.3125).

>>> import qtransform as qt
>>> qt.bits_per_element(qt.QuantSpec(format="mxfp4")), qt.bits_per_element(qt.QuantSpec(format="mx9"))
(4.25, 9.0)
>>> qt.bits_per_element(qt.QuantSpec(format="nvfp4"), (128, 64))  # + 32 bits of tensor scale
4.50390625
"""

from __future__ import annotations

import math

import torch

from ..granularity import PerBlock, PerGroup
from ..spec import QuantSpec
from . import blocks
from .types import QParams

__all__ = ["bits_per_element"]


def _param_bytes(spec: QuantSpec, shape: tuple[int, ...], *, per_tensor: bool) -> int:
    """Bytes of the QParams ``spec`` makes for a tensor of ``shape`` (computed on an empty range)."""
    grid = blocks.tiling(shape, spec, sub_block=True).grid
    zeros = torch.zeros(grid, dtype=torch.float32, device="cpu")  # real data, even under a meta default device
    qp = QParams.from_range(zeros, zeros, spec)
    return sum(t.numel() * t.element_size() for name, t in qp.tensors().items()
               if per_tensor or name != "global_scale")


def _code_bytes(spec: QuantSpec, shape: tuple[int, ...]) -> int:
    codec = spec.fmt.codec
    rows, width = math.prod(shape[:-1]), shape[-1]
    if codec.packed:
        return rows * -(-width * codec.bits // 8)
    return rows * width * torch.empty((), dtype=codec.code_dtype).element_size()


def _nominal_shape(spec: QuantSpec) -> tuple[int, ...] | None:
    """A shape tiled by whole blocks (8 per axis), or None for per-tensor/per-channel specs."""
    g = spec.granularity
    if isinstance(g, PerGroup):
        return (8, 8 * g.size) if g.axis in (-1, 1) else (8 * g.size, 8)
    if isinstance(g, PerBlock):
        return tuple(8 * b for b in g.shape)
    return None


def bits_per_element(spec: QuantSpec, shape=None) -> float:
    """Storage bits per element of ``spec``.

    Args:
        spec: the quantization spec.
        shape: tensor shape. Given, the exact figure for that shape (padding of the last packed
            byte and of partial blocks included, per-tensor scales spread over its elements).
            Omitted, the nominal figure: element bits plus per-block overhead (0 for per-tensor
            and per-channel scales, and for NVFP4's one tensor scale).

    Returns:
        Bits per element as a float.
    """
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"bits_per_element: spec must be a QuantSpec, got {type(spec).__name__}")
    if shape is None:
        nominal = _nominal_shape(spec)
        if nominal is None:
            return float(spec.fmt.codec.bits)
        return spec.fmt.codec.bits + 8.0 * _param_bytes(spec, nominal, per_tensor=False) / math.prod(nominal)
    shape = tuple(int(n) for n in shape)
    if not shape or any(n < 1 for n in shape):
        raise ValueError(f"bits_per_element: shape must be a non-empty tuple of positive sizes, got {shape}")
    total = _code_bytes(spec, shape) + _param_bytes(spec, shape, per_tensor=True)
    return 8.0 * total / math.prod(shape)

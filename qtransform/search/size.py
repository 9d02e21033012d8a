"""Bytes of a weight under a spec, as a quantized tensor stores them.

``tensor_bytes(spec, shape)`` is ``quantize(x, qparams).nbytes()`` for any ``x`` of ``shape``: the codes in
their packed container plus every tensor of the ``QParams`` (scales, zero points, micro-exponents, a global
scale), from :func:`qtransform.bits_per_element`, the one place that counts them. ``budget_bytes`` turns a
budget in bits per weight into bytes over a set of weights.

>>> import qtransform as qt
>>> spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(128))
>>> tensor_bytes(spec, (64, 256))  # 64 * 128 bytes of codes + 64 * 2 float32 scales
8704
>>> budget_bytes(4.25, [(64, 256)])
8704
"""

from __future__ import annotations

import math
from typing import Iterable

from ..spec import QuantSpec
from ..tensor import bits_per_element

__all__ = ["tensor_bytes", "budget_bytes"]


def _shape(shape, where: str) -> tuple[int, ...]:
    try:
        out = tuple(int(n) for n in shape)
    except TypeError:
        raise TypeError(f"{where}: shape must be a tuple of ints, got {shape!r}") from None
    if not out or any(n < 1 for n in out):
        raise ValueError(f"{where}: shape must be a non-empty tuple of positive sizes, got {out}")
    return out


def tensor_bytes(spec: QuantSpec, shape) -> int:
    """Stored bytes of a tensor of ``shape`` quantized with ``spec`` (codes and all its ``QParams``).

    Args:
        spec: the weight's spec.
        shape: the tensor's shape (the logical layout its spec is written for).

    Returns:
        The exact byte count (an int).
    """
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"tensor_bytes: spec must be a QuantSpec, got {type(spec).__name__}")
    shape = _shape(shape, "tensor_bytes")
    bits = bits_per_element(spec, shape) * math.prod(shape)  # 8 * bytes, up to rounding of the division
    return int(round(bits / 8))


def budget_bytes(bits_per_weight: float, shapes: Iterable) -> int:
    """The byte budget of ``bits_per_weight`` over tensors of ``shapes`` (rounded down).

    Raises:
        ValueError: naming ``budget`` when it is not a positive finite number.
    """
    if isinstance(bits_per_weight, bool) or not isinstance(bits_per_weight, (int, float)) \
            or not 0 < bits_per_weight < float("inf"):
        raise ValueError(f"budget must be a positive number of bits per weight, got {bits_per_weight!r}")
    total = sum(math.prod(_shape(s, "budget_bytes")) for s in shapes)
    return int(math.floor(bits_per_weight * total / 8 + 1e-9))

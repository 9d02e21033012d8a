"""Stacked matrices: the spec of a tensor that holds one matrix per index of its leading axis.

A mixture-of-experts layer stores its experts as one tensor ``(experts, out, in)`` (transformers 5's
``gate_up_proj``/``down_proj``). A recipe speaks of each expert's *matrix*: ``PerChannel(0)`` is one
scale per output feature of each expert, ``PerGroup(32)`` groups 32 input features of each expert,
``PerTensor()`` is one scale per expert. :func:`stacked_spec` turns such a matrix spec into the spec of
the stacked tensor (the leading axis a batch axis: block size 1 along it), and :func:`matrix_spec`
turns it back into the spec of one matrix. Both are shape-only and exact:
``quantize(w3, stacked)[e] == quantize(w3[e], matrix)`` codes and scales alike.

==================================  =========================  ====================
matrix spec (of ``(a, b)``)         stacked ``(E, a, b)``      block
==================================  =========================  ====================
``PerTensor()``                     ``PerChannel(0)``          ``(1, a, b)``
``PerChannel(0)``                   ``PerBlock((1, 1))``       ``(1, 1, b)``
``PerChannel(1)``                   ``PerBlock((1, a, 1))``    ``(1, a, 1)``
``PerGroup(g, axis=-1 | 0)``        ``PerGroup(g, -1 | -2)``   ``(1, 1, g)``
``PerBlock((r, c))``                ``PerBlock((1, r, c))``    ``(1, r, c)``
==================================  =========================  ====================

>>> import qtransform as qt
>>> s = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
>>> str(stacked_spec(s, (8, 16, 32)).granularity), matrix_spec(stacked_spec(s, (8, 16, 32)), (8, 16, 32)) == s
('PerBlock(shape=(1, 1))', True)
"""

from __future__ import annotations

import dataclasses

from ..granularity import PerBlock, PerChannel, PerGroup, PerTensor
from .quantspec import QuantSpec

__all__ = ["stacked_spec", "matrix_spec"]


def _shape3(shape, what: str) -> tuple[int, int, int]:
    shape = tuple(int(n) for n in shape)
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"{what}: expected the shape of stacked matrices (stack, rows, cols), got {shape}")
    return shape


def stacked_spec(spec: QuantSpec, shape) -> QuantSpec:
    """The spec of a stacked ``(n, a, b)`` tensor that quantizes each ``(a, b)`` matrix as ``spec`` does.

    ``ValueError`` when ``spec``'s granularity does not fit a matrix of ``(a, b)`` (a group axis beyond
    2-D, a 3-D block)."""
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"stacked_spec: spec must be a QuantSpec, got {type(spec).__name__}")
    _, a, b = _shape3(shape, "stacked_spec")
    g = spec.granularity
    if isinstance(g, PerTensor):
        lifted = PerChannel(0)
    elif isinstance(g, PerChannel) and g.axis in (0, -2, 1, -1):
        lifted = PerBlock((1, 1)) if g.axis in (0, -2) else PerBlock((1, a, 1))
    elif isinstance(g, PerGroup) and g.axis in (0, -2, 1, -1):
        lifted = PerGroup(g.size, axis=-1 if g.axis in (1, -1) else -2)
    elif isinstance(g, PerBlock) and len(g.shape) <= 2:
        lifted = PerBlock((1,) + tuple(g.shape))
    else:
        raise ValueError(f"stacked_spec: {g} does not describe a matrix of shape ({a}, {b}); give each "
                         "stacked matrix a 2-D granularity")
    return dataclasses.replace(spec, granularity=lifted)


def matrix_spec(spec: QuantSpec, shape) -> QuantSpec:
    """The spec of one ``(a, b)`` matrix of a stacked ``(n, a, b)`` tensor quantized with ``spec``, with the
    plainest granularity that tiles it so (inverse of :func:`stacked_spec` up to that choice).

    ``ValueError`` when ``spec`` shares a scale across matrices (a block longer than 1 on the stack axis)."""
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"matrix_spec: spec must be a QuantSpec, got {type(spec).__name__}")
    _, a, b = _shape3(shape, "matrix_spec")
    g = spec.granularity
    block = g.block_size((1, a, b) if isinstance(g, PerTensor) else tuple(shape))
    if isinstance(g, PerTensor) or block[0] != 1:
        raise ValueError(f"matrix_spec: {g} shares scales across the stacked matrices of shape {tuple(shape)}; "
                         "each matrix needs its own (a block of 1 along the stack axis)")
    if isinstance(g, PerGroup):
        return dataclasses.replace(spec, granularity=PerGroup(g.size, axis=g.axis - 3 if g.axis >= 0 else g.axis))
    rows, cols = block[1], block[2]
    if (rows, cols) == (a, b):
        mg = PerTensor()
    elif (rows, cols) == (1, b):
        mg = PerChannel(0)
    elif (rows, cols) == (a, 1):
        mg = PerChannel(1)
    else:
        mg = PerBlock((rows, cols))
    return dataclasses.replace(spec, granularity=mg)

"""``transposed_spec``: the spec of a 2-D weight stored transposed (GPT-2's ``Conv1D`` keeps (in, out)).

>>> import qtransform as qt
>>> spec = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
>>> str(transposed_spec(spec, (32, 64)).granularity)
'PerChannel(axis=1)'
"""

from __future__ import annotations

import dataclasses

from ..granularity import PerBlock, PerChannel, PerGroup
from .quantspec import QuantSpec

__all__ = ["transposed_spec"]


def _other_axis(axis: int) -> int | None:
    return {0: 1, -2: 1, 1: 0, -1: 0}.get(axis)


def transposed_spec(spec: QuantSpec, shape: tuple[int, ...]) -> QuantSpec:
    """The spec that quantizes ``w.T`` as ``spec`` quantizes the 2-D ``w`` of ``shape`` (axes swapped):
    ``dequantize(quantize(w.T, transposed)) == dequantize(quantize(w, spec)).T``. A granularity that
    does not fit a 2-D tensor is returned as it is (the shape check names it). Its own inverse."""
    g = spec.granularity
    if isinstance(g, PerChannel) and _other_axis(g.axis) is not None:
        g = PerChannel(_other_axis(g.axis))
    elif isinstance(g, PerGroup) and _other_axis(g.axis) is not None:
        g = PerGroup(g.size, axis=-1 if _other_axis(g.axis) == 1 else 0)
    elif isinstance(g, PerBlock) and len(g.shape) <= 2 and len(shape) == 2:
        rows, cols = g.block_size(tuple(shape))
        g = PerBlock((cols, rows))
    else:
        return spec
    return dataclasses.replace(spec, granularity=g)

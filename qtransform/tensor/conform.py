"""Quantization parameters checked against what their spec stores: the fields, grid shapes and dtypes a
checkpoint holds for them. Parameters made by hand or learned (a float32 scale for a spec that stores float16, a
fractional zero point where the spec stores integer codes) are cast where the cast is exact and refused, naming the
tree path, where it is not: what a step returns can always be saved and reloaded as it ran.

>>> import torch, qtransform as qt
>>> spec = qt.QuantSpec(format="uint4", granularity=qt.PerChannel(0), symmetric=False, scale_dtype="float16")
>>> qp = qt.QParams(scale=torch.tensor([[0.5]]), zero_point=torch.tensor([[3.0]]), spec=spec)
>>> conform_qparams(qp, (1, 8), path="fc.weight")
QParams(uint4 channel(axis=0) asym(int zp); scale=(1, 1):float16, zero_point=(1, 1):uint8)
>>> conform_qparams(qt.QParams(scale=torch.tensor([[0.1]]), zero_point=torch.tensor([[3.0]]), spec=spec), (1, 8),
...                 path="fc.weight")
Traceback (most recent call last):
...
ValueError: fc.weight: qparams.scale is float32 and not exactly representable as the float16 that uint4 channel(axis=0) asym(int zp) stores (first differing value 0.1 at index (0, 0)); round it where it is made (qtransform.learn.to_qparams)
"""

from __future__ import annotations

import torch

from .._checks import where
from ..spec import QuantSpec
from . import blocks
from .types import QParams

__all__ = ["conform_qparams"]


def _reference(shape, spec: QuantSpec) -> QParams:
    """What the format stores for a tensor of ``shape`` (zero ranges: fields, grid shapes and dtypes only)."""
    grid = blocks.tiling(tuple(shape), spec, sub_block=True).grid
    zero = torch.zeros(grid, dtype=torch.float32)
    return QParams.from_range(zero, zero, spec)


def _exact(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, tuple | None]:
    """``t`` cast to ``dtype`` and the index of the first value the cast changes (``None``: exact)."""
    cast = t.detach().to(dtype)
    back = cast.to(torch.float64)
    src = t.detach().to(torch.float64)
    differ = ~((back == src) | (torch.isnan(back) & torch.isnan(src)))
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        differ = differ | (src < info.min) | (src > info.max)
    if bool(differ.any()):
        return cast, tuple(int(i) for i in differ.nonzero()[0])
    return cast, None


def conform_qparams(qparams: QParams, shape, *, path: str | None = None) -> QParams:
    """``qparams`` for a tensor of ``shape`` in the exact form its spec stores: fields, shapes and dtypes as
    ``QParams.from_range`` makes them. A field of another dtype is cast where every value survives the cast
    (a float32 scale holding fp16 values, an integral zero point within the code range) and a ``ValueError``
    naming ``path``, the field and the first value that would change is raised otherwise; a missing or extra
    field or another grid shape is a ``ValueError`` as well. Parameters already in form come back unchanged (the
    same object)."""
    if not isinstance(qparams, QParams):
        raise TypeError(f"{where(path)}expected a QParams, got {type(qparams).__name__}")
    spec = qparams.spec
    ref = _reference(shape, spec)
    have, want = qparams.tensors(), ref.tensors()
    if set(have) != set(want):
        raise ValueError(f"{where(path)}qparams hold {sorted(have)}; {spec} stores {sorted(want)}")
    out, changed = {}, False
    for name, t in have.items():
        w = want[name]
        if tuple(t.shape) != tuple(w.shape):
            raise ValueError(f"{where(path)}qparams.{name} has shape {tuple(t.shape)}; {spec} of a {tuple(shape)} "
                             f"tensor stores {tuple(w.shape)}")
        if t.dtype == w.dtype:
            out[name] = t
            continue
        cast, first = _exact(t, w.dtype)
        if first is not None:
            value = float(t.detach().reshape(-1)[0] if t.dim() == 0 else t.detach()[first])
            raise ValueError(f"{where(path)}qparams.{name} is {str(t.dtype).removeprefix('torch.')} and not exactly "
                             f"representable as the {str(w.dtype).removeprefix('torch.')} that {spec} stores "
                             f"(first differing value {value:.6g} at index {first}); round it where it is made "
                             "(qtransform.learn.to_qparams)")
        out[name], changed = cast, True
    return QParams(spec=spec, **out) if changed else qparams

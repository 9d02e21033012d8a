"""Stacked quantized matrices: one :class:`QTensor` ``(n, a, b)`` holding ``n`` quantized ``(a, b)``
matrices (a mixture-of-experts layer's experts), each with its own scales (see
:mod:`qtransform.spec.stacked`).

* :func:`take` selects matrices by index and stays stacked (``q[idx]`` for the codes and every grid
  tensor, no decoding): what a routed forward dequantizes for the experts that tokens reached;
* :func:`matrix` is one matrix as an ordinary 2-D QTensor with its matrix spec (exports write it);
* :func:`stack` is the inverse: 2-D QTensors of one spec to the stacked QTensor.

>>> import torch, qtransform as qt
>>> w = torch.randn(4, 8, 32)
>>> spec = qt.stacked_spec(qt.QuantSpec(format="int4", granularity=qt.PerGroup(16)), w.shape)
>>> q = qt.quantize(w, qt.choose_qparams(w, spec))
>>> m = qt.stacked.matrix(q, 2)
>>> tuple(m.shape), torch.equal(qt.dequantize(m), qt.dequantize(q)[2])
((8, 32), True)
>>> torch.equal(qt.dequantize(qt.stacked.stack([qt.stacked.matrix(q, e) for e in range(4)])), qt.dequantize(q))
True
"""

from __future__ import annotations

import torch

from ..spec import QuantSpec
from ..spec.stacked import matrix_spec, stacked_spec
from .types import QParams, QTensor

__all__ = ["take", "matrix", "stack"]

_SHARED = ("global_scale",)  # one value for the whole stack (NVFP4's tensor scale)


def _check(q, what: str) -> int:
    if not isinstance(q, QTensor):
        raise TypeError(f"{what}: expected a QTensor, got {type(q).__name__}")
    if len(q.shape) != 3:
        raise ValueError(f"{what}: expected stacked matrices (n, rows, cols), got a QTensor of shape {tuple(q.shape)}")
    return q.shape[0]


def _index(q: QTensor, index, spec: QuantSpec) -> QTensor:
    parts = {n: (t if n in _SHARED else t[index]) for n, t in q.qparams.tensors().items()}
    return QTensor(codes=q.codes[index], qparams=QParams(spec=spec, **parts), width=q.width, dtype=q.dtype)


def take(q: QTensor, index) -> QTensor:
    """The stacked QTensor of the matrices ``index`` (a 1-D index tensor or a slice) of ``q``."""
    n = _check(q, "take")
    if isinstance(index, torch.Tensor):
        if index.dim() != 1 or index.dtype not in (torch.int64, torch.int32, torch.bool):
            raise ValueError(f"take: index must be a 1-D integer or boolean tensor, got {index.dtype} of shape "
                             f"{tuple(index.shape)}")
        if index.dtype != torch.bool and index.numel() and not index.is_meta and index.device.type == "cpu" and (
                int(index.min()) < -n or int(index.max()) >= n):
            raise ValueError(f"take: index out of range for {n} stacked matrices")
    elif not isinstance(index, slice):
        raise TypeError(f"take: index must be a 1-D tensor or a slice, got {type(index).__name__}")
    return _index(q, index, q.spec)


def matrix(q: QTensor, i: int) -> QTensor:
    """Matrix ``i`` of the stacked ``q`` as a 2-D QTensor with its matrix spec (:func:`matrix_spec`)."""
    n = _check(q, "matrix")
    if isinstance(i, bool) or not isinstance(i, int) or not -n <= i < n:
        raise ValueError(f"matrix: index must be an int in [-{n}, {n}), got {i!r}")
    return _index(q, i, matrix_spec(q.spec, tuple(q.shape)))


def stack(qs) -> QTensor:
    """The stacked QTensor ``(n, a, b)`` of ``n`` 2-D QTensors of one spec, width and dtype (and one
    shared ``global_scale``, if their format has one)."""
    qs = list(qs)
    if not qs or any(not isinstance(q, QTensor) for q in qs):
        raise TypeError("stack: expected a non-empty sequence of QTensors")
    first = qs[0]
    for i, q in enumerate(qs):
        if q.spec != first.spec or tuple(q.shape) != tuple(first.shape) or q.dtype != first.dtype:
            raise ValueError(f"stack: matrix {i} is {q.spec} {tuple(q.shape)} {q.dtype}, matrix 0 is "
                             f"{first.spec} {tuple(first.shape)} {first.dtype}; stacked matrices share spec, shape, dtype")
        if len(q.shape) != 2:
            raise ValueError(f"stack: matrix {i} has shape {tuple(q.shape)}; expected 2-D QTensors")
    parts = {}
    for name, t in first.qparams.tensors().items():
        if name in _SHARED:
            if any(not torch.equal(q.qparams.tensors()[name], t) for q in qs):
                raise ValueError(f"stack: the matrices' {name} differ; a stacked tensor holds one")
            parts[name] = t
        else:
            parts[name] = torch.stack([q.qparams.tensors()[name] for q in qs])
    shape = (len(qs), *first.shape)
    spec = stacked_spec(first.spec, shape)
    return QTensor(codes=torch.stack([q.codes for q in qs]), qparams=QParams(spec=spec, **parts), width=first.width,
                   dtype=first.dtype)

"""Where training starts after a recipe's steps: learned ranges whose stored parameters are exactly the
parameters the steps (or the calibration of static activations) fitted, and the steps' tensors in the model.

Each quantized weight starts at its dequantized value and its range at ``learn.exact_range`` of its parameters
(the range whose stored parameters are exactly the steps'; an error naming the path where none is).
"""

from __future__ import annotations

import torch
from torch import nn

import qtransform as qt
from qtransform import learn

from ..tree import tie_groups

__all__ = ["range_of", "static_range", "start_from_steps"]

def range_of(q: qt.QTensor, *, path: str) -> learn.LearnedRange:
    """The learned range a steps' quantized weight ``q`` starts from (its parameters exactly)."""
    if q.spec.fmt.sub_block is None:
        return learn.exact_range(q.qparams, path=path)
    # shared micro-exponents stand for no single range per sub-block: the min-max of the dequantized blocks
    return learn.exact_range(q.qparams, learn.learnable(qt.dequantize(q, dtype=torch.float32), q.spec, path=path), path=path)


def static_range(qp: qt.QParams, *, tokens: bool, site: str) -> learn.LearnedRange:
    """The learned range of a calibrated static activation quantizer ``qp``: on one token's grid of the (tokens,
    features) matrix (``(1, 1)`` per tensor, ``(1, features)`` per feature) when ``tokens``, else ``qp``'s."""
    r = learn.exact_range(qp, path=site)
    if tokens:
        r = learn.LearnedRange(lo=r.lo.reshape(1, -1), hi=r.hi.reshape(1, -1), spec=r.spec)
    return r


def start_from_steps(model: nn.Module, r) -> dict:
    """Copy the tensors a pipeline result ``r`` (:class:`bridge.Quantized`) rewrote into ``model``, each
    quantized weight at its dequantized value (on the steps' grid); returns ``{path: LearnedRange}``, the
    ranges that stand for the steps' parameters. ``ValueError`` for tied tensors the steps rewrite apart."""
    changed = r.changed()
    groups = {path: g for g in tie_groups(model) for path in g}
    values = {p: qt.dequantize(v) if isinstance(v, qt.QTensor) else v for p, v in changed.items()}
    for path, value in values.items():
        for other in groups.get(path, [path]):
            if other != path and (values.get(other) is None or not torch.equal(values[other], value)):
                raise ValueError(f"recipe.steps: they rewrite {path} but not its tied {other} alike; bridge.qat "
                                 "keeps tied weights tied: quantize with bridge.quantize")
    ranges = {p: range_of(q, path=p) for p, q in changed.items() if isinstance(q, qt.QTensor)}
    tensors = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    with torch.no_grad():
        for path, value in values.items():
            tensors[path].copy_(value.to(tensors[path].dtype))
    return ranges

"""Where training starts after a recipe's steps: learned ranges whose stored parameters are exactly the
parameters the steps (or the calibration of static activations) fitted, and the steps' tensors in the model.

``learn.from_qparams(qp)`` gives the range ``qp`` stands for (its lowest and highest codes dequantized), whose
``learn.to_qparams`` is ``qp`` only up to the rounding of a scale: off by an ulp where ``(hi - lo) / span``
rounds, and by ``128 / 127.5`` for a symmetric spec over an asymmetric code range (int8's ``[-128, 127]``:
its scale is ``max(-lo, hi) / 127.5``). :func:`exact_range` corrects it block by block, with nothing but
``learn.to_qparams``: each block's range scaled by the ratio of the wanted scale to the one it gives (a
scale is proportional to its range), then the blocks still off moved by a few ulps at either end; blocks it cannot match
are an error naming the path, so what trains starts from the steps' parameters, not near them.

>>> import torch, qtransform as qt
>>> spec = qt.QuantSpec(format="int8")
>>> qp = qt.choose_qparams(torch.tensor([[-1.0, 0.3]]), spec)
>>> torch.equal(learn.to_qparams(exact_range(qp)).scale, qp.scale)
True
"""

from __future__ import annotations

import torch
from torch import nn

import qtransform as qt
from qtransform import learn

from ..tree import tie_groups

__all__ = ["exact_range", "range_of", "static_range", "start_from_steps"]

#: How many float32 ulps the blocks a rescaling leaves off are moved, each end alone, each way.
_NUDGES = 8


def _nudged(lo: torch.Tensor, hi: torch.Tensor):
    """``(lo, hi)`` candidates around the given ones: ``hi`` moved by 1.._NUDGES ulps up and down, then ``lo``."""
    for end in ("hi", "lo"):
        for toward in (float("inf"), float("-inf")):
            t = hi if end == "hi" else lo
            for _ in range(_NUDGES):
                t = torch.nextafter(t, torch.full_like(t, toward))
                yield (lo, t) if end == "hi" else (t, hi)


def _fields(qp: qt.QParams) -> dict:
    return qp.tensors()


def _matching(got: qt.QParams, want: qt.QParams, grid: tuple) -> torch.Tensor | None:
    """Per block of ``grid``: whether every grid-shaped field of ``got`` equals ``want``'s; ``None`` when a
    field of another shape (a global scale) or dtype differs."""
    a, b = _fields(got), _fields(want)
    if a.keys() != b.keys():
        return None
    ok = torch.ones(grid, dtype=torch.bool, device=want.scale.device)
    for name, t in b.items():
        if a[name].dtype != t.dtype or a[name].shape != t.shape:
            return None
        if tuple(t.shape) == grid:
            ok &= a[name] == t
        elif not torch.equal(a[name], t):
            return None
    return ok


def same_qparams(a: qt.QParams, b: qt.QParams) -> bool:
    ta, tb = _fields(a), _fields(b)
    return ta.keys() == tb.keys() and all(ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]) for k in ta)


def exact_range(qp: qt.QParams, start: learn.LearnedRange | None = None, *,
                path: str | None = None) -> learn.LearnedRange:
    """A range whose ``learn.to_qparams`` is ``qp`` exactly (see the module docstring), from ``start``
    (default ``learn.from_qparams(qp)``). ``ValueError`` naming ``path`` where no block correction reaches it."""
    r = learn.from_qparams(qp, path=path) if start is None else start
    spec, grid = qp.spec, tuple(r.lo.shape)
    want, _ = qp.effective()
    lo, hi = r.lo, r.hi
    for _ in range(3):  # the scale follows the range's width
        got, _ = learn.to_qparams(learn.LearnedRange(lo=lo, hi=hi, spec=spec), path=path).effective()
        if got.shape != want.shape:
            break
        ratio = torch.where((got > 0) & (want > 0), want / torch.where(got > 0, got, 1.0), 1.0)
        if bool((ratio == 1).all()):
            break
        lo, hi = lo * ratio, hi * ratio
    ok = _matching(learn.to_qparams(learn.LearnedRange(lo=lo, hi=hi, spec=spec), path=path), qp, grid)
    for lo_c, hi_c in _nudged(lo, hi):
        if ok is None or bool(ok.all()):
            break
        hit = _matching(learn.to_qparams(learn.LearnedRange(lo=lo_c, hi=hi_c, spec=spec), path=path), qp, grid)
        if hit is None:
            continue
        take = hit & ~ok
        lo, hi, ok = torch.where(take, lo_c, lo), torch.where(take, hi_c, hi), ok | take
    out = learn.LearnedRange(lo=lo, hi=hi, spec=spec)
    if not same_qparams(learn.to_qparams(out, path=path), qp):
        raise ValueError(f"{path or 'qparams'}: no learnable range gives back these parameters of {spec} exactly "
                         f"({'global parameters differ' if ok is None else f'{int((~ok).sum())} blocks off'}); "
                         "quantize with bridge.quantize")
    return out


def range_of(q: qt.QTensor, *, path: str) -> learn.LearnedRange:
    """The learned range a steps' quantized weight ``q`` starts from (its parameters exactly)."""
    if q.spec.fmt.sub_block is None:
        return exact_range(q.qparams, path=path)
    # shared micro-exponents stand for no single range per sub-block: the min-max of the dequantized blocks
    return exact_range(q.qparams, learn.learnable(qt.dequantize(q, dtype=torch.float32), q.spec, path=path), path=path)


def static_range(qp: qt.QParams, *, tokens: bool, site: str) -> learn.LearnedRange:
    """The learned range of a calibrated static activation quantizer ``qp``: on one token's grid of the (tokens,
    features) matrix (``(1, 1)`` per tensor, ``(1, features)`` per feature) when ``tokens``, else ``qp``'s."""
    r = exact_range(qp, path=site)
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

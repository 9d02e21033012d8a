"""Learned ranges whose stored parameters are exactly given ones: a start from parameters fitted elsewhere (GPTQ's,
a calibrated activation range).

:func:`~qtransform.learn.from_qparams` gives the range parameters stand for (their lowest and highest codes
dequantized), whose :func:`~qtransform.learn.to_qparams` is the parameters only up to the rounding of a scale
(an ulp where ``(hi - lo) / span`` rounds). :func:`exact_range` corrects it block by block with nothing but
``to_qparams``: each block's range scaled by the ratio of the wanted scale to the one it gives (a scale is
proportional to its range), then the blocks still off moved by a few ulps at either end; where no block
correction reaches the parameters it raises a ``ValueError`` naming the path, so what trains starts from them,
not near them.

>>> import torch, qtransform as qt
>>> from qtransform import learn
>>> qp = qt.choose_qparams(torch.tensor([[-1.0, 0.3]]), qt.QuantSpec(format="int8"))
>>> torch.equal(learn.to_qparams(learn.exact_range(qp)).scale, qp.scale)
True
"""

from __future__ import annotations

import torch

from ..tensor import QParams
from .ranges import LearnedRange, from_qparams, to_qparams

__all__ = ["exact_range", "same_qparams"]

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


def _matching(got: QParams, want: QParams, grid: tuple) -> torch.Tensor | None:
    """Per block of ``grid``: whether every grid-shaped field of ``got`` equals ``want``'s; ``None`` when a
    field of another shape (a global scale) or dtype differs."""
    a, b = got.tensors(), want.tensors()
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


def same_qparams(a: QParams, b: QParams) -> bool:
    """Whether ``a`` and ``b`` hold the same fields, dtypes and values."""
    ta, tb = a.tensors(), b.tensors()
    return ta.keys() == tb.keys() and all(ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]) for k in ta)


def exact_range(qp: QParams, start: LearnedRange | None = None, *,
                path: str | None = None) -> LearnedRange:
    """A range whose ``to_qparams`` is ``qp`` exactly (see the module docstring), from ``start``
    (default ``from_qparams(qp)``). ``ValueError`` naming ``path`` where no block correction reaches it."""
    r = from_qparams(qp, path=path) if start is None else start
    spec, grid = qp.spec, tuple(r.lo.shape)
    want, _ = qp.effective()
    lo, hi = r.lo, r.hi
    for _ in range(3):  # the scale follows the range's width
        got, _ = to_qparams(LearnedRange(lo=lo, hi=hi, spec=spec), path=path).effective()
        if got.shape != want.shape:
            break
        ratio = torch.where((got > 0) & (want > 0), want / torch.where(got > 0, got, 1.0), 1.0)
        if bool((ratio == 1).all()):
            break
        lo, hi = lo * ratio, hi * ratio
    ok = _matching(to_qparams(LearnedRange(lo=lo, hi=hi, spec=spec), path=path), qp, grid)
    for lo_c, hi_c in _nudged(lo, hi):
        if ok is None or bool(ok.all()):
            break
        hit = _matching(to_qparams(LearnedRange(lo=lo_c, hi=hi_c, spec=spec), path=path), qp, grid)
        if hit is None:
            continue
        take = hit & ~ok
        lo, hi, ok = torch.where(take, lo_c, lo), torch.where(take, hi_c, hi), ok | take
    out = LearnedRange(lo=lo, hi=hi, spec=spec)
    if not same_qparams(to_qparams(out, path=path), qp):
        raise ValueError(f"{path or 'qparams'}: no learnable range gives back these parameters of {spec} exactly "
                         f"({'global parameters differ' if ok is None else f'{int((~ok).sum())} blocks off'}); "
                         "quantize with the steps alone")
    return out

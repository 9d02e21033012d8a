"""Clipping search for weight groups, weighted by input energy: the ranges GPTQ starts from.

For every block of the spec's grid, the range ``[p · min, p · max]`` is tried for each shrink
factor ``p`` on ``linspace(1, min_ratio, grid)``, and the one with the smallest *output-weighted*
squared error ``Σ_j h_j (w_ij − Q(w_ij))²`` wins, ``h_j`` being the energy of input ``j`` (the
Hessian's diagonal, ``mean x_j²``): clipping a column that sees large inputs costs more than one that
sees small ones. With ``h = 1`` it is the weight-MSE search of GPTQ's reference code (``mse=True``).

>>> import torch, qtransform as qt
>>> from qtransform.algorithms.clip_search import search_range
>>> w = torch.cat([torch.linspace(-1, 1, 255), torch.tensor([3.0])]).reshape(1, 256)
>>> spec = qt.QuantSpec(format="int4", granularity=qt.PerChannel(0))
>>> err = lambda qp: float((qt.fake_quantize(w, qp) - w).pow(2).sum())
>>> err(search_range(w, spec)) < err(qt.choose_qparams(w, spec))
True
"""

from __future__ import annotations

import torch

from .._checks import where
from ..observers import init_stats, observe
from ..spec import QuantSpec
from ..tensor import QParams, blocks, fake_quantize

__all__ = ["search_range"]


def search_range(w: torch.Tensor, spec: QuantSpec, col_weight: torch.Tensor | None = None, *, grid: int = 12,
                 min_ratio: float = 0.45, path: str | None = None) -> QParams:
    """Per-block clipped range of the 2-D ``w`` ``(out, in)`` minimizing ``Σ h_j (w − Q(w))²`` (see the module
    docstring); ``col_weight``: ``h`` of shape ``(in,)`` (default ones). Returns the QParams of the best range
    (``p = 1`` included, so never worse than min/max on that error)."""
    if not (isinstance(grid, int) and grid >= 1) or not 0 < min_ratio <= 1:
        raise ValueError(f"{where(path)}clip search: grid must be an int >= 1 and min_ratio in (0, 1], got "
                         f"{grid!r}, {min_ratio!r}")
    x = w.detach().to(torch.float32)
    stats = observe(init_stats(spec), x, path=path)
    lo, hi = stats.min.to(torch.float32), stats.max.to(torch.float32)
    p = blocks.plan(x.shape, spec, path=path)
    h = torch.ones(x.shape[-1]) if col_weight is None else col_weight.detach().to(torch.float32).clamp(min=0)
    hw = h.expand_as(x)
    best_err, best_lo, best_hi = torch.full_like(lo, float("inf")), lo, hi
    for ratio in torch.linspace(1.0, min_ratio, grid).tolist():  # p = 1 first: ties keep the full range
        qp = QParams.from_range(lo * ratio, hi * ratio, spec, path=path)
        e = (fake_quantize(x, qp) - x).square_().mul_(hw)
        err = blocks.view(e, p).sum(dim=blocks.reduce_dims(p))
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_lo = torch.where(better, lo * ratio, best_lo)
        best_hi = torch.where(better, hi * ratio, best_hi)
    return QParams.from_range(best_lo, best_hi, spec, path=path)

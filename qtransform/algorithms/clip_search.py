"""Clipping search for weight groups, weighted by input energy: the ranges GPTQ starts from.

For every block of the spec's grid, the range ``[p · min, p · max]`` is tried for each shrink
factor ``p`` on ``linspace(1, min_ratio, grid)``, and the one with the smallest *output-weighted*
squared error ``Σ_j h_j (w_ij − Q(w_ij))²`` wins, ``h_j`` being the energy of input ``j`` (the
Hessian's diagonal, ``mean x_j²``): clipping a column that sees large inputs costs more than one that
sees small ones. With ``h = 1`` it is the weight-MSE search of GPTQ's reference code (``mse=True``).

With ``gram`` (:func:`input_gram`: ``XᵀX / n`` of the layer's inputs, restricted to the column blocks the
spec quantizes together) the error is the layer's output error itself, ``Σ_g d_g G_g d_gᵀ`` summed over each
block's rows, ``d`` being a row's quantization error on the columns of block ``g``: AWQ's clipping objective.

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

__all__ = ["search_range", "input_gram"]


def input_gram(rows: torch.Tensor, spec: QuantSpec, shape, *, in_axis: int = 1, path: str | None = None) -> torch.Tensor:
    """``(G, c, c)``: ``XᵀX / n`` of the input ``rows`` ``(n, in)`` on each of the ``G`` column blocks of width
    ``c`` that ``spec`` quantizes together in a weight of ``shape`` whose input axis is ``in_axis`` (``c``: the
    group size, or all inputs for per-channel and per-tensor specs). Padded columns get zeros."""
    p = blocks.tiling(tuple(shape), spec, path=path)
    c, padded = p.block[in_axis], p.padded[in_axis]
    x = rows.detach().to(torch.float32)
    if x.dim() != 2 or x.shape[1] != shape[in_axis]:
        raise ValueError(f"{where(path)}clip search: input rows of shape {tuple(x.shape)} for a weight of shape "
                         f"{tuple(shape)} reading {shape[in_axis]} inputs")
    x = torch.constant_pad_nd(x, (0, padded - x.shape[1])).reshape(x.shape[0], padded // c, c)
    return torch.einsum("ngi,ngj->gij", x, x) / max(x.shape[0], 1)


def _gram_error(d: torch.Tensor, gram: torch.Tensor, p, in_axis: int) -> torch.Tensor:
    """Per-block output error of the weight error ``d`` (stored layout) under the block Gram ``gram``."""
    dl = d if in_axis == 1 else d.T
    out_axis = 1 - in_axis
    c, b_out = p.block[in_axis], p.block[out_axis]
    dl = torch.constant_pad_nd(dl, (0, p.padded[in_axis] - dl.shape[1], 0, p.padded[out_axis] - dl.shape[0]))
    dg = dl.reshape(dl.shape[0], -1, c)
    e = (torch.einsum("rgi,gij->rgj", dg, gram) * dg).sum(-1)  # (rows, column blocks)
    e = e.reshape(-1, b_out, e.shape[1]).sum(1)  # rows gathered into the spec's blocks
    return e if in_axis == 1 else e.T


def search_range(w: torch.Tensor, spec: QuantSpec, col_weight: torch.Tensor | None = None, *, grid: int = 12,
                 min_ratio: float = 0.45, gram: torch.Tensor | None = None, in_axis: int = 1,
                 path: str | None = None) -> QParams:
    """Per-block clipped range of the 2-D ``w`` ``(out, in)`` minimizing ``Σ h_j (w − Q(w))²`` (see the module
    docstring); ``col_weight``: ``h`` of shape ``(in,)`` (default ones). With ``gram`` (:func:`input_gram`)
    the output error instead, ``w``'s input axis being ``in_axis`` (1; 0 for a weight stored ``(in, out)``).
    Returns the QParams of the best range (``p = 1`` included, so never worse than min/max on that error)."""
    if not (isinstance(grid, int) and grid >= 1) or not 0 < min_ratio <= 1:
        raise ValueError(f"{where(path)}clip search: grid must be an int >= 1 and min_ratio in (0, 1], got "
                         f"{grid!r}, {min_ratio!r}")
    x = w.detach().to(torch.float32)
    stats = observe(init_stats(spec), x, path=path)
    lo, hi = stats.min.to(torch.float32), stats.max.to(torch.float32)
    p = blocks.tiling(x.shape, spec, path=path)
    if gram is not None and (in_axis not in (0, 1) or gram.dim() != 3 or gram.shape[1:] != (
            p.block[in_axis], p.block[in_axis]) or gram.shape[0] * p.block[in_axis] != p.padded[in_axis]):
        raise ValueError(f"{where(path)}clip search: a Gram of shape {tuple(gram.shape)} does not fit the column "
                         f"blocks of a weight {tuple(x.shape)} with input axis {in_axis} under {spec}")
    h = torch.ones(x.shape[-1], device=x.device) if col_weight is None else col_weight.detach().to(torch.float32).clamp(min=0)
    hw = h.expand_as(x)
    best_err, best_lo, best_hi = torch.full_like(lo, float("inf")), lo, hi
    for ratio in torch.linspace(1.0, min_ratio, grid).tolist():  # p = 1 first: ties keep the full range
        qp = QParams.from_range(lo * ratio, hi * ratio, spec, path=path)
        if gram is not None:
            err = _gram_error(fake_quantize(x, qp) - x, gram, p, in_axis).reshape(lo.shape)
        else:
            err = blocks.view((fake_quantize(x, qp) - x).square_().mul_(hw), p).sum(dim=blocks.reduce_dims(p))
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_lo = torch.where(better, lo * ratio, best_lo)
        best_hi = torch.where(better, hi * ratio, best_hi)
    return QParams.from_range(best_lo, best_hi, spec, path=path)

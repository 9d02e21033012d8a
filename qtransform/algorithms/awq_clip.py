"""AWQ's clipping search in the reference's form (Lin et al., 2024; ``auto_clip.py`` of llm-awq).

Per quantization block the weight is clamped to ``[−p · a, p · a]``, ``a`` the block's largest magnitude, for
``p = 1 − i / grid``, ``i < max_shrink · grid`` (the reference: 20 points, shrink at most by half, so
``p`` from 1 down to 0.55), then quantized with the min/max range of the clamped block: the range
``[max(min, −p·a), min(max, p·a)]``. Only the side of larger magnitude shrinks until ``p · a`` reaches the
other side. The shrink kept per block minimizes the block's output error ``d G dᵀ`` (``d`` the weight
error, ``G`` the inputs' Gram matrix over the block's columns: :func:`~.clip_search.input_gram`), the
reference's mean squared partial output over its sampled tokens; ``p = 1`` comes first, so ties keep the
full range. (:func:`~.clip_search.search_range` shrinks both ends, ``[p · min, p · max]``, instead.)

>>> import torch, qtransform as qt
>>> from qtransform.algorithms.clip_search import input_gram
>>> g = torch.Generator().manual_seed(0)
>>> w = torch.randn(4, 64, generator=g)
>>> spec = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(64), symmetric=False)
>>> gram = input_gram(torch.randn(256, 64, generator=g), spec, (4, 64))
>>> err = lambda q: float(torch.einsum("ri,ij,rj->", q - w, gram[0], q - w))
>>> err(qt.fake_quantize(w, search_magnitude(w, spec, gram=gram))) < err(qt.fake_quantize(w, qt.choose_qparams(w, spec)))
True
"""

from __future__ import annotations

import torch

from .._checks import where
from ..observers import init_stats, observe
from ..spec import QuantSpec
from ..tensor import QParams, blocks, fake_quantize
from .clip_search import _gram_error as _block_error  # per-block output error under the block Gram

__all__ = ["CLIP_RANGES", "shrink_factors", "search_magnitude"]

#: The clipping searches AWQ can run: ``"both"`` (:func:`~.clip_search.search_range`) and ``"magnitude"``
#: (:func:`search_magnitude`, the reference's).
CLIP_RANGES = ("both", "magnitude")


def shrink_factors(grid: int = 20, max_shrink: float = 0.5) -> list[float]:
    """The reference's ``p = 1 − i / grid`` for ``i < int(max_shrink · grid)`` (at least ``p = 1``)."""
    if isinstance(grid, bool) or not isinstance(grid, int) or grid < 1 or not 0 <= max_shrink < 1:
        raise ValueError(f"awq clip: grid must be an int >= 1 and max_shrink in [0, 1), got {grid!r}, {max_shrink!r}")
    return [1 - i / grid for i in range(max(1, int(max_shrink * grid)))]


def search_magnitude(w: torch.Tensor, spec: QuantSpec, *, gram: torch.Tensor, in_axis: int = 1, grid: int = 20,
                     max_shrink: float = 0.5, path: str | None = None) -> QParams:
    """The QParams of the clamped range per block of the 2-D ``w`` that minimizes its output error under
    ``gram`` (``(G, c, c)``, :func:`~.clip_search.input_gram`; see the module docstring). ``w``'s input axis
    is ``in_axis`` (1; 0 for a weight stored ``(in, out)``)."""
    factors = shrink_factors(grid, max_shrink)
    x = w.detach().to(torch.float32)
    if x.dim() != 2 or in_axis not in (0, 1):
        raise ValueError(f"{where(path)}awq clip: a 2-D weight and in_axis 0 or 1, got shape {tuple(x.shape)}, "
                         f"in_axis {in_axis!r}")
    p = blocks.tiling(x.shape, spec, path=path)
    if gram.dim() != 3 or gram.shape[1:] != (p.block[in_axis], p.block[in_axis]) or \
            gram.shape[0] * p.block[in_axis] != p.padded[in_axis]:
        raise ValueError(f"{where(path)}awq clip: a Gram of shape {tuple(gram.shape)} does not fit the column "
                         f"blocks of a weight {tuple(x.shape)} with input axis {in_axis} under {spec}")
    stats = observe(init_stats(spec), x, path=path)
    lo, hi = stats.min.to(torch.float32), stats.max.to(torch.float32)
    a = torch.maximum(lo.abs(), hi.abs())
    best_err, best_lo, best_hi = torch.full_like(lo, float("inf")), lo, hi
    for f in factors:
        c_lo, c_hi = torch.maximum(lo, -f * a), torch.minimum(hi, f * a)
        qp = QParams.from_range(c_lo, c_hi, spec, path=path)
        err = _block_error(fake_quantize(x, qp) - x, gram, p, in_axis).reshape(lo.shape)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_lo, best_hi = torch.where(better, c_lo, best_lo), torch.where(better, c_hi, best_hi)
    return QParams.from_range(best_lo, best_hi, spec, path=path)

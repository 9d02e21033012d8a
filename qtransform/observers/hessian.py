"""``hessian``: the input Gram matrix ``XᵀX`` of a linear layer and its sample count (GPTQ's Hessian).

A batch ``x`` of shape ``(..., in)`` adds ``x2ᵀ x2`` (``x2 = x.reshape(-1, in)``) to ``xtx`` and its
row count to ``count``; both reduce by sum across batches and processes. Each batch's product is
computed in the observer's ``dtype`` and summed in float64 (a fold's ``xtx`` is float64 from its first batch;
``batch`` alone gives the product in ``dtype``), where adding float32 values is exact
in practice: the sum does not depend on how the batches were split or ordered (one process or many give
the same Hessian, bit for bit). ``finalize`` gives the mean outer product ``XᵀX / n`` (``(in, in)``) in
``dtype``, the Hessian of the layer's squared output
error up to the factor 2 that GPTQ's damping makes irrelevant.

>>> import torch, qtransform as qt
>>> x = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
>>> s = qt.observe(qt.observe(qt.init_stats(observer="hessian"), x[:1]), x[1:])
>>> s.xtx.tolist(), int(s.count), qt.finalize_stats(s).tolist()
([[10.0, 2.0], [2.0, 4.0]], 2, [[5.0, 1.0], [1.0, 2.0]])
"""

from __future__ import annotations

import dataclasses

import torch

from .._checks import check_finite, where
from .._pytree import pytree_dataclass
from ..spec import QuantSpec
from .base import Observer, merge_stats, register_observer

__all__ = ["Hessian", "HessianStats", "gram"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64}
#: Widths from which :func:`gram` computes the upper blocks only (below it one product is faster).
_GRAM_SPLIT = 1024


def gram(x: torch.Tensor, *, split: int = _GRAM_SPLIT) -> torch.Tensor:
    """``xᵀx`` of a 2-D ``x`` ``(n, d)``. For ``d >= split`` it computes the blocks on and above the
    diagonal of a 4×4 tiling and mirrors them (10 of 16 products): the Hessian of a wide layer
    (an MLP's down projection) costs 5/8 of the full product."""
    d = x.shape[-1]
    if d < split or x.requires_grad:
        return x.T @ x
    edges = [round(d * i / 4) for i in range(5)]
    out = torch.empty(d, d, dtype=x.dtype, device=x.device)
    for i in range(4):
        a = x[:, edges[i]:edges[i + 1]]
        for j in range(i, 4):
            block = a.T @ x[:, edges[j]:edges[j + 1]]
            out[edges[i]:edges[i + 1], edges[j]:edges[j + 1]] = block
            if j != i:
                out[edges[j]:edges[j + 1], edges[i]:edges[i + 1]] = block.T
    return out


@pytree_dataclass(static=("spec", "observer"))
class HessianStats:
    """``xtx`` (in, in) summed outer products (float64 in a fold; the observer's dtype from ``batch``) and ``count`` (int64, shape ()) rows observed."""

    xtx: torch.Tensor | None = None
    count: torch.Tensor | None = None
    spec: QuantSpec | None = None
    observer: Observer | None = None


@register_observer
@dataclasses.dataclass(frozen=True, kw_only=True)
class Hessian(Observer):
    """Sum of ``xᵀx`` over the rows of every batch, each batch's computed in ``dtype`` (``"float32"`` or
    ``"float64"``), the sum held in float64."""

    dtype: str = "float32"

    name = "hessian"
    reduction = {"xtx": "sum", "count": "sum"}

    def __post_init__(self):
        if isinstance(self.dtype, torch.dtype):  # torch.float64 -> "float64" (options stay JSON-able)
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        if not isinstance(self.dtype, str) or self.dtype not in _DTYPES:
            raise ValueError(f"hessian: dtype must be one of {list(_DTYPES)}, got {self.dtype!r}")

    def init(self, spec=None):
        return HessianStats(observer=self)

    def batch(self, stats, x, *, path=None):
        check_finite(x, path=path)
        x2 = x.detach().reshape(-1, x.shape[-1]).to(_DTYPES[self.dtype])
        count = torch.tensor(x2.shape[0], dtype=torch.int64, device=x.device)
        return dataclasses.replace(stats, xtx=gram(x2), count=count)

    def update(self, stats, x, *, path=None, donate=False):
        b = self.batch(stats, x, path=path)
        if stats.xtx is None:  # a fold holds its sum in float64 from the first batch (no float32 -> float64 copy later)
            return dataclasses.replace(b, xtx=b.xtx.to(torch.float64))
        if donate and stats.xtx.dtype == torch.float64 and stats.xtx.shape == b.xtx.shape:
            stats.xtx.add_(b.xtx)  # donated: the sum built in place (float64 += float32, no float64 copy)
            return dataclasses.replace(stats, count=stats.count + b.count)
        return merge_stats(stats, b, path=path)

    def merge(self, a, b, *, path=None):
        if a.xtx.shape != b.xtx.shape:
            raise ValueError(f"{where(path)}merge_stats: hessians of {tuple(a.xtx.shape)} and "
                             f"{tuple(b.xtx.shape)} (inputs of different widths)")
        return dataclasses.replace(a, xtx=a.xtx.to(torch.float64) + b.xtx, count=a.count + b.count)

    def finalize(self, stats, *, path=None) -> torch.Tensor:
        # the sum cast first, then divided: no float64 copy of the (in, in) matrix
        return stats.xtx.to(_DTYPES[self.dtype], copy=True).div_(stats.count.clamp(min=1).to(_DTYPES[self.dtype]))

"""Block views: every granularity as one reshape, vectorized over all blocks.

A tensor of shape ``(n0, n1, ...)`` with block size ``(b0, b1, ...)`` is viewed as
``(g0, b0, g1, b1, ...)`` with ``gi = ceil(ni / bi)``. Reducing over the odd axes gives
one value per block (the grid), and a grid tensor viewed as ``(g0, 1, g1, 1, ...)``
broadcasts back over the blocks. No Python loop over groups, channels or blocks.

A block size that does not divide its axis is an error unless the spec pads; padding
repeats the last element of the axis (so minima, maxima and amax of the last block are
unchanged) and is cropped away again.

The views are written for any rank (the tiling of a 1-D, 2-D or 4-D weight is the same code);
an einops pattern names a fixed rank, so it would have to be built as a string per call here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._checks import where
from ..granularity import PerGroup
from ..spec import QuantSpec

__all__ = ["Tiling", "tiling", "view", "unview", "expand", "flat", "reduce_dims"]


class Tiling(NamedTuple):
    shape: tuple[int, ...]
    block: tuple[int, ...]
    padded: tuple[int, ...]
    grid: tuple[int, ...]

    @property
    def needs_pad(self) -> bool:
        return self.padded != self.shape


def _describe(spec: QuantSpec) -> str:
    g = spec.granularity
    return f"group size {g.size}" if isinstance(g, PerGroup) else f"block size {spec.granularity}"


def tiling(shape, spec: QuantSpec, *, sub_block: bool = False, path: str | None = None) -> Tiling:
    """How ``spec`` tiles a tensor of ``shape`` into blocks (block size, padded shape, grid).

    With ``sub_block=True`` the granularity axis uses the format's micro-exponent sub-block
    (MX4/MX6/MX9 pairs) instead of its block.
    """
    shape = tuple(int(n) for n in shape)
    try:
        block = list(spec.granularity.block_size(shape))
    except ValueError as e:
        raise ValueError(f"{where(path)}{e}") from None
    padded = []
    for axis, (n, b) in enumerate(zip(shape, block)):
        if n % b and not spec.pad:
            raise ValueError(
                f"{where(path)}{_describe(spec)} does not divide axis {axis - len(shape)} of size {n} "
                f"(shape {shape}); pass pad=True to pad the last block"
            )
        padded.append(-(-n // b) * b)
    sub = spec.fmt.sub_block
    if sub_block and sub:  # sub-blocks inside whole (padded) outer blocks
        block[spec.granularity.axis % len(shape)] = sub
    grid = tuple(p // b for p, b in zip(padded, block))
    return Tiling(shape, tuple(block), tuple(padded), grid)


def _pad(x: torch.Tensor, shape: tuple[int, ...], padded: tuple[int, ...]) -> torch.Tensor:
    for axis, (n, p) in enumerate(zip(shape, padded)):
        if p != n:
            idx = torch.arange(p, device=x.device).clamp_(max=n - 1)
            x = x.index_select(axis, idx)
    return x


def view(x: torch.Tensor, p: Tiling) -> torch.Tensor:
    """``x`` (shape ``p.shape``) as ``(g0, b0, g1, b1, ...)``, padded when needed."""
    if p.needs_pad:
        x = _pad(x, p.shape, p.padded)
    inter = [d for g, b in zip(p.grid, p.block) for d in (g, b)]
    return x.reshape(inter)


def unview(xb: torch.Tensor, p: Tiling) -> torch.Tensor:
    """Inverse of :func:`view`: back to ``p.shape`` (padding cropped)."""
    x = xb.reshape(p.padded)
    if p.needs_pad:
        x = x[tuple(slice(0, n) for n in p.shape)]
    return x


def expand(t: torch.Tensor, p: Tiling) -> torch.Tensor:
    """A grid-shaped tensor viewed as ``(g0, 1, g1, 1, ...)`` to broadcast over blocks."""
    return t.reshape([d for g in p.grid for d in (g, 1)])


def reduce_dims(p: Tiling) -> tuple[int, ...]:
    """The within-block axes of a blocked view."""
    return tuple(range(1, 2 * len(p.shape), 2))


def flat(xb: torch.Tensor, p: Tiling) -> torch.Tensor:
    """A blocked view rearranged to ``grid + (block_numel,)``."""
    n = len(p.shape)
    order = list(range(0, 2 * n, 2)) + list(range(1, 2 * n, 2))
    return xb.permute(order).reshape(*p.grid, -1)

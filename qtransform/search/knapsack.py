"""The multiple-choice knapsack: one option per item, total size within a budget, least total loss.

Solved by dynamic programming over sizes in units of ``g``, the greatest common divisor of every option's
size above its item's smallest (sizes are bytes, integers). Every reachable total is then a multiple of
``g`` above the sum of the smallest sizes, so the table over ``floor(spare / g) + 1`` capacities is the
problem itself, not an approximation: the answer is exact. Only when that table would exceed
``max_cells`` are sizes rounded *up* to a coarser unit (``Solution.exact`` is then False): every answer
still fits the budget, and its loss is optimal for the rounded sizes. The same table with sizes rounded
*down* is then solved too: every choice that fits the true budget fits it, so its least loss is a lower
bound on the true optimum (``Solution.bound``; the gap to ``loss`` is proven, not guessed).

The last row of the table is the whole Pareto front (least loss at every size up to the budget), which
:func:`front` reads off.

>>> items = [[(10, 5.0), (20, 1.0)], [(10, 4.0), (30, 0.0)]]
>>> s = solve(items, 40)
>>> s.choice, s.size, s.loss, s.exact
((1, 0), 30, 5.0, True)
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

__all__ = ["Solution", "solve", "front"]


class Solution(NamedTuple):
    """``choice``: the option taken for each item; ``size``, ``loss``: their totals; ``exact``: solved
    over exact sizes; ``unit``: bytes per table cell; ``base``: the smallest possible total size;
    ``table``: least loss by capacity (``base + unit * c`` bytes, ``c = 0, 1, ...``); ``bound``: a lower bound
    on the optimal loss (``loss`` itself when exact)."""

    choice: tuple[int, ...]
    size: int
    loss: float
    exact: bool
    unit: int
    base: int
    table: torch.Tensor
    bound: float


def _check(items, budget) -> list[list[tuple[int, float]]]:
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise TypeError(f"budget must be an int (bytes), got {type(budget).__name__}")
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence) or not items:
        raise ValueError("items must be a non-empty list of option lists")
    out = []
    for i, opts in enumerate(items):
        if not isinstance(opts, Sequence) or not opts:
            raise ValueError(f"items[{i}] must be a non-empty list of (size, loss) options")
        row = []
        for j, opt in enumerate(opts):
            size, loss = opt
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ValueError(f"items[{i}][{j}]: size must be a non-negative int, got {size!r}")
            if not math.isfinite(float(loss)):
                raise ValueError(f"items[{i}][{j}]: loss must be finite, got {loss!r}")
            row.append((size, float(loss)))
        out.append(row)
    return out


def solve(items: Sequence[Sequence[tuple[int, float]]], budget: int, *, max_cells: int = 1 << 18) -> Solution:
    """The least-loss choice of one option per item with total size ``<= budget``.

    Args:
        items: per item, its options ``(size in bytes, loss)``.
        budget: the byte budget.
        max_cells: the most capacities the table may have (memory: items x cells bytes of choices).

    Raises:
        ValueError: naming ``budget`` when even the smallest options exceed it.
    """
    items = _check(items, budget)
    base = sum(min(s for s, _ in opts) for opts in items)
    if budget < base:
        raise ValueError(f"budget: {budget} bytes is below the smallest possible size, {base} bytes")
    extra = [[s - min(t for t, _ in opts) for s, _ in opts] for opts in items]
    unit = math.gcd(*[e for row in extra for e in row]) or 1
    top = sum(max(row) for row in extra)
    spare = min(budget - base, top)
    exact = spare // unit + 1 <= max_cells
    if not exact:
        unit = -(-top // (max_cells - 1))
    cells = spare // unit + 1
    table, picks = _table(items, extra, unit, cells, up=True)
    bound = float(_table(items, extra, unit, cells, up=False)[0][-1]) if not exact else None
    choice, c = [], cells - 1
    for i in reversed(range(len(items))):
        j = int(picks[i, c])
        choice.append(j)
        c -= -(-extra[i][j] // unit)
    choice = tuple(reversed(choice))
    size = sum(items[i][j][0] for i, j in enumerate(choice))
    loss = sum(items[i][j][1] for i, j in enumerate(choice))
    return Solution(choice, size, loss, exact, unit, base, table, loss if exact else min(bound, loss))


def _table(items, extra, unit: int, cells: int, *, up: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(least loss by capacity, option picked per item and capacity)``, sizes in ``unit`` rounded up or down."""
    table = torch.zeros(cells, dtype=torch.float64)  # least loss of the items so far within c units
    picks = torch.zeros(len(items), cells, dtype=torch.int16)
    for i, opts in enumerate(items):
        best = torch.full((cells,), math.inf, dtype=torch.float64)
        pick = torch.zeros(cells, dtype=torch.int16)
        for j, (w, (_, loss)) in enumerate(zip(extra[i], opts)):
            w = -(-w // unit) if up else w // unit
            if w >= cells:
                continue
            cand = torch.full((cells,), math.inf, dtype=torch.float64)
            cand[w:] = table[:cells - w] + loss
            better = cand < best
            best = torch.where(better, cand, best)
            pick = torch.where(better, torch.tensor(j, dtype=torch.int16), pick)
        table, picks[i] = best, pick
    return table, picks


def front(solution: Solution) -> list[tuple[int, float]]:
    """The Pareto front of a solved problem: ``(size bound in bytes, least loss)`` at each capacity
    where the least loss drops, smallest first (finite losses only)."""
    t = solution.table
    before = torch.cat([torch.full((1,), math.inf, dtype=t.dtype), t[:-1].cummin(0).values])
    keep = torch.isfinite(t) & (t < before)
    return [(solution.base + solution.unit * int(c), float(t[c])) for c in keep.nonzero().flatten()]

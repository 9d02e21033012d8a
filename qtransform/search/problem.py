"""A search problem: layers, candidates with their measured losses, constraints; its answer.

:func:`search` builds the knapsack's items from the layers (one item per group of layers that must share a
scheme: fused q/k/v and gate/up, the experts of one layer; every other layer alone), keeps for each item
the candidates every member has a loss for (a missing loss: not measured, or the candidate does not fit
that layer), the export target allows (``allowed``), and the user's pins; solves it
(:func:`~qtransform.search.knapsack.solve`) and hands back the scheme of every layer.

>>> import qtransform as qt
>>> from qtransform.search import candidates, search
>>> cs = candidates("int8, int4-g128")
>>> layers = {"a.weight": (64, 256), "b.weight": (64, 256)}
>>> losses = {"a.weight": {"int8": 1.0, "int4-g128": 9.0}, "b.weight": {"int8": 1.0, "int4-g128": 2.0}}
>>> r = search(layers, cs, losses, budget=6.5)
>>> r.choice, r.size
({'a.weight': 'int8', 'b.weight': 'int4-g128'}, 25344)
"""

from __future__ import annotations

import fnmatch
import math
from typing import Callable, Mapping, NamedTuple, Sequence

from ..spec import QuantSpec
from .candidates import Candidate, candidate
from .knapsack import Solution, front, solve
from .size import budget_bytes, tensor_bytes

__all__ = ["SearchResult", "search", "tied_groups"]


class SearchResult(NamedTuple):
    """``choice``/``specs``/``sizes``/``losses``: per layer path, its candidate's name, spec, stored bytes
    and estimated loss; ``size``/``loss``: totals; ``budget``: the byte budget; ``bits_per_weight``: of the
    result over the searched layers; ``exact``: the knapsack was solved over exact sizes; ``front``: the
    Pareto front ``[(bytes, least loss)]``; ``bound``: a proven lower bound on the least loss (``loss`` when
    exact); ``uniform``: ``{candidate: (bytes, loss)}`` of every candidate
    every item can take, used alone."""

    choice: dict[str, str]
    specs: dict[str, QuantSpec]
    sizes: dict[str, int]
    losses: dict[str, float]
    size: int
    loss: float
    budget: int
    bits_per_weight: float
    exact: bool
    front: list[tuple[int, float]]
    uniform: dict[str, tuple[int, float]]
    bound: float


def tied_groups(groups) -> list[list[str]]:
    """Plan groups (``{"linears": [module, ...]}``) of several linears, as lists of weight paths: the
    linears that read one input and that a fused kernel (vLLM's q/k/v, gate/up) holds in one format."""
    return [[f"{m}.weight" for m in g["linears"]] for g in (groups or ()) if len(g.get("linears", ())) > 1]


def _items(layers, tied) -> list[list[str]]:
    seen, items = set(), []
    for i, group in enumerate(tied):
        members = [p for p in group if p in layers]
        clash = sorted(set(members) & seen)
        if clash:
            raise ValueError(f"groups[{i}]: {clash} already belong to another group")
        seen.update(members)
        if members:
            items.append(members)
    return items + [[p] for p in layers if p not in seen]


def _pins(pins, layers, by_name) -> dict[str, Candidate]:
    out = {}
    for glob, name in (pins or {}).items():
        hit = [p for p in layers if fnmatch.fnmatchcase(p, glob)]
        if not hit:
            raise ValueError(f"pin {glob}={name}: the pattern matches no searched layer")
        c = by_name.get(name) or candidate(name)
        for p in hit:
            out.setdefault(p, c)  # first pin wins, as recipe rules do
    return out


def search(layers: Mapping[str, tuple[int, ...]], cands: Sequence[Candidate],
           losses: Mapping[str, Mapping[str, float]], *, budget: float | None = None, max_bytes: int | None = None,
           groups: Sequence[Sequence[str]] = (), pins: Mapping[str, str] | None = None,
           allowed: Callable[[QuantSpec], bool] | None = None, max_cells: int = 1 << 18) -> SearchResult:
    """The least-loss scheme per layer within a budget.

    Args:
        layers: ``{weight path: shape}`` of the searched weights (logical layout).
        cands: the candidates.
        losses: ``{path: {candidate name: estimated loss}}``; a missing entry rules that candidate out there.
        budget: bits per weight over ``layers`` (scales and zero points counted); or ``max_bytes`` in bytes.
        groups: lists of paths that must share one scheme.
        pins: ``{path glob: candidate name}``: those layers take that scheme (its loss counts as 0 when not
            measured; its bytes always count).
        allowed: which specs the export target holds (default: all).

    Raises:
        ValueError: naming ``budget``, ``candidates``, ``pin`` or the layer for an impossible problem.
    """
    if not layers:
        raise ValueError("layers: nothing to search")
    if (budget is None) == (max_bytes is None):
        raise ValueError("budget: give a budget in bits per weight or in bytes (one of them)")
    by_name = {c.name: c for c in cands}
    if len(by_name) != len(cands) or not cands:
        raise ValueError("candidates: give at least one, each name once")
    cap = budget_bytes(budget, layers.values()) if budget is not None else int(max_bytes)
    pinned = _pins(pins, layers, by_name)
    items = _items(layers, groups)
    options: list[list[tuple[Candidate, int, float]]] = []
    for members in items:
        pins_here = {pinned[p].name for p in members if p in pinned}
        if len(pins_here) > 1:
            raise ValueError(f"pin: {members} must share one scheme, but are pinned to {sorted(pins_here)}")
        pool = [pinned[next(p for p in members if p in pinned)]] if pins_here else list(cands)
        opts = []
        for c in pool:
            if not pins_here and allowed is not None and not allowed(c.spec):
                continue
            if not pins_here and not all(c.name in losses.get(p, {}) for p in members):
                continue
            loss = sum(float(losses.get(p, {}).get(c.name, 0.0)) for p in members)
            opts.append((c, sum(tensor_bytes(c.spec, layers[p]) for p in members), loss))
        if not opts:
            raise ValueError(f"candidates: no candidate fits {members[0]}"
                             + (" (the export target allows none of those measured there)" if allowed else ""))
        options.append(opts)
    sol: Solution = solve([[(s, l) for _, s, l in opts] for opts in options], cap, max_cells=max_cells)
    choice, specs, sizes, per_loss = {}, {}, {}, {}
    for members, opts, j in zip(items, options, sol.choice):
        c = opts[j][0]
        for p in members:
            choice[p], specs[p] = c.name, c.spec
            sizes[p] = tensor_bytes(c.spec, layers[p])
            per_loss[p] = float(losses.get(p, {}).get(c.name, 0.0))
    order = list(layers)
    numel = sum(math.prod(s) for s in layers.values())
    uniform = {}
    for c in cands:
        picks = [next((o for o in opts if o[0].name == c.name), None) for opts in options]
        if all(o is not None for o in picks):
            uniform[c.name] = (sum(o[1] for o in picks), sum(o[2] for o in picks))
    return SearchResult(choice={p: choice[p] for p in order}, specs={p: specs[p] for p in order},
                        sizes={p: sizes[p] for p in order}, losses={p: per_loss[p] for p in order},
                        size=sol.size, loss=sol.loss, budget=cap, bits_per_weight=8.0 * sol.size / numel,
                        exact=sol.exact, front=front(sol), uniform=uniform, bound=sol.bound)

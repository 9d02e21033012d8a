"""``smoothquant``: move activation outliers into the weights (Xiao et al., 2023), α fixed or searched.

For a smoothing group (a norm, or a linear, and the linears reading its output:
:mod:`.smoothing`) with per-input-channel activation maxima ``a_j = max |X_j|`` and weight maxima
``w_j = max |W_:,j|`` over *all* the group's linears,

    ``s_j = max(a_j, eps)^α / max(w_j, eps)^(1−α)``,  ``eps = 1e-5``,

divided by the geometric mean of ``s`` over the channels (a common factor changes nothing a
per-tensor or per-channel quantizer sees; it keeps the norm weights at their magnitude). The
scales fold into the tree: the producer's output channels ``÷ s``, the linears' input columns
``× s``; the float function is unchanged, and activations become easier to quantize (α → 1
moves all of the activations' range into the weights, α = 0 the weights' into the activations).
Over grouped-query heads, ``a`` and ``w`` are first reduced by max over the heads reading a value head.
In a mixture-of-experts layer the group of the MLP's norm holds the router (its input, every token, gives
``a``), the stacked experts weights (``w`` over all experts) and the shared experts; the routers are scaled
exactly but neither counted in ``w`` nor quantized in the search. The experts' down projections are not
smoothed (their inputs differ per expert: a scale per expert would have to fold into that expert's
``up`` rows).

As a step (``Step("smoothquant", alpha=0.5)``) it runs block by block on calibration data
(:class:`~qtransform.BlockInputs`): in each block, the per-channel ranges at the input of every
group's linears are folded over the block's calibration inputs (``Block.site_stats``), then the
groups are smoothed in order, each seeing the tensors as the groups before it left them.
``alpha="auto"`` (auto-SmoothQuant, as AMD Quark's) chooses, per group, α on the grid
``linspace(0, 1, grid)`` or no smoothing at all, whichever gives the smallest error of the group's
outputs with activations quantized by ``activation`` (default int8 per tensor, static) and weights
by the plan's specs, measured on up to ``tokens`` sampled input rows (:mod:`.smoothquant_math`).
``score="calibration"`` (default) measures each candidate on the very rows its scales and static range
come from; ``score="heldout"`` on calibration sequences they were not computed from (two folds of whole
sequences), as text the model was not calibrated on will be. The in-sample score rewards a large α
(dividing each channel by its calibration maximum amplifies the channels quiet in calibration); the
held-out one chooses lower α with few calibration sequences, but with 64 of SmolLM2's it chooses as the
in-sample one does and generalises no better to other text (docs/smoothquant.md), so it is not the default.
Without an ``activation`` option, the search quantizes a group's input as the recipe does (the
plan's activation spec of its first linear's input), or int8 per tensor where the recipe has none.

The groups are a fact of the model: the plan's (``Plan.groups``, which ``bridge.plan`` fills from its
architecture tables, ``bridge.arch``); a ``groups`` option, dicts ``{"prev": ..., "linears": [...]}``,
replaces them for this step.

>>> import torch, qtransform as qt
>>> from qtransform.algorithms.smoothquant import scales
>>> scales(torch.tensor([4.0, 1.0]), torch.tensor([1.0, 4.0]), alpha=0.5).tolist()
[2.0, 0.5]
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..observers import finalize_stats, init_stats
from ..spec import Site
from .base import BlockInputs, Fit, register_algorithm
from .options import option, options_checker, received
from .smoothing import as_groups, block_groups, fold, input_module, quantized_linears, weight_path
from .smoothquant_math import (EPS, SCORES, Choice, _group_scales, check_activation, sample_stats, scales,
                               search_alpha, smooth)

__all__ = ["EPS", "scales", "smooth", "search_alpha", "Choice", "Options", "check_options", "step"]

@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """``smoothquant``'s options.

    >>> check_options(alpha=1.5)
    Traceback (most recent call last):
    ...
    ValueError: smoothquant: alpha must be a number in [0, 1] or "auto", got 1.5
    """

    alpha: float | str = option(0.5, expect='a number in [0, 1] or "auto"', doc='migration strength in [0, 1], or "auto" (searched per group)')
    groups: list | None = option(None, doc="smoothing groups replacing the plan's (Plan.groups)")
    activation: Any = option(None, doc='alpha="auto": the activation spec (a QuantSpec dict) the search uses')
    grid: int | None = option(None, ge=2, doc='alpha="auto": points of the alpha grid (default 11)')
    tokens: int | None = option(None, ge=1, doc='alpha="auto": sampled rows per group and block (default 1024)')
    score: str | None = option(None, doc='alpha="auto": "calibration" (default: candidates scored on the rows their '
                               'scales and range come from) or "heldout" (on sequences those did not see)')

    def __post_init__(self):
        a = self.alpha
        if a != "auto" and (isinstance(a, str) or not 0 <= a <= 1):  # NaN fails
            raise ValueError(f'alpha must be a number in [0, 1] or "auto", got {a!r}')
        extra = [k for k in ("activation", "grid", "tokens", "score") if getattr(self, k) is not None]
        if a != "auto" and extra:
            raise ValueError(f"{extra} apply to alpha='auto' (the search), not alpha={a!r}")
        if self.groups is not None:
            as_groups(self.groups)
        if self.activation is not None:
            check_activation(self.activation, where_="activation")
        if self.score is not None and self.score not in SCORES:
            raise ValueError(f"score must be one of {list(SCORES)}, got {self.score!r}")


check_options = options_checker("smoothquant", Options)


def step(params, plan, *, context, options: Options) -> Fit:
    """The ``smoothquant`` step on one block (``context.block``); see the module docstring."""
    o = received(Options, options, step="smoothquant")
    alpha, activation = o.alpha, o.activation
    groups = plan.groups if o.groups is None else o.groups
    if groups is None:
        raise ValueError("smoothquant: no smoothing groups: the plan has none (Plan.groups; bridge.plan fills them "
                         "from the model's architecture table, bridge.arch) and no groups option was given")
    block = context.block
    if block is None:
        raise ValueError("smoothquant runs block by block on calibration data (a calibrator's blockwise)")
    mine = block_groups(as_groups(groups), block.name, step="smoothquant", online=context.online)
    if not mine:
        return Fit()
    auto = alpha == "auto"
    if auto:
        stride = max(1, math.ceil((block.tokens or 0) / (o.tokens or 1024)))  # every row when uncounted
        want = {Site(input_module(g), "input"): sample_stats(stride) for g in mine}
    else:
        want = {Site(input_module(g), "input"): init_stats(observer="channel") for g in mine}
    stats = block.site_stats({}, want)
    recipe_acts = (getattr(plan, "activations", None) or {}) if auto and activation is None else {}
    current, changed, info = dict(params), {}, {}
    for g in mine:
        site = Site(input_module(g), "input")
        summary = finalize_stats(stats[site], path=site.module)
        if auto:
            specs = {lin: plan.specs.get(weight_path(g, lin)) for lin in quantized_linears(g)}
            act = activation if activation is not None else recipe_acts.get(
                Site(plan.site_module(weight_path(g, quantized_linears(g)[0])), "input"))
            choice = search_alpha(summary, current, g, activation=act, weight_specs=specs, grid=o.grid or 11,
                                  score=o.score or "calibration")
            s, chosen = choice.scales, choice.alpha
        else:
            s, chosen = _group_scales(current, g, summary.absmax, float(alpha)), float(alpha)
        for lin in quantized_linears(g):  # the report says what each linear got ("none": left unsmoothed)
            info[weight_path(g, lin)] = {"smoothquant_alpha": "none" if chosen is None else f"{chosen:g}"}
        if s is None:
            continue
        new = fold(current, g, s)
        current.update(new)
        changed.update(new)
    return Fit(params=changed, info=info)


register_algorithm("smoothquant", step, needs=BlockInputs(), options=Options, requires=("groups",),
                   description="SmoothQuant: activation outliers folded into the weights (alpha fixed or 'auto')")

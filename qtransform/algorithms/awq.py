"""``awq``: activation-aware weight quantization (Lin et al., 2024), block by block on calibration data.

In each block (``context.block``) one run over the block's calibration inputs records the inputs of
every linear the plan quantizes and of the modules the smoothing groups feed (the attention for q/k/v,
the MLP for gate/up: the groups' ``inspect``). Then, for every group of the block (the plan's
``groups``, which the bridge fills from its architecture tables):

1. **scales** (:mod:`.awq_math`): ``s = x̄^α`` (optionally over the weights' magnitude, ``duo_scaling``)
   for ``α`` on a grid of ``grid`` points, scored by the output error of the inspected module with the
   group's linears quantized at ``W · diag(s)``; the best are folded into the tree (the producer's output
   channels ``÷ s``, the linears' input columns ``× s``: :func:`~qtransform.algorithms.smoothing.fold`),
   which leaves the float function unchanged. All groups are searched on the block as it came in, then
   folded (as the reference implementation does);
2. **clipping** (``clip=True``): every quantized linear of the block gets, per quantization block, the
   range shrink ``[p · min, p · max]`` (``p`` from 1 down to 0.45) that minimizes its output error on the
   recorded inputs (now divided by their group's scales): ``Σ d G dᵀ`` with ``G`` the inputs' Gram matrix
   over each column block (:func:`~qtransform.algorithms.clip_search.search_range`). The resulting
   parameters are the step's; with ``quantizer="hqq"`` HQQ's optimizer fits them instead (and scores the
   scale candidates), for HQQ specs (``uintN``, float zero point).

The statistics, the searches and the inputs carried to the next block use ``tokens`` calibration tokens:
whole batches spread over the data (all of them when there are fewer). Modules that compute each token's
output from that token alone (the MLP, a linear: the groups' ``local``) are scored on ``rows`` of those
tokens, evenly spaced; attention on whole sequences. A linear in no group (GPT-2's
MLP output) is clipped only. The chosen ``α`` is reported per linear (``Fit.info``: ``awq_alpha``,
``"none"`` where no scaling beat the unscaled weights).

Mixture-of-experts layers: the group of the MLP's norm holds the router, the stacked experts weights and the
shared experts (:mod:`.smoothing`); its search measures the routed MoE block's output with the experts
fake-quantized (every token is computed from itself alone: its rows are sampled), the routers scaled but
float. The stacked experts weights are not clipped (their routed inputs per expert are not recorded here):
the fit after the step quantizes them; their down projections are not scaled.

Options (defaults): ``grid`` (20), ``duo_scaling`` (False), ``clip`` (True), ``quantizer`` (``"rtn"``),
``tokens`` (2048), ``rows`` (512), ``groups`` (replaces the plan's ``Plan.groups``, which ``bridge.plan`` fills
from its architecture tables; a model without a table and no option is an error naming it),
``float_inputs`` (False: the block's inputs are the outputs of the blocks before it as quantized so far; True:
the float model's, as the reference implementation searches, each block then independent of how the earlier
ones were quantized), ``clip_range`` (``"both"``: ``[p · min, p · max]``; ``"magnitude"``: the reference's
clamp to ``±p · max|w|``, :mod:`.awq_clip`).

Its perplexity and time against round to nearest, GPTQ and llm-compressor: ``bench/bench_awq.py``
(``docs/awq.md``, ``docs/performance.md``).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch

from ..parallel import SERIAL, Parallel
from ..spec import Site, module_of
from .awq_clip import CLIP_RANGES, search_magnitude
from .awq_math import QUANTIZERS, search_scales
from .base import BlockInputs, Fit, register_algorithm
from .clip_search import input_gram, search_range
from .gptq import linear_weights
from .hqq_math import check_spec, optimize as hqq_optimize
from .options import option, options_checker, received
from .smoothquant_math import sample_stats
from .smoothing import (SmoothGroup, as_groups, block_groups, fold, group_shape, input_module, quantized_linears,
                        to_input, weight_path)

__all__ = ["step", "Options", "check_options", "DEFAULT_TOKENS"]

#: Calibration tokens the step uses by default (see the module docstring).
DEFAULT_TOKENS = 2048
#: Rows on which a token-local module (an MLP, a linear) is scored by default.
DEFAULT_ROWS = 512
_KEPT = 8192  # at most about this many input rows per linear are kept (every k-th) for the statistics


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """``awq``'s options (see the module docstring).

    >>> check_options(grid=0)
    Traceback (most recent call last):
    ...
    ValueError: awq: grid must be an int >= 1, got 0
    """

    grid: int = option(20, ge=1, doc="points of the alpha grid")
    duo_scaling: bool = option(False, doc="scales over the weights' magnitude too")
    clip: bool = option(True, doc="search clipping ranges after the scales")
    quantizer: str = option("rtn", choices=QUANTIZERS, doc="how candidates' weights are quantized")
    tokens: int = option(DEFAULT_TOKENS, ge=1, doc="calibration tokens used")
    rows: int = option(DEFAULT_ROWS, ge=1, doc="rows a token-local module is scored on")
    groups: list | None = option(None, doc="smoothing groups replacing the plan's (Plan.groups)")
    float_inputs: bool = option(False, doc="search on the float model's block inputs (as the reference does)")
    clip_range: str = option("both", choices=CLIP_RANGES, doc="how the clipping search shrinks a block's range")

    def __post_init__(self):
        if self.groups is not None:
            as_groups(self.groups)


check_options = options_checker("awq", Options)


def _tokens(*, options: Options) -> int:
    return options.tokens


def _float_inputs(*, options: Options) -> bool:
    return options.float_inputs


def _specs(plan, group: SmoothGroup) -> dict:
    return {lin: plan.specs.get(weight_path(group, lin)) for lin in quantized_linears(group)}


def _check_hqq(plan, paths) -> None:
    for p in paths:
        check_spec(plan.specs[p], path=p)


def _sampled(inputs: list, n: int, parallel: Parallel = SERIAL) -> tuple[list, bool]:
    """The inputs of a token-local module as one call on at most ``n`` of their rows, evenly spaced over all
    ranks' rows (each rank sends the rows of the spacing that fall in its share, in rank order: the one-process
    sample), and ``True``; or the inputs themselves (when a call holds other tensors than the one being
    sampled, or there are no more than ``n`` rows) and ``False``: then each rank holds only its share."""
    found = []
    for args, kwargs in inputs:
        tensors = [(i, v) for i, v in enumerate(args) if isinstance(v, torch.Tensor)] + [
            (k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        if len(tensors) != 1 or tensors[0][1].dim() < 2:
            return inputs, False
        found.append(tensors[0])
    x = torch.cat([t.reshape(-1, t.shape[-1]) for _, t in found])
    counts = [x.shape[0]] if parallel.world == 1 else parallel.gather(x.shape[0])
    total = sum(counts)
    if total <= n:
        return inputs, False
    picks = torch.linspace(0, total - 1, n, device=x.device).round().long()
    if parallel.world == 1:
        x = x[picks]
    else:
        start = sum(counts[:parallel.rank])
        mine = picks[(picks >= start) & (picks < start + x.shape[0])] - start
        x = torch.cat(parallel.gather(x[mine])).to(x.device)
    where_, t = found[0]
    x = x.reshape(*([1] * (t.dim() - 2)), n, t.shape[-1])
    args, kwargs = inputs[0]
    if isinstance(where_, int):
        return [(tuple(x if i == where_ else a for i, a in enumerate(args)), kwargs)], True
    return [(args, {**kwargs, where_: x})], True


def step(params, plan, *, context, options: Options) -> Fit:
    """The ``awq`` step on one block (``context.block``); see the module docstring."""
    o = received(Options, options, step="awq")
    quantizer, float_inputs = o.quantizer, o.float_inputs
    groups = plan.groups if o.groups is None else o.groups
    if groups is None:
        raise ValueError("awq: no smoothing groups: the plan has none (Plan.groups; bridge.plan fills them from the "
                         "model's architecture table, bridge.arch) and no groups option was given")
    block = context.block
    if block is None or block.capture is None or block.call is None:
        raise ValueError("awq runs block by block on calibration data, with a calibrator whose blocks can record "
                         "and call their modules (bridge.quantize(..., calibration=...))")
    weights = linear_weights(params, plan, block.paths)
    if quantizer == "hqq":
        _check_hqq(plan, [p for p in weights if params[p].dim() != 3])
    mine = [g for g in block_groups(as_groups(groups), block.name, step="awq", online=context.online)
            if any(s is not None for s in _specs(plan, g).values())]
    if not weights:
        return Fit()
    targets = {g.prev: ([g.inspect] if g.inspect else list(g.linears)) for g in mine}
    modules = sorted({m for t in targets.values() for m in t})
    # stacked experts weights are scaled with their group; no clipping (each expert's routed inputs are not
    # recorded here): the fit that follows quantizes them
    clipped = [p for p in weights if params[p].dim() != 3]
    source = {module_of(p): module_of(p) for p in clipped}  # whose recorded input each linear reads
    source.update({lin: input_module(g) for g in mine for lin in g.linears if lin not in g.stacked})  # one shared
    stride = max(1, -(-(block.tokens or 0) // _KEPT))  # rows kept for the means and Gram matrices (all: uncounted)
    sites = {Site(m, "input"): sample_stats(stride) for m in set(source.values())}
    if float_inputs and block.float_inputs is None:
        raise ValueError(f"block {block.name}: awq: float_inputs=True needs the float model's block inputs "
                         "(Block.float_inputs); the calibrator gave none")
    captured, stats = block.capture({}, modules, sites, inputs=list(block.float_inputs) if float_inputs else None)
    seen = {lin: stats[Site(m, "input")].rows for lin, m in source.items()}
    seen.update({lin: seen[input_module(g)] for g in mine for lin in g.stacked})
    original = dict(params)
    local = {m for g in mine for m in targets[g.prev] if g.local or not g.inspect}  # token-local: sampled rows
    local -= {m for g in mine for m in targets[g.prev] if g.inspect and not g.local}
    par = block.parallel
    captured = {m: _sampled(v, o.rows, par) if m in local else (v, False) for m, v in captured.items()}
    shared = {m: same for m, (_, same) in captured.items()}  # the same inputs on every rank
    captured = {m: v for m, (v, _) in captured.items()}

    def runner(names):
        return lambda tensors: [block.call(m, tensors, a, k) for m in names for a, k in captured[m]]

    reduce = None if par.world == 1 else par.all_sum  # errors over each rank's share add up over the ranks

    def part(names):  # the same inputs on every rank: each scores its part of the candidates
        return (par.rank, par.world) if par.world > 1 and all(shared[m] for m in names) else None

    chosen, info = [], {}
    for g in context.track(mine, desc=f"awq {block.name}"):
        choice = search_scales(runner(targets[g.prev]), original, g, seen[input_module(g)].abs().mean(0),
                               specs=_specs(plan, g), grid=o.grid, duo_scaling=o.duo_scaling, quantizer=quantizer,
                               reduce=reduce, part=part(targets[g.prev]))
        for lin in quantized_linears(g):
            info[weight_path(g, lin)] = {"awq_alpha": "none" if choice.index == 0 else f"{choice.alpha:g}"}
        if choice.index:
            chosen.append((g, choice.scales))
    current, changed, in_scale = dict(params), {}, {}
    for g, s in chosen:
        new = fold(current, g, s)
        current.update(new)
        changed.update(new)
        s_in = to_input(s, g, group_shape(original, g))
        in_scale.update({lin: s_in for lin in g.linears if lin not in g.stacked})
    qparams = _fit_weights(current, plan, clipped, seen, source, in_scale, o.clip, quantizer, par, o.clip_range)
    return Fit(params=changed, qparams=qparams, info=info)


def _fit_weights(current: Mapping, plan, weights, rows, source, in_scale, clip: bool, quantizer: str,
                 parallel: Parallel, clip_range: str) -> dict:
    """Each quantized linear's parameters: HQQ's, or the clipping search's on its (scaled) inputs (one Gram
    matrix per shared input and spec: q/k/v, gate/up). On several ranks (every rank holding every linear's
    inputs) each linear is searched by one owner (:meth:`~qtransform.Parallel.owners` by its size) and the
    parameters are shared."""
    if quantizer != "hqq" and not clip:
        return {}
    owners = parallel.owners({p: float(current[p].numel()) for p in weights})  # all rank 0's in one process
    mine = [p for p in weights if owners[p] == parallel.rank]
    if quantizer == "hqq":
        out = {p: hqq_optimize(current[p], plan.specs[p], path=p) for p in mine}
    else:
        out, grams = {}, {}
        for p in mine:
            lin, spec, w = module_of(p), plan.specs[p], current[p]
            in_axis = 0 if plan[p].module_type == "Conv1D" else 1
            key = (source[lin], spec, in_axis, w.shape[in_axis])
            if key not in grams:
                x = rows[lin] if lin not in in_scale else rows[lin] / in_scale[lin].to(rows[lin])
                grams[key] = input_gram(x, spec, tuple(w.shape), in_axis=in_axis, path=p)
            if clip_range == "both":
                out[p] = search_range(w, spec, gram=grams[key], in_axis=in_axis, path=p)
            else:
                out[p] = search_magnitude(w, spec, gram=grams[key], in_axis=in_axis, path=p)
    return parallel.share(out, owners)


register_algorithm("awq", step, needs=BlockInputs(tokens=_tokens, float_inputs=_float_inputs), options=Options, requires=("groups",),
                   description="AWQ: per-channel scales searched on activations, then clipping ranges")

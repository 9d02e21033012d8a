"""``gptq``: the GPTQ step, block by block on calibration data (:mod:`.gptq_math` is the solver).

In each block (``context.block``), every linear weight the plan quantizes (``Linear`` and
``Conv1D`` weights, or 2-D ``*.weight`` tensors when the plan knows no module types) gets the
Hessian of its input, ``XᵀX / n`` over the block's calibration inputs (the outputs of the blocks
before it, already quantized), and is solved by GPTQ. Linears that read the same input (the
plan's ``groups``, which the bridge fills from its architecture tables: q/k/v, gate/up...) share one Hessian
and one solve. With ``true_sequential=True`` the groups run in order, each one's Hessians
collected with the groups before it already quantized (q/k/v before o, gate/up before down);
otherwise one pass over the block's inputs collects them all. Other tensors of the block are
left to the next steps (round to nearest when none fits them).

The result is the quantized weights (on the spec's grid) and their quantization parameters; the
layers' GPTQ losses are in ``Fit.info`` (``{"gptq_loss": ...}`` per weight path).

Options (defaults): ``damp`` (0.01), ``block_size`` (128), ``act_order`` (True),
``static_groups`` (True: group parameters fixed before the column loop, so act-order needs no
``g_idx``; ``act_order`` with dynamic groups would make group membership a permutation, which
qtransform checkpoints do not store: the solver gives it, the step refuses it), ``init``
(``"clip"``: each group's clipping searched for the smallest error weighted by its inputs' energy;
``"minmax"``: the textbook ranges, from ``observer``; ``"hqq"``), ``observer`` (the range observer of
``init="minmax"``: ``"minmax"``, ``"mse"``...), ``true_sequential`` (False), ``groups`` (replaces
the plan's ``Plan.groups``; without either, every linear gets its own Hessian), ``expert_min_tokens`` (8) and
``expert_fallback`` (``"rtn"``): the stacked weights of a mixture-of-experts layer are solved expert by expert,
each from the Hessian of the tokens routed to it; an expert with fewer tokens gets the data-free fit, and
``Fit.info`` lists every expert's tokens and what was done (:mod:`.experts`).

``gptaq`` (False) and ``gptaq_alpha`` (0.25): GPTAQ (:mod:`.gptaq_math`; Li et al. 2025, GPTQModel's "GPTQ
v2"): each shared solve targets the float model's outputs, ``min ‖Q X̃ − W X‖²``, with ``X̃`` its inputs on the
quantized path (earlier blocks quantized, and with ``true_sequential`` the stage's earlier layers) and ``X``
the float model's inputs for the same tokens (the calibrator's float chain, ``BlockInputs(float_inputs=)``).
Besides ``H = X̃ᵀX̃ / n`` it folds ``D = (X − X̃)ᵀX̃ / n``, batch by batch (one batch's inputs on both paths
alive at a time), summed over the ranks. The stacked weights of a mixture-of-experts layer are solved by
plain GPTQ: the router may send a token to different experts on the two paths, so an expert's tokens do not
pair up; ``Fit.info`` says so (``{"gptaq": "experts: gptq"}``).

``init="clip"`` against ``init="minmax"``, true-sequential and llm-compressor's GPTQ, in perplexity and
time: ``bench/bench_gptq.py`` (``docs/gptq.md``, ``docs/performance.md``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from ..observers import finalize_stats, init_stats, observe
from ..spec import Site, transposed_spec
from ..tensor import dequantize, quantize, transposed_qparams
from .base import BlockInputs, Fit, register_algorithm
from .experts import FALLBACKS, experts_cost, fit_experts
from .gptaq_math import cross
from .gptq_math import QPARAMS_INITS, gptq_many
from .options import option, options_checker, received
from .rtn import check_range_observer

__all__ = ["step", "Options", "check_options", "linear_weights"]

#: The module types whose 2-D weights are linear maps (GPT-2's Conv1D stores one transposed): what GPTQ solves and
#: the presets quantize (``qtransform.pipeline.LINEAR_TYPES``).
LINEAR_TYPES = ("Linear", "Conv1D")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """``gptq``'s options (see the module docstring).

    >>> check_options(damp=-1)
    Traceback (most recent call last):
    ...
    ValueError: gptq: damp must be a number >= 0, got -1
    """

    damp: float = option(0.01, ge=0, doc="damping, a fraction of the Hessian's mean diagonal")
    block_size: int = option(128, ge=1, doc="columns per lazy-batch block")
    act_order: bool = option(True, doc="columns by decreasing Hessian diagonal")
    static_groups: bool = option(True, doc="group parameters fixed before the column loop")
    init: str = option("clip", choices=QPARAMS_INITS, doc="how group parameters are chosen")
    observer: Any = option(None, doc="init='minmax': the range observer")
    true_sequential: bool = option(False, doc="groups solved in order, Hessians collected anew")
    groups: list | None = option(None, doc="smoothing groups replacing the plan's (Plan.groups)")
    expert_min_tokens: int = option(8, ge=1, doc="experts with fewer calibration tokens fall back")
    expert_fallback: str = option("rtn", choices=FALLBACKS, doc="the data-free fit of such an expert")
    gptaq: bool = option(False, doc="GPTAQ: fit the float model's outputs from the quantized path's inputs")
    gptaq_alpha: float = option(0.25, ge=0, doc="GPTAQ: scale of the asymmetric term")

    def __post_init__(self):
        if self.act_order and not self.static_groups:
            raise ValueError("act_order=True with static_groups=False puts input columns in groups by a permutation "
                             "(g_idx), which qtransform's checkpoints do not store; use static_groups=True (the "
                             "default) or act_order=False")
        if self.observer is not None:
            if self.init != "minmax":
                raise ValueError(f"observer applies to init='minmax', not init={self.init!r} (pass init='minmax')")
            check_range_observer(self.observer)
        if self.gptaq_alpha != 0.25 and not self.gptaq:
            raise ValueError(f"gptaq_alpha applies to gptaq=True, got gptaq_alpha={self.gptaq_alpha!r} with gptaq=False")
        if self.groups is not None and not all(
                isinstance(g, Mapping) and isinstance(g.get("linears"), (list, tuple)) for g in self.groups):
            raise ValueError(f"groups must be a list of {{'prev': ..., 'linears': [...]}} dicts, got {self.groups!r:.80}")


check_options = options_checker("gptq", Options)


def linear_weights(params: Mapping[str, torch.Tensor], plan, paths) -> list[str]:
    """The paths among ``paths`` that GPTQ solves: quantized 2-D linear weights and stacked experts weights."""
    out = []
    for p in paths:
        match = plan.get(p)
        if match is not None and match.spec is not None and match.module_type == "Experts" and params[p].dim() == 3:
            out.append(p)
            continue
        if match is None or match.spec is None or not p.endswith(".weight") or params[p].dim() != 2:
            continue
        if match.module_type is None or match.module_type in LINEAR_TYPES:
            out.append(p)
    return out


def _stages(weights: list[str], groups, true_sequential: bool) -> list[list[list[str]]]:
    """Stages (solved in order, Hessians collected anew for each) of sharing sets (one Hessian each)."""
    left, sets = list(weights), []
    for g in groups or ():
        members = [f"{lin}.weight" for lin in g["linears"] if f"{lin}.weight" in left]
        if members:
            sets.append(members)
            left = [p for p in left if p not in members]
    sets += [[p] for p in left]
    return [[s] for s in sets] if true_sequential else [sets]


def _solve_experts(path: str, stats, params, plan, options) -> tuple[dict, dict, dict]:
    """GPTQ of each expert of a stacked experts weight from its own tokens' Hessian (see :mod:`.experts`)."""
    solver = {k: v for k, v in options.items() if not k.startswith(("expert_", "gptaq"))}

    def solve(W, H, spec, at):
        r = gptq_many([W], H, [spec], paths=[at], **solver)[0]
        losses.append(r.loss)
        return r.weight, r.qparams

    losses: list = []
    empty = [s.count is None or int(s.count) == 0 for s in stats]
    hessians = [None if e else finalize_stats(s, path=f"{path}[expert {i}]") for i, (s, e) in enumerate(zip(stats, empty))]
    tokens = [0 if e else int(s.count) for s, e in zip(stats, empty)]
    new, qp, info = fit_experts(params[path], hessians, tokens, plan.specs[path], solve, path=path,
                                transposed=path in plan.transposed_experts, min_tokens=options["expert_min_tokens"],
                                fallback=options["expert_fallback"])
    info["gptq_loss"] = float(f"{sum(losses):.6g}")
    return {path: new}, {path: qp}, {path: info}


def _is_experts(paths, plan) -> bool:
    return len(paths) == 1 and plan[paths[0]].module_type == "Experts"


def _solve_set(paths: list[str], H, params, plan, options, cross=None,
               keep: bool = False) -> tuple[dict, dict, dict, dict]:
    """GPTQ of one sharing set: ``(weights, qparams, info, unrounded)`` by path (unrounded weights only with
    ``keep``, and none for stacked experts)."""
    if _is_experts(paths, plan):
        new, qps, info = _solve_experts(paths[0], H, params, plan, options)
        if cross is not None or options["gptaq"]:
            info[paths[0]]["gptaq"] = "experts: gptq"
        return new, qps, info, {}
    alpha = options["gptaq_alpha"]
    options = {k: v for k, v in options.items() if not k.startswith(("expert_", "gptaq"))}
    if cross is not None:
        options.update(cross=cross, alpha=alpha)
    weights, specs, flips = [], [], []
    for p in paths:
        w, spec, flip = params[p], plan.specs[p], plan[p].module_type == "Conv1D"
        if flip:  # stored (in, out): solve the logical (out, in) weight
            w, spec = w.T, transposed_spec(spec, tuple(w.shape))
        weights.append(w)
        specs.append(spec)
        flips.append(flip)
    results = gptq_many(weights, H, specs, paths=paths, unrounded=keep, **options)
    new, qps, info, unrounded = {}, {}, {}, {}
    for p, r, flip in zip(paths, results, flips):
        qp = r.qparams
        if flip:
            qp = transposed_qparams(qp, plan.specs[p], path=p)
        new[p] = r.weight.T.contiguous() if flip else r.weight
        if r.unrounded is not None:
            unrounded[p] = r.unrounded.T.contiguous() if flip else r.unrounded
        qps[p] = qp
        info[p] = {"gptq_loss": float(f"{r.loss:.6g}")}  # 6 significant digits: small losses stay nonzero
        if cross is not None:
            info[p]["gptaq"] = f"alpha {alpha:g}"
    return new, qps, info, unrounded


def solve_cost(paths: list[str], params, plan) -> float:
    """The cost model of one shared solve: ``d_in³`` (the inverse Hessian's factorisation) plus ``d_out·d_in²``
    (the column loop) summed over the linears sharing the Hessian."""
    if len(paths) == 1 and plan[paths[0]].module_type == "Experts":
        return experts_cost(params[paths[0]].shape, paths[0] in plan.transposed_experts)
    d_in = d_out = 0
    for p in paths:
        out, inn = params[p].shape
        if plan[p].module_type == "Conv1D":  # stored (in, out)
            out, inn = inn, out
        d_in, d_out = inn, d_out + out
    return float(d_in) ** 3 + float(d_out) * float(d_in) ** 2


def _solve_stage(stage, sites, block, changed, params, plan, solver, context, keep: bool = False) -> dict:
    """One stage's shared solves: ``{path: (weight, qparams, info, unrounded or None)}`` (unrounded weights only
    with ``keep``: on several ranks they travel to every rank, in float32). Each solve has an owner
    (``block.parallel.owners`` by :func:`solve_cost`; rank 0 in one process) that gets its Hessian alone and
    solves it; on several ranks the results travel packed (the quantized tensor) to every rank."""
    par = block.parallel
    key = {Site(plan.site_module(s[0]), "input"): s for s in stage}
    owners = par.owners({site: solve_cost(s, params, plan) for site, s in key.items()})
    asym = [k for k, s in key.items() if solver["gptaq"] and not _is_experts(s, plan)]  # experts: plain GPTQ
    plain = {k: v for k, v in sites.items() if k not in asym}
    stats = {}
    if plain:
        stats = block.site_stats(changed, plain, owners=owners) if par.world > 1 else block.site_stats(changed, plain)
    crosses = {}
    if asym:
        for site, (H, D) in _asymmetric_stats(asym, block, changed).items():
            stats[site], crosses[site] = H, D
    out = {}
    for site in context.track([k for k in key if owners[k] == par.rank], desc=f"gptq {block.name}"):
        s = key[site]
        H = stats.pop(site)  # each Hessian freed once used
        H = H if isinstance(H, (tuple, torch.Tensor)) else finalize_stats(H, path=s[0])  # experts: one per expert
        new, qps, more, unr = _solve_set(s, H, params, plan, solver, cross=crosses.pop(site, None), keep=keep)
        out[site] = {p: (new[p], qps[p], more[p], unr.get(p)) for p in s}
    if par.world > 1:
        packed = {site: {p: (quantize(w, qp, path=p), i, u) for p, (w, qp, i, u) in v.items()}
                  for site, v in out.items()}
        out = {site: {p: (dequantize(q), q.qparams, i, u) for p, (q, i, u) in v.items()}
               for site, v in par.share(packed, owners).items()}
    return {p: v for site in key for p, v in out[site].items()}


def _asymmetric_stats(sites: list, block, changed) -> dict:
    """``{Site: (H, D)}``: GPTAQ's ``X̃ᵀX̃ / n`` and ``(X − X̃)ᵀX̃ / n`` (float32) at each site's module input,
    ``X̃`` on the quantized path (``changed`` applied), ``X`` on the float path, batch by batch; over all ranks."""
    if block.float_inputs is None:
        raise ValueError(f"block {block.name}: gptaq needs the float model's inputs of the block "
                         "(BlockInputs(float_inputs=)); the calibrator gave none")
    if len(block.float_inputs) != len(block.inputs):
        raise ValueError(f"block {block.name}: gptaq: {len(block.float_inputs)} float batches for "
                         f"{len(block.inputs)} quantized ones; the two paths must carry the same batches")
    modules = [s.module for s in sites]
    hs, ds = {s: init_stats(observer="hessian") for s in sites}, {s: None for s in sites}
    par, n = block.parallel, len(block.inputs)
    rounds = max(par.gather(n)) if par.world > 1 else n  # every rank captures as often (each capture reduces)
    for i in range(rounds):  # one batch of both paths alive at a time
        q, _ = block.capture(changed, modules, inputs=list(block.inputs[i:i + 1]))
        f, _ = block.capture({}, modules, inputs=list(block.float_inputs[i:i + 1]))
        for s in sites:
            if len(q[s.module]) != len(f[s.module]):
                raise ValueError(f"{s.module}: gptaq: called {len(q[s.module])} times on the quantized path and "
                                 f"{len(f[s.module])} on the float path for one batch")
            for qa, fa in zip(q[s.module], f[s.module]):
                xq, x = _first(*qa, s.module), _first(*fa, s.module)
                hs[s] = observe(hs[s], xq, path=f"{s.module} (input)", donate=hs[s].xtx is not None)
                d = cross(x, xq).to(torch.float64)
                ds[s] = d if ds[s] is None else ds[s].add_(d)
    if par.world > 1:  # a rank whose share never reached a module adds zeros of the others' width
        widths = par.gather([None if ds[s] is None else ds[s].shape[0] for s in sites])
        for k, s in enumerate(sites):
            w = next((g[k] for g in widths if g[k] is not None), None)
            if ds[s] is None and w is not None:
                ds[s] = torch.zeros(w, w, dtype=torch.float64)
    hs = par.reduce_stats(hs)
    out = {}
    for s in sites:  # the same decisions on every rank: the widths were gathered
        if ds[s] is None or hs[s].count is None or int(hs[s].count) == 0:
            raise ValueError(f"block {block.name}: gptaq: no activation reached {s.module}")
        d = par.all_sum(ds[s]) if par.world > 1 else ds[s]
        out[s] = (finalize_stats(hs[s], path=s.module), (d / float(hs[s].count)).to(torch.float32))
    return out


def _first(args, kwargs, module: str) -> torch.Tensor:
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v.detach()
    raise ValueError(f"{module}: gptaq: the module's input holds no tensor")


def step(params, plan, *, context, options: Options) -> Fit:
    """The ``gptq`` step on one block (``context.block``); see the module docstring."""
    changed, qparams, info, _ = solve_block(params, plan, context=context, options=options)
    return Fit(params=changed, qparams=qparams, info=info)


def solve_block(params, plan, *, context, options: Options, unrounded: bool = False) -> tuple[dict, dict, dict, dict]:
    """GPTQ of one block's planned linear weights (``options``: the step's :class:`Options`, checked here):
    ``(weights, qparams, info, unrounded)`` by path; with ``unrounded``, the last holds for each 2-D linear weight
    the weight as its columns stood when rounded (:attr:`.gptq_math.GPTQResult.unrounded`; none for stacked experts,
    solved expert by expert). The ``gptq`` step's result, and a learned step's start (``signround``'s
    ``init="gptq"``)."""
    o = received(Options, options, step="gptq")
    block = context.block
    if block is None:
        raise ValueError("gptq runs block by block on calibration data (a calibrator's blockwise)")
    weights = linear_weights(params, plan, block.paths)
    if not weights:
        return {}, {}, {}, {}
    solver = dict(damp=float(o.damp), block_size=o.block_size, act_order=o.act_order, static_groups=o.static_groups,
                  init=o.init, observer=o.observer, expert_min_tokens=o.expert_min_tokens,
                  expert_fallback=o.expert_fallback, gptaq=o.gptaq, gptaq_alpha=float(o.gptaq_alpha))
    groups = plan.groups if o.groups is None else o.groups  # the plan's where the model is known; none is fine
    mine = [g for g in groups or () if all(lin.startswith(block.name + ".") for lin in g["linears"])]
    changed, qparams, info, kept = {}, {}, {}, {}
    for stage in _stages(weights, mine, o.true_sequential):
        sites = {Site(plan.site_module(s[0]), "input"): init_stats(observer="hessian") for s in stage}
        for p, (w, qp, more, u) in _solve_stage(stage, sites, block, changed, params, plan, solver, context,
                                                unrounded).items():
            changed[p], qparams[p], info[p] = w, qp, more
            if u is not None:
                kept[p] = u
    return changed, qparams, info, kept


register_algorithm("gptq", step, needs=BlockInputs(float_inputs=lambda *, options: options.gptaq), options=Options,
                   description="GPTQ: columns quantized in order, errors compensated through the inverse Hessian")

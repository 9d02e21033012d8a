"""``qat``: quantization-aware training block by block (EfficientQAT's Block-AP, Chen et al. 2024): each block's
weights *and* quantization parameters trained against the float block's outputs on the calibration data.

For each block, with ``X_q`` its inputs on the quantized chain (the earlier blocks quantized) and ``Y`` the float
block's outputs on the float chain's inputs (computed once)::

    W, r = the start                        for every tensor the plan quantizes in the block (float32 copies)
                                            r: its learnable ranges (qtransform.learn.LearnedRange)
    for t in 0 .. iters-1:
        B   = the next batches of a seeded shuffle (batch_size calibration sequences)
        L_t = mean over B of || block(X_q; fake_quantize(W, r)) - Y ||^2      (one torch.func grad call)
        W <- Adam(W, dL/dW, lr * cos_t)          (weights=True: Block-AP; False: the ranges alone)
        r <- Adam(r, dL/dr, range_lr * cos_t)    (LSQ/LSQ+ gradients through the format's stored parameters)
    keep the lower of the start and the trained state on the judging batches                     (best=True)

``fake_quantize`` is :func:`qtransform.learn.fake_quantize`: forward, bit for bit the format's round trip with
the parameters :func:`qtransform.learn.to_qparams` stores, so the packed result is exactly what trained. The
start (``init``) is round to nearest from min-max ranges (``"minmax"``), GPTQ's solution of the block
(``"gptq"``: its weights as its columns stood when rounded, the ranges its parameters stand for) or GPTAQ's
(``"gptaq"``). Every tensor the plan quantizes statically in the block trains (linears, stacked experts,
convolutions); a cast (bf16, fp16) trains its weights only.

Options (defaults): ``iters`` (100), ``lr`` (1e-5: the weights' Adam step size, EfficientQAT's order for 2-4 bits),
``range_lr`` (1e-4: the ranges'), both under a cosine decay to 0; ``weights`` (True; False: the ranges alone, the
"learned clipping" of OmniQuant); ``batch_size`` (4 calibration sequences per iteration), ``init``, ``zero_point``
(``"ste"``: LSQ+'s straight-through integer zero point; ``"round"``), ``best``, ``holdout`` (5: every fifth batch
judges the kept state and does not train), ``quantized_inputs`` (True), ``activations`` (True: the plan's
activation quantizers, W4A4's int4 inputs, fake-quantize inside the block while it trains and is judged, so the
weights learn under them), ``weight_decay`` (0), ``seed``, ``tokens``. ``Fit.info`` holds per tensor ``qat_loss`` (the kept state's block output MSE on the judging batches)
and ``start_loss``.

On several ranks each rank computes the gradient on its share of the picked batches; the ranks add them in
float64 (one ``all_sum`` per iteration, :func:`.block_training.reduce_sums`) and take the same Adam step.
``docs/qat.md``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .. import learn
from ..learn.optim import adam_init, adam_update, cosine
from ..tensor import QParams, blocks, dequantize, fake_quantize, quantize
from .base import BlockInputs, Fit, register_algorithm
from .block_training import block_mse, chains, first_tensor, reduce_sums, schedule, training_block
from .gptq import Options as GPTQOptions
from .gptq import solve_block as gptq_solve
from .options import option, options_checker, received

__all__ = ["step", "Options", "check_options", "QAT_INITS"]

#: Where the training starts: round to nearest from min-max ranges, GPTQ's or GPTAQ's solution of the block.
QAT_INITS = ("minmax", "gptq", "gptaq")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """``qat``'s options (see the module docstring).

    >>> check_options(lr=0)
    Traceback (most recent call last):
    ...
    ValueError: qat: lr must be a number > 0, got 0
    """

    iters: int = option(100, ge=0, doc="Adam steps per block")
    lr: float = option(0.02, gt=0, doc="the weights' step size in units of their group's quantization step "
                                      "(cosine decay to 0)")
    range_lr: float = option(0.005, gt=0, doc="the learned ranges' step size in units of their width (cosine decay)")
    weights: bool = option(True, doc="train the weights with the ranges (Block-AP); False: the ranges alone")
    batch_size: int = option(4, ge=1, doc="calibration sequences per iteration")
    init: str = option("minmax", choices=QAT_INITS, doc="the start: min-max ranges, GPTQ's or GPTAQ's solution")
    zero_point: str = option("ste", choices=learn.ZERO_POINTS,
                             doc="integer zero point's gradient: straight-through (LSQ+) or none")
    best: bool = option(True, doc="keep the start where it is lower on the judging batches")
    holdout: int = option(5, ge=0, expect="an int, 0 (none) or >= 2",
                          doc="every holdout-th calibration batch judges instead of training")
    quantized_inputs: bool = option(True, doc="train on the quantized chain's block inputs (False: the float chain's)")
    activations: bool = option(True, doc="the plan's activation quantizers fake-quantize inside the block while it "
                                         "trains and is judged (W4A4, W8A8: the weights learn under them)")
    weight_decay: float = option(0.0, ge=0, doc="AdamW's decoupled weight decay of the weights")
    seed: int = option(0, ge=0, doc="the batches' shuffle")
    tokens: int | None = option(None, ge=1, doc="calibration tokens used (None: all given)")

    def __post_init__(self):
        if self.holdout == 1:
            raise ValueError("holdout must be an int, 0 (none) or >= 2, got 1 (every batch held out)")


check_options = options_checker("qat", Options)


def trained_paths(params, plan, paths) -> list[str]:
    """The tensors of ``paths`` that the plan quantizes with a static spec (what trains)."""
    return [p for p in paths if (m := plan.get(p)) is not None and m.spec is not None and not m.spec.dynamic
            and isinstance(params.get(p), torch.Tensor) and params[p].is_floating_point()]


def _start(params, plan, context, paths, init: str):
    """``({path: float32 weight}, {path: LearnedRange}, {path: QParams of the start})``."""
    weights, ranges, start = {}, {}, {}
    solved = {}
    if init in ("gptq", "gptaq"):
        _, qparams, _, unrounded = gptq_solve(params, plan, context=context,
                                              options=GPTQOptions(gptaq=init == "gptaq"), unrounded=True)
        solved = {p: (unrounded[p], qparams[p]) for p in paths if p in unrounded and p in qparams}
    for p in paths:
        spec = plan.specs[p]
        if p in solved and spec.fmt.sub_block is None:
            w, qp = solved[p]
            weights[p] = w.detach().to(torch.float32)
            ranges[p], start[p] = _range_of(qp, p), qp
        else:
            weights[p] = params[p].detach().to(torch.float32)
            ranges[p] = learn.learnable(weights[p], spec, path=p)
            start[p] = learn.to_qparams(ranges[p], path=p)
    return weights, ranges, start


def _range_of(qp: QParams, path: str) -> learn.LearnedRange:
    """The range standing exactly for ``qp`` where one does, else the one it stands for (the start itself is kept
    as ``qp`` either way)."""
    try:
        return learn.exact_range(qp, path=path)
    except ValueError:
        return learn.from_qparams(qp, path=path)


def step(params, plan, *, context, options: Options) -> Fit:
    """The ``qat`` step on one block (``context.block``); see the module docstring."""
    o = received(Options, options, step="qat")
    block = training_block(context, "qat")
    paths = trained_paths(params, plan, block.paths)
    if not paths:
        return Fit()
    weights, ranges, start = _start(params, plan, context, paths, o.init)
    learned = [p for p in paths if learn.ranged(plan.specs[p])]
    dtypes = {p: params[p].dtype for p in paths}
    targets, inputs = chains(block, "qat", o.quantized_inputs)
    par = block.parallel
    plan_ = schedule(inputs, par, batch_size=o.batch_size, holdout=o.holdout, seed=o.seed)

    acts = o.activations and bool(plan.activations)

    def run(tensors, args, kwargs):
        return block.call(block.name, tensors, args, kwargs, **({"activations": True} if acts else {}))

    def error(state, i):
        tensors = {p: learn.fake_quantize(state[f"{p}:w"], learn.LearnedRange(
            lo=state[f"{p}:lo"], hi=state[f"{p}:hi"], spec=plan.specs[p]) if p in learned else ranges[p],
            zero_point=o.zero_point, path=p).to(dtypes[p]) for p in paths}
        args, kwargs = inputs[i]
        return block_mse(first_tensor(run(tensors, args, kwargs), "qat"), targets[i])

    def judged(tensors) -> float:
        """The block's output MSE with ``tensors`` on the judging batches (all ranks'), summed in float64."""
        sse = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            for i in plan_.judge:
                args, kwargs = inputs[i]
                out = first_tensor(run(tensors, args, kwargs), "qat")
                sse = sse + block_mse(out, targets[i]).to(torch.float64)
        _, sse, count = reduce_sums({}, sse, float(sum(targets[i].numel() for i in plan_.judge)), par)
        return float(sse) / max(count, 1.0)

    state = {f"{p}:w": weights[p] for p in paths}
    for p in learned:
        state[f"{p}:lo"], state[f"{p}:hi"] = ranges[p].lo, ranges[p].hi
    keys = sorted(state)
    rates = {}
    for p in paths:  # step sizes in units of each group's quantization step (weights) and range width (ranges)
        rates[f"{p}:w"] = o.lr * _step_units(weights[p], start[p]) if o.weights else 0.0
        if p in learned:
            width = (ranges[p].hi - ranges[p].lo).abs()
            width = torch.where(width > 0, width, ranges[p].hi.abs().clamp_min(1e-12))
            rates[f"{p}:lo"] = rates[f"{p}:hi"] = o.range_lr * width
    adam = adam_init(state)
    grad_and_value = torch.func.grad_and_value(error)
    for t in context.track(range(o.iters), desc=f"qat {block.name}", total=o.iters):
        # one gradient per batch, added in float64: exact for the few batches of a step, so any split of them over
        # ranks (each adding its own, then one all_sum) gives the one-process sum bit for bit
        total = {k: torch.zeros(state[k].shape, dtype=torch.float64, device=state[k].device) for k in keys}
        for i in plan_.local(plan_.sampler.next()):
            g, _ = grad_and_value(state, i)
            total = {k: total[k] + g[k].to(torch.float64) for k in keys}
        summed, _, _ = reduce_sums({"g": tuple(total[k] for k in keys)}, torch.zeros(()), 0.0, par)
        grads = {k: v.to(torch.float32) for k, v in zip(keys, summed["g"])}
        factor = cosine(t, o.iters)
        state, adam = adam_update(state, grads, adam, lr={k: r * factor for k, r in rates.items()},
                                  weight_decay=o.weight_decay)
    trained = {p: learn.to_qparams(learn.LearnedRange(lo=state[f"{p}:lo"], hi=state[f"{p}:hi"], spec=plan.specs[p]),
                                   path=p) if p in learned else start[p] for p in paths}
    start_state = {p: (weights[p], start[p]) for p in paths}
    trained_state = {p: (state[f"{p}:w"], trained[p]) for p in paths}

    def score(cand) -> float:
        return judged({p: fake_quantize(w, qp, path=p).to(dtypes[p]) for p, (w, qp) in cand.items()})

    losses = {"start": score(start_state),
              "trained": score(trained_state) if o.iters else math.nan}
    keep_start = not o.iters or (o.best and losses["start"] <= losses["trained"])
    name, kept = ("start", start_state) if keep_start else ("trained", trained_state)
    new, qparams, info = {}, {}, {}
    for p, (w, qp) in kept.items():
        new[p] = _on_grid(w, qp, dtypes[p], p)
        qparams[p] = qp
        info[p] = {"qat_loss": float(f"{losses[name]:.6g}"), "start_loss": float(f"{losses['start']:.6g}"),
                   "kept": name}
    return Fit(params=new, qparams=qparams, info=info)


def _step_units(w: torch.Tensor, qp: QParams) -> torch.Tensor:
    """Each element's quantization step at the start: the distance between the grid points around it (its block's
    scale on integer grids; NF4's and the minifloats' local spacing), shaped like ``w``."""
    p = blocks.tiling(w.shape, qp.spec, sub_block=True)
    s, z = qp.effective()
    s = blocks.expand(s.detach().to(torch.float32).abs(), p)
    xb = blocks.view(w.detach().to(torch.float32), p)
    z = None if z is None else blocks.expand(z.detach().to(torch.float32), p)
    if z is None:
        v = xb / s
    else:
        v = (xb - z) / s if qp.spec.zero_point_domain == "offset" else xb / s + z
    unit = 2 * qp.spec.fmt.codec.half_spacing(v) * s
    return blocks.unview(unit, p).clamp_min(torch.finfo(torch.float32).tiny)


def _on_grid(w: torch.Tensor, qp: QParams, dtype: torch.dtype, path: str) -> torch.Tensor:
    """``w`` quantized with ``qp`` and back, in the model's dtype (the pipeline's quantization of it gives the
    same codes)."""
    with torch.no_grad():
        return dequantize(quantize(w.detach(), qp, generator=0, path=path), dtype=dtype)


def _tokens(*, options: Options) -> int | None:
    return options.tokens


register_algorithm("qat", step, needs=BlockInputs(tokens=_tokens, float_inputs=lambda *, options: True),
                   options=Options,
                   description="quantization-aware training block by block (EfficientQAT's Block-AP): weights and "
                               "learned ranges trained with Adam against each block's float output")

"""SignRound (intel's AutoRound): rounding offsets and clipping learned by signed gradient descent against each
block's float output, block by block (Cheng et al. 2023, "Optimize weight rounding via signed gradient descent
for the quantization of LLMs").

For each block, with ``X_q`` its inputs on the quantized chain (the earlier blocks quantized) and ``Y`` the float
block's outputs on the float chain's inputs (computed once)::

    V = 0, alpha = beta = 1                           for every planned linear weight of the block
                                                      (init="mse": alpha = beta = each group's least-error clip)
    for t in 0 .. iters-1:
        B    = the next batches of a seeded shuffle (batch_size calibration sequences)
        L_t  = mean over B of || block(X_q; W~(W, V, alpha, beta)) - Y ||^2     (one torch.func grad call)
        keep (V, alpha, beta) if L_t is the lowest so far                        (best iterate)
        lr_t = lr * (1 - t / iters)                                              (linear decay)
        V     <- clamp(V     - lr_t        * sign(dL/dV),     -0.5, 0.5)
        alpha <- clamp(alpha - minmax_lr_t * sign(dL/dalpha),  0.5, 1)   (beta alike)
    keep the lowest of the start, the best iterate and the last on the judging batches       (best=True)
    W_q = the weight quantized with the kept (V, alpha, beta) through the format's codec

``W~`` is :func:`.signround_math.learned_fake_quantize` (straight-through rounding; the zero point's gradient
per ``zero_point``). All the block's planned linear weights (``nn.Linear``, GPT-2's ``Conv1D``, a
mixture-of-experts layer's stacked weights: the paths :func:`.gptq.linear_weights` picks) are trained jointly;
the other tensors of the block are left to the next steps (round to nearest when none fits them).
The best iterate is judged on the batches of its own iteration, which differ from one iteration to the next (an
iterate can win on an easy batch, and the start often does), so with ``best`` the kept state is the lowest of
three on the judging batches: the start (round to nearest from min-max, the ``init`` clip, or GPTQ's result),
the best iterate and the last one (the state after the last step, which the loop never scores). The judging
batches are all the calibration batches, or with ``holdout = k`` every k-th one (batches k-1, 2k-1, ...), which
then take no part in the tuning: a state lower on the batches it was trained on can be higher on other text.
``Fit.info`` holds, per weight, ``signround_loss`` (the kept state's) and ``rtn_loss`` (the start's), the
block's output MSE on the judging batches (with ``best=False`` the last iterate is kept as it is).

Options (defaults; AutoRound's where it has one): ``iters`` (200), ``lr`` (``None``: ``1 / iters``, AutoRound's;
with ``init="gptq"`` or ``"gptaq"`` ``1 / (10 iters)``: GPTQ's start is close already, larger steps undo it),
``minmax_lr`` (``None``: ``lr``), ``batch_size`` (8: calibration sequences per iteration; the step takes whole
calibration batches, ``ceil(batch_size / rows per batch)`` of them, from a shuffle seeded by ``seed`` that is
redrawn when used up, like AutoRound's index sampler), ``minmax`` (True: learn ``alpha``, ``beta``; False:
offsets only), ``offsets`` (True: learn ``V``; False: ``V`` stays 0 and only the clipping factors are learned,
OmniQuant's learnable weight clipping by signed descent; a format with no learnable range then keeps its start),
``zero_point`` (``"ste"``: AutoRound's straight-through integer zero point; ``"round"``: a constant), ``init``
(``"minmax"``: ``alpha = beta = 1``, AutoRound's start; ``"mse"``: per group the clipping factor of least squared
round-to-nearest error on a grid over [0.5, 1], a better start at 2-3 bits where min-max ranges waste levels on
outliers; with ``minmax=False`` that clip stays fixed; ``"gptq"``: GPTQ's
solution of the block, :func:`.gptq.solve_block`: the weights as its columns stood when rounded, the ranges its
parameters stand for, and at ``alpha = beta = 1`` its parameters exactly, so the start is GPTQ's result;
stacked experts from min-max; ``"gptaq"``: the same from GPTAQ's solution, ``gptq``'s ``gptaq=True``),
``best`` (True: keep the iterate of lowest loss; False: the last), ``quantized_inputs`` (True: train on the
quantized chain's inputs, AutoRound's ``enable_quanted_input``; False: the float chain's),
``amp`` (False: the tuning iterations' forward and backward passes in the model's dtype; True: under
``torch.autocast`` in bfloat16, AutoRound's ``amp``, about 1.7x faster on CPUs with bf16 dot products; the float
targets, the check against the start and the final quantization stay in the model's dtype),
``seed`` (0), ``holdout`` (5: every fifth calibration batch judges instead of training, when there are five or
more; 0: none, all batches train and judge, AutoRound's use of the data) and
``tokens`` (``None``: all the calibration data given; else whole batches spread over it).
AutoRound's momentum (0), gradient accumulation (1) and early stop (off) are fixed at its defaults.

On several ranks (``block.parallel``) each rank computes the gradient on its share of the batches and the
ranks add them before the sign (one ``all_sum`` per iteration), so every rank takes the same step.

Chains: ``["awq", "signround"]`` (AWQ's scales folded first, then SignRound from them) and ``["rotate",
"signround"]`` (QuaRot's rotations, then SignRound on the rotated weights). ``docs/signround.md``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .base import BlockInputs, Fit, register_algorithm
from .block_training import block_mse, chains, first_tensor, reduce_sums, schedule, training_block
from .gptq import Options as GPTQOptions
from .gptq import linear_weights
from .gptq import solve_block as gptq_solve
from .options import option, options_checker, received
from .signround_math import (ZERO_POINTS, Learned, clip_init, finalize, learned_fake_quantize, minmax_init,
                              prepare_weight, sign_step)

__all__ = ["step", "Options", "check_options", "SIGNROUND_INITS", "GPTQ_INITS", "default_lr"]

#: Where the learning starts: ``minmax`` (1: min-max ranges, AutoRound's start), ``mse`` (per group the factor of a
#: grid over [0.5, 1] with the least squared round-to-nearest error, :func:`.signround_math.clip_init`) or ``gptq``
#: (GPTQ's solution of the block: its unrounded weights and parameters, :func:`.gptq.solve_block`) or ``gptaq``
#: (GPTAQ's: GPTQ fitting the float model's outputs, ``gptq``'s ``gptaq=True``).
SIGNROUND_INITS = ("minmax", "mse", "gptq", "gptaq")
#: The starts that are a GPTQ solution (the smaller default lr, :func:`default_lr`).
GPTQ_INITS = ("gptq", "gptaq")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """``signround``'s options (see the module docstring).

    >>> check_options(iters=-1)
    Traceback (most recent call last):
    ...
    ValueError: signround: iters must be an int >= 0, got -1
    """

    iters: int = option(200, ge=0, doc="signed gradient steps per block")
    lr: float | None = option(None, gt=0, doc="the offsets' step size (None: 1 / iters; from GPTQ's start "
                                               "1 / (10 iters)), decayed linearly to 0")
    minmax_lr: float | None = option(None, gt=0, doc="the clipping factors' step size (None: lr)")
    batch_size: int = option(8, ge=1, doc="calibration sequences per iteration")
    minmax: bool = option(True, doc="learn the clipping factors alpha, beta")
    offsets: bool = option(True, doc="learn the rounding offsets V (False: V = 0, the clipping factors alone)")
    init: str = option("minmax", choices=SIGNROUND_INITS,
                       doc="the start: min-max ranges (AutoRound's), a clipping search, or GPTQ's or GPTAQ's solution")
    zero_point: str = option("ste", choices=ZERO_POINTS, doc="integer zero point's gradient: straight-through or none")
    best: bool = option(True, doc="keep the iterate of lowest loss (False: the last)")
    quantized_inputs: bool = option(True, doc="train on the quantized chain's block inputs (False: the float chain's)")
    amp: bool = option(False, doc="the tuning passes under torch.autocast in bfloat16 (AutoRound's amp)")
    seed: int = option(0, ge=0, doc="the batches' shuffle")
    holdout: int = option(5, ge=0, expect="an int, 0 (none) or >= 2",
                          doc="every holdout-th calibration batch judges the kept state instead of training it")
    tokens: int | None = option(None, ge=1, doc="calibration tokens used (None: all given)")

    def __post_init__(self):
        if self.holdout == 1:
            raise ValueError("holdout must be an int, 0 (none) or >= 2, got 1 (every batch held out)")
        if not self.offsets and not self.minmax:
            raise ValueError("offsets=False with minmax=False learns nothing: learn the offsets, the clipping factors "
                             "or both")


check_options = options_checker("signround", Options)


def step(params, plan, *, context, options: Options) -> Fit:
    """The ``signround`` step on one block (``context.block``); see the module docstring."""
    o = received(Options, options, step="signround")
    iters, zero_point = o.iters, o.zero_point
    block = training_block(context, "signround")
    weights = linear_weights(params, plan, block.paths)
    if not weights:
        return Fit()
    lr = default_lr(iters, o.init) if o.lr is None else float(o.lr)
    minmax_lr = lr if o.minmax_lr is None else float(o.minmax_lr)
    solved = _gptq_start(params, plan, context, weights, gptaq=o.init == "gptaq") if o.init in GPTQ_INITS else {}
    prep = {p: prepare_weight(solved[p][0], plan.specs[p], path=p, start=solved[p][1])._replace(dtype=params[p].dtype)
            if p in solved else prepare_weight(params[p], plan.specs[p], path=p) for p in weights}
    state = {p: clip_init(q, zero_point=zero_point) if o.init == "mse" else minmax_init(q) for p, q in prep.items()}
    learn_range = {p: o.minmax and q.ranged for p, q in prep.items()}
    targets, inputs = chains(block, "signround", o.quantized_inputs)
    par = block.parallel
    plan_ = schedule(inputs, par, batch_size=o.batch_size, holdout=o.holdout, seed=o.seed)
    sampler, judge = plan_.sampler, plan_.judge

    device = targets[0].device.type if targets else "cpu"

    def error(diff, fixed, picks, fast=False):
        tensors = {p: learned_fake_quantize(prep[p], Learned(diff[p][0], *(diff[p][1:] or fixed[p])),
                                            zero_point=zero_point) for p in weights}
        sse = torch.zeros((), dtype=torch.float32)
        for i in picks:
            args, kwargs = inputs[i]
            with torch.autocast(device, dtype=torch.bfloat16, enabled=fast):
                out = first_tensor(block.call(block.name, tensors, args, kwargs), "signround")
            sse = sse + block_mse(out, targets[i])
        return sse

    def split(st):
        """``(diff, fixed)``: per weight the tensors to differentiate (offsets, and clipping factors where learned)
        and the clipping factors as they stand."""
        return ({p: (s.offset, s.alpha, s.beta) if learn_range[p] else (s.offset,) for p, s in st.items()},
                {p: (s.alpha, s.beta) for p, s in st.items()})

    def data_loss(st) -> float:
        """The block's output MSE with state ``st`` on the judging batches (all ranks'): the held-out ones, else
        every calibration batch."""
        with torch.no_grad():
            sse = error(*split(st), judge)
        _, sse, count = reduce_sums({}, sse, float(sum(targets[i].numel() for i in judge)), par)
        return float(sse) / max(count, 1.0)

    grad_and_value = torch.func.grad_and_value(error)
    initial = state
    best_loss, best_state, first_loss = math.inf, state, math.nan
    for t in context.track(range(iters), desc=f"signround {block.name}", total=iters):
        picks = plan_.local(sampler.next())
        grads, sse = grad_and_value(*split(state), picks, o.amp)
        count = float(sum(targets[i].numel() for i in picks))
        grads, sse, count = reduce_sums(grads, sse, count, par)
        value = float(sse) / max(count, 1.0)
        if value < best_loss or not o.best:
            best_loss, best_state = value, state
        decay = 1.0 - t / iters
        state = {p: sign_step(s, Learned(grads[p][0] if o.offsets else None,
                                         *(grads[p][1:] if learn_range[p] else (None, None))),
                              lr=lr * decay, minmax_lr=minmax_lr * decay) for p, s in state.items()}
    if iters:  # the start, the best iterate and the last one on the judging batches (ties: the earlier)
        first_loss = data_loss(initial)
        kept = [(first_loss, 0, initial)] if o.best else []
        if o.best and best_state is not initial:
            kept.append((data_loss(best_state), 1, best_state))
        kept.append((data_loss(state), 2, state))
        best_loss, _, best_state = min(kept, key=lambda k: k[:2])
    new, qparams, info = {}, {}, {}
    for p in weights:
        new[p], qparams[p] = finalize(prep[p], best_state[p], zero_point=zero_point)
        info[p] = {"signround_loss": float(f"{best_loss:.6g}"), "rtn_loss": float(f"{first_loss:.6g}")} if iters else {}
    return Fit(params=new, qparams=qparams, info=info)


def default_lr(iters: int, init: str = "minmax") -> float:
    """The offsets' step size when ``lr`` is ``None``: ``1 / iters`` (AutoRound's), ``1 / (10 iters)`` from GPTQ's
    or GPTAQ's start (larger steps undo its compensation).

    >>> default_lr(8), default_lr(8, "gptq")
    (0.125, 0.0125)
    """
    return (0.1 if init in GPTQ_INITS else 1.0) / max(iters, 1)


def _gptq_start(params, plan, context, weights, gptaq: bool = False) -> dict:
    """``{path: (unrounded weight, QParams)}``: GPTQ's solution of the block (its default options; with ``gptaq``
    GPTAQ's, from the block's float inputs as well), each 2-D linear weight as its columns stood when rounded
    (float32) with GPTQ's parameters; stacked experts (solved expert by expert, no unrounded weight kept) are left
    out and start from min-max ranges."""
    _, qparams, _, unrounded = gptq_solve(params, plan, context=context, options=GPTQOptions(gptaq=gptaq),
                                          unrounded=True)
    return {p: (unrounded[p], qparams[p]) for p in weights if p in unrounded}


def _tokens(*, options: Options) -> int | None:
    return options.tokens


register_algorithm("signround", step, needs=BlockInputs(tokens=_tokens, float_inputs=lambda *, options: True),
                   options=Options,
                   description="SignRound (AutoRound): rounding offsets and clipping learned by signed gradient "
                               "descent against each block's float output")

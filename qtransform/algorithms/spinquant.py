"""The ``spinquant`` step: SpinQuant's learned rotations (Liu et al., 2024).

QuaRot's ``R1`` (residual stream) and ``R2`` (per attention layer, between values and output
projection) are learned instead of fixed: starting from the randomised Hadamard matrices of the
``rotate`` step, they minimise the quantized network's loss on the calibration data (the model's
own loss, next-token cross-entropy for a causal LM) with the activations fake-quantized by the
plan's quantizers and, unless a ``gptq`` step follows, the weights by round to nearest (SpinQuant's
recipe for GPTQ learns with only the activations quantized: GPTQ then fits the weights to the
rotation). Gradients are straight-through and also flow through each fitted scale as a function of
its block's range (``fake_quantize(..., range_grad=True)``): without that term the gradient ignores
what a rotation is for, smaller ranges, and on SmolLM2 with int4 activations the loss rises from
the first step. The gradient with respect to the rotations comes from ``torch.func.grad`` through
:func:`qtransform.rotate` and the model run on the rotated tree (``context.loss``: the calibrator
runs it through ``functional_call``; no module is changed); the matrices stay exactly orthogonal,
updated by Cayley SGD with momentum (:mod:`qtransform.rotation.stiefel`), the learning rate
decaying linearly to zero. The online rotations (``R4`` before the down projections, ``R3`` on
queries and keys) are QuaRot's fixed Hadamard transforms, applied during training too.

The loss of straight-through training is rough and its iterates wander, so the step keeps the
best one it saw: the mean calibration loss (over up to four batches spread over the data) of the
rotated tree is measured at the start, every ``iters / 20`` iterations and at the end, and the
rotations of the lowest are returned: never worse, on the calibration data, than the Hadamard start.

Options: ``layout`` (replaces the plan's ``Plan.layout``, which the bridge fills), ``iters`` (default 100), ``lr`` (0.1), ``momentum`` (0),
``learn`` (``["r1", "r2"]``, or one of them), ``seed``, ``r3``, ``r4`` (as for ``rotate``),
``batches`` (calibration batches used, spread over the data; default all, cycled), ``accumulate`` (1:
batches per iteration, their gradients averaged; with several processes (``context.parallel``) each
runs its share of them and the gradients, summed in float64, are all-reduced: the same rotations as one
process, in about ``1 / min(ranks, accumulate)`` of the time; the selection losses are split too), ``weights``
(``"rtn"`` or ``"float"``: the weights while learning; default ``"float"`` when a ``gptq`` step
follows, else ``"rtn"``). Reports the calibration loss at the start and of the rotations kept
(``info``); the progress bar shows each iteration's batch loss. Follow it with ``gptq`` or ``rtn``
to quantize the learned, rotated weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..rotation import ResidualLayout, fuse_norms
from ..rotation import rotate as rotate_tree
from ..rotation.stiefel import cayley_sgd_step
from ..observers import choose_qparams
from ..tensor import fake_quantize
from .base import Fit, ModelLoss, register_algorithm
from .options import option, options_checker, received
from .rotate import fuse_online, online_r3_r4, rotation_matrix

__all__ = ["step", "Options", "check_options", "LEARNABLE"]

LEARNABLE = ("r1", "r2")
WEIGHTS = ("rtn", "float")
SELECT = 4  # calibration batches the kept iterate is chosen on (spread over the data)
CHECKS = 20  # iterates compared, besides the end (the start is the first)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """``spinquant``'s options (see the module docstring)."""

    layout: Any = option(None, doc="a ResidualLayout or its dict, replacing the plan's (Plan.layout)")
    iters: int = option(100, ge=0, doc="Cayley SGD iterations")
    lr: float = option(0.1, gt=0, doc="learning rate, decaying linearly to zero")
    momentum: float = option(0.0, ge=0, lt=1, doc="momentum of the Cayley SGD")
    learn: list = option(LEARNABLE, doc="the rotations learned: r1 and/or r2")
    seed: int = option(0, doc="seed of the Hadamard start")
    r3: bool | None = option(None, doc="as for rotate")
    r4: bool = option(True, doc="as for rotate")
    batches: int | None = option(None, ge=1, doc="calibration batches used (default all)")
    accumulate: int = option(1, ge=1, doc="batches per iteration (gradients averaged; split among ranks)")
    weights: str | None = option(None, choices=WEIGHTS, doc="the weights while learning: rtn or float")

    def __post_init__(self):
        if not self.learn or not all(isinstance(k, str) for k in self.learn) or not set(self.learn) <= set(LEARNABLE):
            raise ValueError(f"learn must be a non-empty list of {list(LEARNABLE)}, got {self.learn!r}")
        if self.layout is not None:
            ResidualLayout.from_value(self.layout, where="layout")


check_options = options_checker("spinquant", Options)


def _fake_quantized(tree: dict, specs) -> dict:
    """Each planned weight fake-quantized by round to nearest (straight-through gradient, through the
    fitted scale too)."""
    return {p: fake_quantize(t, choose_qparams(t.detach(), specs[p], path=p), path=p, range_grad=True)
            if p in specs else t
            for p, t in tree.items()}


def _postfix(bar, loss: float) -> None:
    set_postfix = getattr(bar, "set_postfix", None)
    if callable(set_postfix):
        set_postfix(loss=f"{loss:.4f}")


def _weights_mode(weights, plan) -> str:
    """``weights=None``: ``"float"`` when a ``gptq`` step follows (SpinQuant's GPTQ recipe learns the
    rotations with only the activations quantized), else ``"rtn"``."""
    if weights is not None:
        return weights
    names = [getattr(s, "name", s) for s in plan.steps]
    return "float" if "spinquant" in names and "gptq" in names[names.index("spinquant") + 1:] else "rtn"


def _spread(n: int, k: int | None) -> list[int]:
    """``k`` indices spread evenly over ``range(n)`` (all of them when ``k`` is None or >= n)."""
    if not k or k >= n:
        return list(range(n))
    return sorted({round(j * (n - 1) / max(k - 1, 1)) for j in range(k)})


def step(params, plan, *, context, options: Options) -> Fit:
    """The ``spinquant`` step (see the module docstring)."""
    o = received(Options, options, step="spinquant")
    iters, accumulate, learn = o.iters, o.accumulate, o.learn
    layout = plan.layout if o.layout is None else o.layout
    if layout is None:
        raise ValueError("spinquant: no residual layout: the plan has none (Plan.layout; bridge.plan fills it from the "
                         "model's architecture table, bridge.arch.residual_layout) and no layout option was given")
    if context.loss is None:
        raise ValueError("spinquant learns on the model's loss over calibration data: run it with a calibrator "
                         "(bridge.quantize(..., calibration=...), `qtransform quantize --calib N`)")
    lay = ResidualLayout.from_value(layout, where="spinquant: layout")
    emb = params.get(lay.embeddings[0]) if lay.embeddings else None
    if not isinstance(emb, torch.Tensor) or not lay.heads:
        raise ValueError("spinquant: the layout names no embedding tensor of the tree or no value/output heads")
    d, hd = emb.shape[-1], lay.heads[0].head_dim
    R = {"r1": rotation_matrix(d, "hadamard", o.seed, device=emb.device),
         "r2": rotation_matrix(hd, "hadamard", o.seed + 1, device=emb.device).expand(len(lay.heads), hd, hd).clone()}
    online = online_r3_r4(params, plan, lay, r3=o.r3, r4=o.r4)
    base = fuse_norms(params, lay)
    mode = _weights_mode(o.weights, plan)

    def rotated(learned: dict) -> dict:
        """The tree rotated in float32 (the float64 of ``rotate`` costs twice the time and memory)."""
        rots = {k: m.float() for k, m in {**R, **learned}.items()}
        tree = rotate_tree(base, lay, rots["r1"], rots["r2"], dtype=torch.float32)
        tree.update(fuse_online(tree, online, dtype=torch.float32))
        return tree

    def trained(learned: dict) -> dict:
        """The tree the loss is taken on: the weights rounded unless ``mode`` is float."""
        tree = rotated(learned)
        return _fake_quantized(tree, plan.specs) if mode == "rtn" else tree

    order = _spread(len(context.loss), o.batches)
    select = [order[j] for j in _spread(len(order), SELECT)]

    par = context.parallel

    def calibration_loss(learned: dict) -> float:
        """The mean loss over the selection batches of the very tree these rotations give (each rank its share;
        float32 losses summed in float64, exactly: the same on any number of ranks)."""
        with torch.no_grad():
            tree = trained(learned)
            total = sum(float(context.loss(tree, i, online=online)) for i in select[par.rank::par.world])
        return float(par.all_sum(torch.tensor(total, dtype=torch.float64))) / len(select)

    def objective(learned: dict, i: int):
        loss = context.loss(trained(learned), i, online=online)
        return loss, loss.detach()

    grad = torch.func.grad(objective, has_aux=True)

    def averaged(learned: dict, k: int):
        """Iteration ``k``'s gradient: the mean over its ``accumulate`` batches, summed in float64 over the ranks."""
        picks = [order[(k * accumulate + j) % len(order)] for j in range(accumulate)]
        sums = [torch.zeros_like(learned[name], dtype=torch.float64) for name in learned] + [
            torch.zeros((), dtype=torch.float64, device=emb.device)]
        for i in picks[par.rank::par.world]:
            g, loss = grad(learned, i)
            sums = [a + b.double() for a, b in zip(sums, [g[name] for name in learned] + [loss])]
        if par.world > 1:
            flat = par.all_sum(torch.cat([t.reshape(-1) for t in sums]))  # one collective for all
            sums = [t.reshape(ref.shape) for t, ref in zip(torch.split(flat, [t.numel() for t in sums]), sums)]
        return {name: t / accumulate for name, t in zip(learned, sums)}, float(sums[-1]) / accumulate

    every = max(1, iters // CHECKS)
    learned = {k: R[k] for k in learn}
    moment = {k: torch.zeros_like(v) for k, v in learned.items()}
    seen = []  # (calibration loss, iteration, rotations) at the start, every few iterations and the end
    bar = context.track(range(iters), desc="spinquant", total=iters)
    for k in bar:
        g, loss = averaged(learned, k)
        _postfix(bar, loss)
        if k % every == 0:
            seen.append((calibration_loss(learned), k, dict(learned)))
        step = o.lr * (1 - k / iters)
        for name in learned:
            learned[name], moment[name] = cayley_sgd_step(learned[name], g[name], moment[name], lr=step,
                                                          momentum=o.momentum)
    if iters:
        seen.append((calibration_loss(learned), iters, dict(learned)))
    best, at, learned = min(seen, key=lambda s: s[0]) if seen else (None, 0, learned)
    with torch.no_grad():
        final = rotated(learned)  # the tree whose loss was measured
    changed = {p: t for p, t in final.items() if t is not params.get(p)}
    kept = "the Hadamard start kept: no iterate lowered it" if at == 0 else f"iteration {at} of {iters} kept"
    report = {"rotation": f"SpinQuant ({', '.join(learn)} learned, {iters} iterations, weights {mode})",
              "spinquant_loss": f"{seen[0][0]:.4f} -> {best:.4f} ({kept})" if seen else "-"}
    info = {p: dict(report) for p in changed if p in plan.specs}
    return Fit(params=changed, info=info, online=online)


register_algorithm("spinquant", step, needs=ModelLoss(),
                   options=Options, requires=("layout",),
                   description="SpinQuant: QuaRot's rotations learned on the quantized model's loss (Cayley SGD "
                               "through torch.func.grad), online Hadamard transforms as in rotate")

"""The ``spinquant`` step: SpinQuant's learned rotations (Liu et al., 2024).

QuaRot's ``R1`` (residual stream) and ``R2`` (per attention layer, between values and output
projection) are learned instead of fixed: starting from the randomised Hadamard matrices of the
``rotate`` step, they minimise the quantized network's loss on the calibration data (the model's
own loss, next-token cross-entropy for a causal LM) with the weights fake-quantized by round to
nearest and the activations by the plan's quantizers, both with straight-through gradients. The
gradient with respect to the rotations comes from ``torch.func.grad`` through
:func:`qtransform.rotate` and the model run on the rotated tree (``context.loss``: the calibrator
runs it through ``functional_call``; no module is changed); the matrices stay exactly orthogonal,
updated by Cayley SGD with momentum (:mod:`qtransform.rotation.stiefel`), the learning rate
decaying linearly to zero. The online rotations (``R4`` before the down projections, ``R3`` on
queries and keys) are QuaRot's fixed Hadamard transforms, applied during training too.

Options: ``layout`` (filled by the bridge), ``iters`` (default 100), ``lr`` (0.1: on SmolLM2 with int4
activations the loss falls steadily at 0.05 to 0.1 and diverges from 0.2 up), ``momentum`` (0),
``learn`` (``["r1", "r2"]``, or one of them), ``seed``, ``r3``, ``r4`` (as for ``rotate``),
``batches`` (calibration batches used, spread over the data; default all, cycled). Reports the loss
before and after (``info``); the progress bar shows it as it goes. Follow it with ``gptq`` or
``rtn`` to quantize the learned, rotated weights.
"""

from __future__ import annotations

import torch

from ..rotation import ResidualLayout, fuse_norms
from ..rotation import rotate as rotate_tree
from ..rotation.stiefel import cayley_sgd_step
from ..observers import choose_qparams
from ..tensor import fake_quantize
from .base import Fit, ModelLoss, register_algorithm
from .rotate import fuse_online, online_r3_r4, rotation_matrix

__all__ = ["spinquant", "check_options", "LEARNABLE"]

LEARNABLE = ("r1", "r2")


def check_options(*, path=None, layout=None, iters=100, lr=0.1, momentum=0.0, learn=LEARNABLE, seed=0, r3=None,
                  r4=True, batches=None, **unknown) -> None:
    if unknown:
        raise ValueError(f"spinquant: unknown option(s) {sorted(unknown)}; options: layout, iters, lr, momentum, "
                         "learn, seed, r3, r4, batches")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ValueError(f"spinquant: iters must be an int >= 0, got {iters!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"spinquant: lr must be a number > 0, got {lr!r}")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise ValueError(f"spinquant: momentum must be in [0, 1), got {momentum!r}")
    if isinstance(learn, str) or not isinstance(learn, (list, tuple)) or not learn or not set(learn) <= set(LEARNABLE):
        raise ValueError(f"spinquant: learn must be a non-empty list of {list(LEARNABLE)}, got {learn!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"spinquant: seed must be an int, got {seed!r}")
    if r3 is not None and not isinstance(r3, bool) or not isinstance(r4, bool):
        raise TypeError(f"spinquant: r3 must be true, false or null and r4 true or false, got {r3!r}, {r4!r}")
    if batches is not None and (isinstance(batches, bool) or not isinstance(batches, int) or batches < 1):
        raise ValueError(f"spinquant: batches must be an int >= 1 or null, got {batches!r}")
    if layout is not None:
        ResidualLayout.from_value(layout, where="spinquant: layout")


def _fake_quantized(tree: dict, specs) -> dict:
    """Each planned weight fake-quantized by round to nearest (straight-through gradient)."""
    return {p: fake_quantize(t, choose_qparams(t.detach(), specs[p], path=p), path=p) if p in specs else t
            for p, t in tree.items()}


def _postfix(bar, loss: float) -> None:
    set_postfix = getattr(bar, "set_postfix", None)
    if callable(set_postfix):
        set_postfix(loss=f"{loss:.4f}")


def spinquant(params, plan, *, context, layout=None, iters: int = 100, lr: float = 0.1, momentum: float = 0.0,
              learn=LEARNABLE, seed: int = 0, r3=None, r4: bool = True, batches=None) -> Fit:
    """The ``spinquant`` step (see the module docstring)."""
    check_options(layout=layout, iters=iters, lr=lr, momentum=momentum, learn=learn, seed=seed, r3=r3, r4=r4,
                  batches=batches)
    if layout is None:
        raise ValueError("spinquant: layout: no residual layout given; bridge.quantize fills it from the model's "
                         "architecture table (bridge.arch.residual_layout), or pass layout=ResidualLayout(...)")
    if context.loss is None:
        raise ValueError("spinquant learns on the model's loss over calibration data: run it with a calibrator "
                         "(bridge.quantize(..., calibration=...), `qtransform quantize --calib N`)")
    lay = ResidualLayout.from_value(layout, where="spinquant: layout")
    emb = params.get(lay.embeddings[0]) if lay.embeddings else None
    if not isinstance(emb, torch.Tensor) or not lay.heads:
        raise ValueError("spinquant: the layout names no embedding tensor of the tree or no value/output heads")
    d, hd = emb.shape[-1], lay.heads[0].head_dim
    R = {"r1": rotation_matrix(d, "hadamard", seed),
         "r2": rotation_matrix(hd, "hadamard", seed + 1).expand(len(lay.heads), hd, hd).clone()}
    online = online_r3_r4(params, plan, lay, r3=r3, r4=r4)
    base = fuse_norms(params, lay)
    fixed = {k: v for k, v in R.items() if k not in learn}

    def rotated(rots: dict, dtype) -> dict:
        tree = rotate_tree(base, lay, rots["r1"], rots["r2"], dtype=dtype)
        tree.update(fuse_online(tree, online, dtype=dtype))
        return tree

    def objective(learned: dict, i: int):
        tree = _fake_quantized(rotated({**fixed, **learned}, torch.float32), plan.specs)
        loss = context.loss(tree, i, online=online)
        return loss, loss.detach()

    grad = torch.func.grad(objective, has_aux=True)
    n = len(context.loss)
    order = list(range(n)) if not batches or batches >= n else [round(k * (n - 1) / max(batches - 1, 1))
                                                                for k in range(batches)]
    learned = {k: R[k] for k in learn}
    moment = {k: torch.zeros_like(v) for k, v in learned.items()}
    losses = []
    bar = context.track(range(iters), desc="spinquant", total=iters)
    for k in bar:
        g, loss = grad({name: m.float() for name, m in learned.items()}, order[k % len(order)])
        losses.append(float(loss))
        _postfix(bar, losses[-1])
        step = lr * (1 - k / iters)
        for name in learned:
            learned[name], moment[name] = cayley_sgd_step(learned[name], g[name].double(), moment[name], lr=step,
                                                          momentum=momentum)
    with torch.no_grad():
        final = rotated({**fixed, **learned}, torch.float64)
        last = float(context.loss(_fake_quantized(final, plan.specs), order[0], online=online)) if iters else None
    changed = {p: t for p, t in final.items() if t is not params.get(p)}
    first = f"{losses[0]:.4f}" if losses else "-"
    report = {"rotation": f"SpinQuant ({', '.join(learn)} learned, {iters} iterations)",
              "spinquant_loss": f"{first} -> {last:.4f}" if last is not None else "-"}
    info = {p: dict(report) for p in changed if p in plan.specs}
    return Fit(params=changed, info=info, online=online)


register_algorithm("spinquant", spinquant, needs=ModelLoss(),
                   check_options=check_options,
                   description="SpinQuant: QuaRot's rotations learned on the quantized model's loss (Cayley SGD "
                               "through torch.func.grad), online Hadamard transforms as in rotate")

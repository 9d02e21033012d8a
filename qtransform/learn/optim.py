"""A deterministic Adam over flat trees (``{key: tensor}``), as pure functions: no optimiser object, no hidden
state, the same bytes on every process that takes the same gradients (the ``qat`` step reduces them over ranks
first). ``torch.optim`` stays the choice in the user's own loop (``bridge.qat``).

>>> import torch
>>> params = {"w": torch.tensor([1.0, -2.0])}
>>> state = adam_init(params)
>>> params, state = adam_update(params, {"w": torch.tensor([0.5, -0.5])}, state, lr={"w": 0.1})
>>> [round(x, 6) for x in params["w"].tolist()], state.step
([0.9, -1.9], 1)
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple

import torch

__all__ = ["AdamState", "adam_init", "adam_update", "cosine"]


class AdamState(NamedTuple):
    """Adam's moments per key (float32) and the number of steps taken."""

    step: int
    m: dict
    v: dict


def adam_init(params: Mapping[str, torch.Tensor]) -> AdamState:
    """Zero moments shaped like ``params``."""
    return AdamState(0, {k: torch.zeros_like(t, dtype=torch.float32) for k, t in params.items()},
                     {k: torch.zeros_like(t, dtype=torch.float32) for k, t in params.items()})


def adam_update(params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor], state: AdamState, *,
                lr: Mapping[str, float | torch.Tensor], betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                weight_decay: float = 0.0) -> tuple[dict, AdamState]:
    """One Adam step (AdamW's decoupled ``weight_decay``) with a step size per key (``lr[key]``: a float, or a
    tensor broadcasting to the key's, a step size per element; 0 or a key missing from ``grads``: left as it is).
    Returns new tensors and state; nothing is changed in place."""
    b1, b2 = betas
    t = state.step + 1
    c1, c2 = 1.0 - b1 ** t, 1.0 - b2 ** t
    new, m, v = {}, dict(state.m), dict(state.v)
    for k, p in params.items():
        g, step = grads.get(k), lr.get(k, 0.0)
        step = step if isinstance(step, torch.Tensor) else float(step)
        if g is None or (not isinstance(step, torch.Tensor) and step == 0.0):
            new[k] = p
            continue
        g = g.to(torch.float32)
        m[k] = state.m[k] * b1 + g * (1.0 - b1)
        v[k] = state.v[k] * b2 + g.square() * (1.0 - b2)
        update = (m[k] / c1) / ((v[k] / c2).sqrt() + eps)
        q = p.to(torch.float32)
        if weight_decay:
            q = q * (1.0 - step * weight_decay)
        new[k] = (q - step * update).to(p.dtype)
    return new, AdamState(t, m, v)


def cosine(t: int, total: int, *, floor: float = 0.0) -> float:
    """The factor of a cosine schedule at step ``t`` of ``total``: 1 at 0, ``floor`` at ``total``."""
    if total <= 1:
        return 1.0
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t / total))

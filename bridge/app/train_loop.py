"""The end-to-end training of ``qtransform train``: a prepared model (:func:`bridge.qat.prepare`) trained on token
sequences with ``torch.optim.AdamW``, deterministic and resumable.

- The batches: step ``t`` reads the sequences at positions ``t·B .. t·B+B-1`` of an endless stream of
  permutations of the training sequences, the ``e``-th drawn from a generator seeded with ``seed + e``
  (:class:`Schedule`): a function of the seed and the step alone, so a resumed run reads what the run that never
  stopped read.
- The optimizer: AdamW with the weights in one group (``lr``, ``weight_decay``) and the learned ranges in their own
  (``range_lr``, no weight decay: :func:`bridge.qat.quantizer_parameters`); ``ranges_only`` freezes every other
  parameter (EfficientQAT's E2E-QP).
- The learning rates: each group's rate times :func:`lr_factor` of the step — constant, or a linear warm-up over
  ``warmup`` steps then constant or a cosine decay to zero (``schedule``): a function of the step alone, so a
  resumed run steps as the run that never stopped did.
- The loss: the next-token cross entropy, plus with ``distill`` the KL to the float teacher's logits
  (:func:`bridge.qat.distill_loss`, the teacher in eval mode, under ``no_grad``).
- The state (:class:`~bridge.app.train_state.TrainState`) is saved every ``save_every`` steps and when training
  completes; a resumed run starts from it: the model's and the optimizer's tensors, the random generators, the
  losses so far.

>>> s = Schedule(5, batch=2, seed=0)
>>> sorted(s.indices(0).tolist() + s.indices(1).tolist() + s.indices(2).tolist()[:1])
[0, 1, 2, 3, 4]
>>> torch.equal(Schedule(5, batch=2, seed=0).indices(7), s.indices(7))
True
>>> [round(lr_factor(t, steps=6, schedule="cosine", warmup=2), 3) for t in range(6)]
[0.5, 1.0, 1.0, 0.854, 0.5, 0.146]
"""

from __future__ import annotations

import math
import time
from typing import Callable, NamedTuple

import torch

from .. import qat

__all__ = ["SCHEDULES", "Settings", "Schedule", "Trained", "lr_factor", "nothing_to_train", "optimizer", "train"]

#: the learning-rate schedules of :func:`lr_factor`
SCHEDULES = ("constant", "cosine")


class Settings(NamedTuple):
    """How to train: ``steps`` of ``batch`` sequences, the learning rates, ``weight_decay`` (the weights'),
    ``ranges_only``, ``distill`` and its ``temperature``, the ``seed``, ``save_every`` (steps between
    saves of the state), and the learning rates' ``schedule`` after ``warmup`` steps (:func:`lr_factor`)."""

    steps: int
    batch: int
    lr: float
    range_lr: float
    weight_decay: float = 0.0
    ranges_only: bool = False
    distill: bool = False
    temperature: float = 1.0
    seed: int = 0
    save_every: int = 100
    schedule: str = "constant"
    warmup: int = 0


class Trained(NamedTuple):
    """What training did: the loss of every step (``losses``), the step it resumed at (``resumed_at``, ``None``
    for a run from the start) and the ``seconds`` it ran in this process."""

    losses: list
    resumed_at: int | None
    seconds: float


class Schedule:
    """The sequences each step reads (see the module docstring): ``n`` sequences, ``batch`` per step."""

    def __init__(self, n: int, *, batch: int, seed: int):
        if n < 1 or batch < 1:
            raise ValueError(f"Schedule needs n >= 1 and batch >= 1, got n={n}, batch={batch}")
        self.n, self.batch, self.seed = n, batch, seed
        self._epochs: dict[int, torch.Tensor] = {}

    def _epoch(self, e: int) -> torch.Tensor:
        if e not in self._epochs:
            self._epochs = {e: torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + e))}
        return self._epochs[e]

    def indices(self, step: int) -> torch.Tensor:
        """The int64 positions of the sequences step ``step`` reads."""
        first = step * self.batch
        return torch.stack([self._epoch(p // self.n)[p % self.n] for p in range(first, first + self.batch)])


def lr_factor(t: int, *, steps: int, schedule: str = "constant", warmup: int = 0) -> float:
    """The factor of every learning rate at step ``t`` (0-based) of ``steps``: ``(t + 1) / warmup`` during the
    warm-up, then 1 (``constant``) or ``(1 + cos(pi (t - warmup) / (steps - warmup))) / 2`` (``cosine``: from 1
    down towards 0 at the last step)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: unknown {schedule!r}; known: {list(SCHEDULES)}")
    if not 0 <= warmup < max(steps, 1):
        raise ValueError(f"warmup: {warmup} steps leave none of the {steps} steps after it")
    if t < warmup:
        return (t + 1) / warmup
    if schedule == "constant":
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * (t - warmup) / (steps - warmup)))


def nothing_to_train(model: torch.nn.Module, s: Settings) -> str | None:
    """Why ``model`` (prepared) has nothing to train under ``s`` (``None``: it has something)."""
    if qat.quantizer_parameters(model):
        return None
    if s.ranges_only:
        return ("--ranges-only: the recipe's quantizers have no range to learn (casts such as bf16 store scale 1); "
                "train the weights too (without --ranges-only)")
    return None if any(p.requires_grad for p in model.parameters()) else "the prepared model has no parameter to train"


def optimizer(model: torch.nn.Module, s: Settings) -> torch.optim.AdamW:
    """AdamW over ``model``'s weights and ranges (see the module docstring); ``ranges_only`` freezes the weights.
    ``ValueError`` when nothing would train."""
    ranges = qat.quantizer_parameters(model)  # those that train (a cast's scale is 1: nothing to learn)
    ids = {id(p) for p in ranges}
    weights = [p for p in model.parameters() if id(p) not in ids and p.requires_grad]
    if s.ranges_only:
        for p in weights:
            p.requires_grad_(False)
        weights = []
    groups = ([{"params": weights, "lr": s.lr, "weight_decay": s.weight_decay}] if weights else []) + (
        [{"params": ranges, "lr": s.range_lr, "weight_decay": 0.0}] if ranges else [])
    if not groups:
        raise ValueError(nothing_to_train(model, s) or "the prepared model has no parameter to train")
    return torch.optim.AdamW(groups, lr=s.lr)


def _rng(device: torch.device) -> dict:
    out = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def _set_rng(rng: dict, device: torch.device) -> None:
    torch.set_rng_state(rng["cpu"])
    if device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], device)


def _loss(model, teacher, ids: torch.Tensor, s: Settings) -> torch.Tensor:
    out = model(input_ids=ids, labels=ids, use_cache=False)
    loss = out.loss
    if teacher is not None:
        with torch.no_grad():
            target = teacher(input_ids=ids, use_cache=False).logits
        loss = loss + qat.distill_loss(out.logits, target, temperature=s.temperature)
    return loss


def train(model: torch.nn.Module, sequences: torch.Tensor, s: Settings, *, teacher=None, state=None, fp=None,
          snapshot=None, progress: Callable | None = None) -> Trained:
    """Train ``model`` (prepared, on its device) on the int64 ``(n, seq_len)`` ``sequences`` for ``s.steps``
    steps; ``teacher``: the float model (with ``s.distill``); ``state`` / ``fp``: where and under which
    fingerprint the state is saved; ``snapshot``: the state to resume from
    (:meth:`~bridge.app.train_state.TrainState.load`); ``progress``: ``progress(iterable, desc=, total=)``.
    ``ValueError`` naming the step when the loss stops being finite."""
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    opt = optimizer(model, s)
    torch.manual_seed(s.seed)
    start, losses = 0, []
    if snapshot is not None:
        model.load_state_dict(snapshot.model, strict=True)
        opt.load_state_dict({"state": snapshot.optimizer, "param_groups": opt.state_dict()["param_groups"]})
        _set_rng(snapshot.rng, device)
        start, losses = snapshot.step, list(snapshot.losses)
    schedule = Schedule(sequences.shape[0], batch=s.batch, seed=s.seed)
    model.train()
    steps = range(start, s.steps)
    bar = progress(steps, desc="train", total=len(steps)) if progress is not None else steps
    base = [g["lr"] for g in opt.param_groups]
    for t in bar:
        factor = lr_factor(t, steps=s.steps, schedule=s.schedule, warmup=s.warmup)
        for g, lr in zip(opt.param_groups, base):
            g["lr"] = lr * factor
        loss = _loss(model, teacher, sequences[schedule.indices(t)].to(device), s)
        value = float(loss)
        if not math.isfinite(value):
            raise ValueError(f"training diverged at step {t + 1} of {s.steps}: the loss is {value}; lower --lr or "
                             "--range-lr (the state saved last is kept: --resume restarts from it)")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(value)
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(f"loss {value:.4f}")
        done = t + 1
        if state is not None and (done % s.save_every == 0 or done == s.steps):
            state.save(fp, step=done, losses=losses, model=model, optimizer=opt, rng=_rng(device))
    model.eval()
    return Trained(losses, None if snapshot is None else snapshot.step, time.perf_counter() - t0)

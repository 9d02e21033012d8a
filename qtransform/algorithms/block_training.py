"""What the steps that train a block against the float block's outputs share (``signround``, ``qat``): the
float targets, the block's hidden states in its output, a seeded batch schedule that N ranks draw alike, and the
sums reduced over ranks in float64 (one ``all_sum`` per iteration, so every rank takes the one-process step)."""

from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple

import torch

__all__ = ["training_block", "chains", "first_tensor", "batch_rows", "Sampler", "float_targets", "Schedule", "schedule", "reduce_sums",
           "block_mse"]


def training_block(context, step: str):
    """``context.block``, checked to be one a step can train: handed over block by block, with a differentiable
    ``call``."""
    block = context.block
    if block is None:
        raise ValueError(f"{step} runs block by block on calibration data (a calibrator's blockwise)")
    if block.call is None:
        raise ValueError(f"block {block.name}: {step} needs Block.call (a differentiable call of the block)")
    return block


def chains(block, step: str, quantized_inputs: bool) -> tuple[list, Any]:
    """``(targets, inputs)``: the float block's outputs (:func:`float_targets`) and the inputs it trains on, the
    quantized chain's (``quantized_inputs``) or the float chain's, batch for batch."""
    targets = float_targets(block, step)
    inputs = block.inputs if quantized_inputs else block.float_inputs
    if len(inputs) != len(targets):
        raise ValueError(f"block {block.name}: {len(inputs)} quantized-chain batches but {len(targets)} float ones")
    return targets, inputs


def first_tensor(out: Any, step: str = "a step") -> torch.Tensor:
    """The hidden states of a block's output: the tensor, or the first element of a tuple/list/mapping."""
    while not isinstance(out, torch.Tensor):
        if isinstance(out, Mapping):
            out = next(iter(out.values()))
        elif isinstance(out, (tuple, list)) and out:
            out = out[0]
        else:
            raise ValueError(f"{step}: a block's output holds no tensor: {type(out).__name__}")
    return out


def batch_rows(args, kwargs) -> int:
    """Calibration sequences in one batch: the leading size of its hidden states (3-D), else 1."""
    h = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
    return int(h.shape[0]) if isinstance(h, torch.Tensor) and h.dim() >= 3 else 1


class Sampler:
    """Whole batches of ``pool`` (their indices), ``per`` at a time, from a seeded shuffle redrawn when fewer than
    ``per`` are left."""

    def __init__(self, pool: list[int], per: int, seed: int):
        self.pool, self.per = pool, min(per, len(pool))
        self.gen = torch.Generator().manual_seed(seed)
        self.order, self.at = [], 0

    def next(self) -> list[int]:
        if self.at + self.per > len(self.order):
            self.order, self.at = [self.pool[j] for j in torch.randperm(len(self.pool), generator=self.gen)], 0
        self.at += self.per
        return self.order[self.at - self.per:self.at]


def float_targets(block, step: str) -> list[torch.Tensor]:
    """The float block's outputs (float32) on the float chain's inputs, once per batch (the caller's
    ``Block.float_outputs`` where it offers them: the same pass gives it the next block's float inputs)."""
    batches = block.float_inputs
    if batches is None:
        raise ValueError(f"block {block.name}: {step} needs the float model's block inputs (Block.float_inputs); "
                         "the calibrator gave none")
    with torch.no_grad():
        outs = block.float_outputs() if block.float_outputs is not None else [
            first_tensor(block.call(block.name, {}, args, kwargs), step) for args, kwargs in batches]
        return [o.detach().to(torch.float32) for o in outs]


class Schedule(NamedTuple):
    """Which batches train and which judge: ``sampler`` draws global batch indices (all ranks' batches, each
    rank holding a contiguous share from ``start``), ``judge`` this rank's judging batches (local indices)."""

    sampler: Sampler
    judge: Any
    start: int
    count: int

    def local(self, picks) -> list[int]:
        """The global ``picks`` this rank holds, as its local indices."""
        return [i - self.start for i in picks if self.start <= i < self.start + self.count]


def schedule(inputs, par, *, batch_size: int, holdout: int, seed: int) -> Schedule:
    """One sampler over all ranks' batches: every rank draws the same global picks and runs those it holds, so N
    ranks take the one-process steps; with ``holdout = k`` every k-th batch judges instead of training."""
    counts = [len(inputs)] if par.world == 1 else [int(n) for n in par.gather(len(inputs))]
    start = sum(counts[:par.rank])
    rows = [batch_rows(*inputs[0])] if par.world == 1 else par.gather(batch_rows(*inputs[0]) if inputs else 1)
    per = max(1, math.ceil(batch_size / max(max(rows), 1)))
    total = sum(counts)
    held = [i for i in range(total) if holdout and i % holdout == holdout - 1]
    sampler = Sampler(sorted(set(range(total)) - set(held)), per, seed)
    judge = [i - start for i in held if start <= i < start + len(inputs)] if held else range(len(inputs))
    return Schedule(sampler, judge, start, len(inputs))


def block_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The summed squared error of a block's output against its float target (float32), a pure function."""
    return (out.to(torch.float32) - target).square().sum()


def reduce_sums(grads: Mapping, sse, count: float, par):
    """On several ranks, the gradients (``{key: tuple of tensors}``), the squared error and the element count
    summed over them (one ``all_sum`` of one flat float64 tensor); on one, as they are."""
    if par.world == 1:
        return grads, sse, count
    leaves = [(p, k, g) for p, gs in grads.items() for k, g in enumerate(gs)]
    flat = torch.cat([g.reshape(-1).to(torch.float64) for _, _, g in leaves]
                     + [sse.detach().reshape(1).to(torch.float64), torch.tensor([count], dtype=torch.float64)])
    flat = par.all_sum(flat)
    out, at = {p: list(gs) for p, gs in grads.items()}, 0
    for p, k, g in leaves:
        out[p][k] = flat[at:at + g.numel()].reshape(g.shape).to(g.dtype)
        at += g.numel()
    return {p: tuple(v) for p, v in out.items()}, flat[at], float(flat[at + 1])

"""``signround`` on several ranks: real gloo groups of 2 processes (one thread each). Every rank draws the same
batches from one sampler over all ranks' shares, runs those it holds and adds the gradients before the sign: with
one batch per iteration the ranks give the one-process tree bit for bit (with more, each iteration's gradient is
the same sum taken in another order: the same tree on every rank, the one-process one up to rounding)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.utils._pytree as pytree

import qtransform as qt

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from dist_util import run_ranks  # noqa: E402


def _job(rank, world, batch_size, holdout=0):
    import bridge
    from bridge_util import tiny_causal_lm

    torch.manual_seed(0)
    model = tiny_causal_lm("llama").eval()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (2, 16), generator=g) for _ in range(5)]
    recipe = dataclasses.replace(qt.get_preset("signround4-g128").recipe,
                                 steps=(qt.Step("signround", iters=12, batch_size=batch_size, lr=0.05,
                                                holdout=holdout),))
    q = bridge.quantize_params(model, recipe, calibration=batches)
    return {"tree": qt.flatten_tree(q.qtree), "info": q.info}


def _same(a, b) -> bool:
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    return sa == sb and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb))


def test_two_ranks_take_the_one_process_steps():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = _job(0, 1, 2)
    finally:
        torch.set_num_threads(threads)
    assert one["info"] and all(v["signround_loss"] < v["rtn_loss"] for v in one["info"].values())
    ranks = run_ranks(2, _job, 2)
    # one batch per iteration, held by one rank (the other adds zeros): the one-process tree on both
    assert _same(ranks[0], one) and _same(ranks[1], one)


def test_with_held_out_batches_too():
    """``holdout=2``: batches 1 and 3 judge (on whichever rank holds them), the others
    train; the ranks' tree and losses are the one-process ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = _job(0, 1, 2, 2)
    finally:
        torch.set_num_threads(threads)
    ranks = run_ranks(2, _job, 2, 2)
    assert _same(ranks[0], one) and _same(ranks[1], one)
    assert one["info"] != _job(0, 1, 2, 0)["info"]  # judged on other batches than with no holdout

"""``qat`` on several ranks: real gloo groups of 2 and 3 processes (one thread each). Every rank draws the same
batches from one sampler over all ranks' shares and runs those it holds; each batch's gradient is added in float64
(exact for the few batches of a step) and the ranks' sums are added in one all_sum, so any split of the batches
gives the one-process sum: the ranks give the one-process tree and report bit for bit, with several batches per
step spread over the ranks and with held-out judging batches."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

import qtransform as qt

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from dist_util import run_ranks  # noqa: E402


def _job(rank, world, init="minmax", holdout=4):
    import bridge
    from bridge_util import tiny_causal_lm

    torch.manual_seed(0)
    model = tiny_causal_lm("llama").eval()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (1, 16), generator=g) for _ in range(7)]
    recipe = dataclasses.replace(qt.get_preset("qat2-g64").recipe,
                                 steps=(qt.Step("qat", iters=6, batch_size=3, holdout=holdout, init=init),))
    q = bridge.quantize_params(model, recipe, calibration=batches)
    return {"tree": qt.flatten_tree(q.qtree), "info": q.info}


def _same(a, b) -> bool:
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    return sa == sb and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb))


@pytest.mark.parametrize("world,init,holdout", [(2, "minmax", 4), (3, "gptq", 0)])
def test_ranks_take_the_one_process_steps(world, init, holdout):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = _job(0, 1, init, holdout)
    finally:
        torch.set_num_threads(threads)
    assert any(v["kept"] == "trained" for v in one["info"].values())
    ranks = run_ranks(world, _job, init, holdout)
    assert all(_same(r, one) for r in ranks)

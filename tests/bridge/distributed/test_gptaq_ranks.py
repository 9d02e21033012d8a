"""GPTAQ on two gloo ranks gives the one-process result bit for bit: each rank folds H and D over its share
(shares of unequal batch counts: the ranks capture as often, the short one with no batch), the sums reduce
in float64, each solve runs on its owner."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import qtransform as qt

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from dist_util import run_ranks  # noqa: E402


def _job(rank, world):
    import bridge
    from bridge_util import tiny_causal_lm

    torch.manual_seed(0)
    model = tiny_causal_lm("llama").eval()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, s, generator=g) for s in ((2, 16), (1, 8), (1, 8), (1, 8), (1, 8))]
    recipe = qt.Recipe(type_rules={"Linear": qt.QuantSpec(format="uint3", granularity=qt.PerGroup(32), symmetric=False)},
                       exclude=["lm_head*"], steps=[qt.Step("gptq", gptaq=True, true_sequential=True)])
    q = bridge.quantize_params(model, recipe, calibration=batches)
    return {"tree": {p: qt.dequantize(v) for p, v in q.qtree.items() if isinstance(v, qt.QTensor)}, "info": q.info}


@pytest.mark.slow  # two rank processes (dist_util.run_ranks)
def test_two_ranks_give_the_one_process_result():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = _job(0, 1)
    finally:
        torch.set_num_threads(threads)
    assert alone["info"]["model.layers.1.mlp.down_proj.weight"]["gptaq"] == "alpha 0.25"
    for rank, got in enumerate(run_ranks(2, _job)):
        assert got["info"] == alone["info"], rank
        assert set(got["tree"]) == set(alone["tree"])
        for p, w in alone["tree"].items():
            assert torch.equal(got["tree"][p], w), (rank, p)

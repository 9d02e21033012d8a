"""N ranks give the one-process result, bit for bit: real gloo groups of 2 and 3 processes (one thread each)
quantize a tiny Llama with every calibrated step, and every tensor of the quantized tree, every activation
quantizer and every reported number equals the one-process run's (computed here, one thread).

Why exact: each rank runs whole batches of a contiguous share (a batch's numbers do not depend on where it
runs), min/max reduce exactly, sums accumulate in float64 (exact for float32 parts), histograms and row
samples merge in rank order (the one-process order), GPTQ's solves run on one owner each and travel packed.
Where a difference could remain (documented in docs/distributed.md): AWQ's candidate errors are float64
sums whose last bits depend on the split, so two candidates within ~1e-15 relative could swap.
"""

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

STATIC = {"name": "percentile", "percentile": 99.0}  # a histogram observer: gathered and merged


def _recipes() -> dict:
    # 40 rows: AWQ's token-local inputs are sampled over all ranks' rows
    awq = dataclasses.replace(qt.get_preset("awq4-g64").recipe, steps=(qt.Step("awq", rows=40),))
    seq = dataclasses.replace(qt.get_preset("gptq4-g64").recipe,
                              steps=(qt.Step("gptq", true_sequential=True, init="minmax"),))
    # SpinQuant: 3 batches per iteration, split among the ranks, gradients all-reduced; then GPTQ
    spin = dataclasses.replace(qt.get_preset("spinquant-w4a8").recipe,
                               steps=(qt.Step("spinquant", iters=3, accumulate=3), qt.Step("gptq")))
    return {"spinquant": (spin, None), "rtn-static": ("w8a8-int8", None), "rtn-static-percentile": ("w8a8-int8", STATIC),
            "smoothquant": ("w8a8-int8-sq", None), "gptq": ("gptq4-g64", None), "gptq-sequential": (seq, None),
            "awq": (awq, None), "kv": ("fp8-w8a8-kv", None)}


def _model():
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from bridge_util import tiny_causal_lm

    torch.manual_seed(0)
    return tiny_causal_lm("llama").eval()


class _Routed(torch.nn.Module):
    """Two linears, each batch routed to one (as an expert): only the first batch reaches ``a``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) if float(x.sum()) > 0 else self.b(x)


def _routed_batches():
    g = torch.Generator().manual_seed(4)
    return [torch.rand(3, 8, generator=g) * (1 if i == 0 else -1) for i in range(5)]


def _batches():
    g = torch.Generator().manual_seed(1)
    shapes = [(2, 16), (1, 24), (3, 8), (2, 16), (1, 32), (2, 12), (1, 16)]  # uneven: shares by tokens
    return [torch.randint(0, 128, s, generator=g) for s in shapes]


def _plain(value):
    """Every tensor of a result as comparable bits (1-byte floats viewed as uint8)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach().cpu().view(torch.uint8)
                                if t.dtype.itemsize == 1 and t.is_floating_point() else t.detach().cpu(), value)


def _job(rank, world):
    import bridge

    out = {}
    for name, (recipe, observer) in _recipes().items():
        recipe = qt.get_preset(recipe).recipe if isinstance(recipe, str) else recipe
        q = bridge.quantize_params(_model(), recipe, calibration=_batches(), act_observer=observer)
        out[name] = _plain({"tree": qt.flatten_tree(q.qtree), "acts": {f"{s.module}|{s.role}": v for s, v in
                                                                       q.activations.items()}, "info": q.info})
    # a site that only some ranks' shares reach: reduced first, then checked (no rank calls it unreached)
    q = bridge.quantize_params(_Routed(), qt.get_preset("w8a8-int8").recipe, calibration=_routed_batches())
    out["routed"] = _plain({"tree": qt.flatten_tree(q.qtree), "acts": {f"{s.module}|{s.role}": v for s, v in
                                                                       q.activations.items()}})
    if world == 3:  # the same error on every rank, before any block runs
        try:
            bridge.quantize_params(_model(), qt.get_preset("gptq4-g64").recipe, calibration=_batches()[:2])
        except ValueError as e:
            out["_refused"] = str(e)
    return out


def _same(a, b, where):
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    assert sa == sb, f"{where}: different structure"
    bad = [i for i, (x, y) in enumerate(zip(la, lb)) if not (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y)]
    assert not bad, f"{where}: {len(bad)} of {len(la)} leaves differ"


@pytest.fixture(scope="module")
def one_process():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _job(0, 1)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def three_ranks():
    return run_ranks(3, _job)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_give_the_one_process_trees_activation_quantizers_and_reports(world, one_process, request):
    results = run_ranks(2, _job) if world == 2 else request.getfixturevalue("three_ranks")
    for rank, got in enumerate(results):
        for name in one_process:
            _same(got[name], one_process[name], f"{world} ranks, rank {rank}, {name}")
    # the comparison can fail: the recipes really quantized something, and the runs differ between recipes
    assert any(isinstance(v, torch.Tensor) and v.dtype == torch.uint8 for v in
               pytree.tree_leaves(one_process["gptq"]["tree"]))
    assert one_process["awq"]["info"] and one_process["rtn-static"]["acts"]
    assert {k.split("|")[0] for k in one_process["routed"]["acts"]} >= {"a", "b"}  # both linears calibrated


def test_fewer_batches_than_ranks_is_refused_by_name(three_ranks):
    for rank, got in enumerate(three_ranks):
        assert "2 calibration batch(es) for 3 ranks" in got["_refused"], rank

"""A block's statistics pass stops after its last site's input (the rest of the block folds nothing), with the
statistics of full passes, bit for bit."""

import pytest
import torch

import bridge
import qtransform as qt
from bridge_util import tiny_causal_lm

SPEC = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))


@pytest.fixture
def blocks():
    seen = []
    qt.register_algorithm("keep_block", lambda params, plan, *, context: seen.append(context.block) or qt.Fit(),
                          needs=qt.BlockInputs())
    yield seen
    qt.ALGORITHMS.unregister("keep_block")


def _inputs_of(module, block, args_list):
    """The inputs of ``module`` on each batch, from a plain forward of the block with a hook."""
    got = []
    h = module.register_forward_pre_hook(lambda m, a: got.append(a[0].detach().reshape(-1, a[0].shape[-1])))
    try:
        with torch.no_grad():
            for args, kwargs in args_list:
                block(*args, **kwargs)
    finally:
        h.remove()
    return got


def test_the_pass_stops_after_the_last_site_with_full_pass_statistics(blocks):
    torch.manual_seed(3)
    model = tiny_causal_lm("llama").eval()
    batches = [torch.randint(0, 128, (2, 7)), torch.randint(0, 128, (1, 5)), torch.randint(0, 128, (3, 4))]
    bridge.quantize_params(model, qt.Recipe(type_rules={"Linear": SPEC}, steps=["keep_block"]), calibration=batches)
    block, layer = blocks[0], model.model.layers[0]
    sites = {qt.Site("model.layers.0.self_attn.q_proj"): qt.init_stats(observer="hessian"),
             qt.Site("model.layers.0.mlp.gate_proj"): qt.init_stats(observer="hessian")}
    calls = []
    h = layer.mlp.down_proj.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        stats = block.site_stats({}, sites)
    finally:
        h.remove()
    assert len(calls) == 1  # the first batch runs whole; the others stop at gate_proj
    for site, module in zip(sites, (layer.self_attn.q_proj, layer.mlp.gate_proj)):
        xs = _inputs_of(module, layer, block.inputs)
        want = sum((x.T @ x).to(torch.float64) for x in xs)
        assert torch.equal(stats[site].xtx, want)
        assert int(stats[site].count) == sum(x.shape[0] for x in xs) == 14 + 5 + 12


def test_a_pass_with_an_output_site_runs_whole(blocks):
    torch.manual_seed(4)
    model = tiny_causal_lm("llama").eval()
    batches = [torch.randint(0, 128, (1, 6)), torch.randint(0, 128, (1, 6))]
    bridge.quantize_params(model, qt.Recipe(type_rules={"Linear": SPEC}, steps=["keep_block"]), calibration=batches)
    calls = []
    h = model.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        blocks[0].site_stats({}, {qt.Site("model.layers.0.self_attn.q_proj"): qt.init_stats(observer="hessian"),
                                  qt.Site("model.layers.0.self_attn.o_proj", "output"): qt.init_stats(observer="channel")})
    finally:
        h.remove()
    assert len(calls) == 2

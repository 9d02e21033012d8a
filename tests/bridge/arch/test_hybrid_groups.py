"""Smoothing groups of the hybrid families (issue 51, part 2): Mamba-2 (Nemotron-H, Bamba, Falcon-H1) and short
convolution (LFM2) blocks beside attention blocks. Each block gets the groups of the mixer it has: the norm into
the mixer's input projection, or into q/k/v and value -> output; the MLP's. Smoothed but unquantized (SmoothQuant,
alpha 0.5: every group changes), the logits are the original ones; AWQ runs through ``bridge.quantize``."""

import copy

import pytest
import torch

import bridge
import qtransform as qt
from bridge.arch import smoothing_groups
from bridge.calibrate import ModelCalibrator
from bridge.pipeline import plan

from moe.tiny_moe import tiny_hybrid as tiny

W8 = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
A8 = qt.QuantSpec(format="int8")
HYBRID = ("nemotron_h", "bamba", "falcon_h1", "lfm2")
#: a projection of each kind of mixer every tiny model has, and the norm that must feed it
FED = {"nemotron_h": {"mixer.in_proj": "norm", "mixer.q_proj": "norm"},
       "bamba": {"mamba.in_proj": "input_layernorm", "self_attn.q_proj": "input_layernorm",
                 "feed_forward.up_proj": "pre_ff_layernorm"},
       "falcon_h1": {"mamba.in_proj": "input_layernorm", "self_attn.q_proj": "input_layernorm"},
       "lfm2": {"conv.in_proj": "operator_norm", "self_attn.q_proj": "operator_norm", "feed_forward.w3": "ffn_norm"}}


def _outliers(model_type):
    m = tiny(model_type)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 1 and "norm" in name and not name.endswith("bias"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
                p[torch.randperm(p.numel(), generator=g)[:2]] *= 20
    return m


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 200, (2, 12), generator=g), torch.randint(0, 200, (1, 9), generator=g)]


@pytest.mark.parametrize("model_type", HYBRID)
def test_each_block_gets_the_groups_of_its_mixer(model_type):
    m = _outliers(model_type)
    groups = smoothing_groups(m)
    fed = {lin: g["prev"] for g in groups for lin in g["linears"]}
    for rel, norm in FED[model_type].items():
        found = {p: n for p, n in fed.items() if p.endswith("." + rel)}
        assert found, f"{model_type}: no group feeds {rel}"
        assert all(n == f"{p[:-len(rel) - 1]}.{norm}" for p, n in found.items()), found  # its own block's norm


@pytest.mark.parametrize("model_type", HYBRID)
def test_a_smoothed_unquantized_hybrid_model_gives_the_original_logits(model_type):
    m = _outliers(model_type)
    recipe = qt.Recipe(type_rules={"Linear": W8}, exclude=["lm_head*"], input=A8,
                       steps=[qt.Step("smoothquant", alpha=0.5)])
    fit = qt.run_steps(bridge.extract(m), plan(m, recipe), calibrator=ModelCalibrator(m, _batches()))
    groups = smoothing_groups(m)
    assert {f"{p}.weight" for g in groups for p in (g["prev"], *g["linears"])} <= set(fit.params)
    smoothed = copy.deepcopy(m)
    smoothed.load_state_dict({**smoothed.state_dict(), **fit.params})
    ids = torch.randint(0, 200, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = m(ids).logits, smoothed(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize("model_type", HYBRID)
def test_awq_runs_on_a_hybrid_model(model_type):
    m = _outliers(model_type)
    q = bridge.quantize(m, qt.get_preset("awq4-g64").recipe, calibration=_batches(), kernel="dequant")
    tree = bridge.extract(q)
    assert any(isinstance(v, qt.QTensor) for v in tree.values())
    with torch.no_grad():
        assert torch.isfinite(q(_batches()[0]).logits).all()

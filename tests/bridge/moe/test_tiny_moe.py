"""Every MoE CausalLM type transformers ships builds tiny here and runs a finite forward, or is
listed in ``UNBUILDABLE`` with its reason (issue 32)."""

import pytest
import torch

from tests.bridge.moe.tiny_moe import (MOE_MODEL_TYPES, NOT_CAUSAL_LM, UNBUILDABLE, build_tiny_moe,
                                       finite_nonconstant, tiny_moe_config)


def test_types_found():
    assert {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"} <= set(MOE_MODEL_TYPES)
    assert list(MOE_MODEL_TYPES) == sorted(set(MOE_MODEL_TYPES))
    assert not set(MOE_MODEL_TYPES) & set(NOT_CAUSAL_LM)
    assert all(reason for reason in UNBUILDABLE.values())


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_tiny_moe_builds_and_runs(model_type):
    if model_type in UNBUILDABLE:
        pytest.skip(f"{model_type}: {UNBUILDABLE[model_type]}")
    model = build_tiny_moe(model_type, seed=0)
    assert not model.training
    assert finite_nonconstant(model) == []
    # an experts module holds the routed experts: 4 of them (Doge's "CDMoE" keeps its experts
    # as embedding rows, LongCat-Flash adds zero-computation experts to gate_up_proj)
    experts = [m for n, m in model.named_modules() if n.endswith(".experts") or n.endswith("_embed")]
    assert experts, f"{model_type}: no experts module in the tiny model"
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 8, tiny_moe_config(model_type).vocab_size) == (1, 8, 256)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3", "gpt_oss", "qwen2_moe"])
def test_tiny_moe_deterministic(model_type):
    one, two = build_tiny_moe(model_type, seed=0), build_tiny_moe(model_type, seed=0)
    for (name, p), q in zip(one.state_dict().items(), two.state_dict().values()):
        assert torch.equal(p, q), f"{model_type}: {name} differs between two builds with one seed"
    other = build_tiny_moe(model_type, seed=1).state_dict()
    assert any(not torch.equal(p, other[n]) for n, p in one.state_dict().items())

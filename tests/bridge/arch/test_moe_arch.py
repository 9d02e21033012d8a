"""Mixture-of-experts models get the model facts SmoothQuant, AWQ and the rotations need (issue 32).

Tiny Mixtral, Qwen2-MoE (shared expert with its float gate) and Qwen3-MoE: the architecture tables give the
group of the norm before the MLP (router, stacked experts weights, shared expert) and the residual layout
(stacked experts weights as readers and writers). Scaling alone and rotating alone leave the float model's
logits unchanged (both models run before and after, nothing of the code under test in the comparison); the
presets run end to end, each closer to the float logits than the same recipe without its algorithm (round to
nearest) on a model with activation outliers, and the routers stay float.
"""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import bridge
import qtransform as qt
from bridge.arch import residual_layout, smoothing_groups
from qtransform.algorithms.smoothing import as_groups, fold, group_shape

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "moe"))
from tiny_moe import build_tiny_moe, tiny_moe_config  # noqa: E402

MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
#: Also OLMoE and DeepSeek-V3 (latent attention, a dense first block, shared experts, a float32 router).
#: And GPT-OSS (experts stored (experts, in, out) with biases, a router with a bias, attention sinks).
TABLES = MOE + ("olmoe", "deepseek_v3", "gpt_oss")


def _outliers(model, seed: int = 0):
    """Random norm weights before attention and MLP, two channels x20 each (activation outliers)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "layernorm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
                p[torch.randperm(p.numel(), generator=g)[:2]] *= 20
    return model


def _double(model):
    """``model`` in float64 (transformers' eager experts loop: its grouped matmul takes no float64)."""
    model.config._experts_implementation = "eager"
    return model.double()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one thread (several spin on a loaded machine: minutes instead of seconds)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("arch", MOE)
def test_the_moe_group_holds_router_experts_and_shared_expert(arch):
    model = build_tiny_moe(arch)
    groups = [g for g in smoothing_groups(model) if g["prev"] == "model.layers.1.post_attention_layernorm"]
    assert len(groups) == 1
    g, blk = groups[0], "model.layers.1.mlp"
    assert g["linears"][0] == f"{blk}.gate" and g["stacked"] == [f"{blk}.experts.gate_up_proj"]
    assert g["inspect"] == blk and g["local"] is True
    if arch == "qwen2_moe":
        assert g["routers"] == [f"{blk}.gate", f"{blk}.shared_expert_gate"]
        assert {f"{blk}.shared_expert.gate_proj", f"{blk}.shared_expert.up_proj"} <= set(g["linears"])
    else:
        assert g["routers"] == [f"{blk}.gate"] and len(g["linears"]) == 2


def test_dense_and_moe_blocks_get_their_own_groups():
    """Qwen2-MoE with a dense first block (``mlp_only_layers``): its MLP gets the dense groups."""
    cfg = tiny_moe_config("qwen2_moe")
    cfg.mlp_only_layers = [0]
    torch.manual_seed(0)
    dense = type(build_tiny_moe("qwen2_moe"))(cfg).eval()
    groups = smoothing_groups(dense)
    mlp0 = [g["linears"] for g in groups if g["prev"].startswith("model.layers.0.") and "mlp" in g["linears"][0]]
    mlp1 = [g["linears"] for g in groups if g["prev"].startswith("model.layers.1.") and "mlp" in g["linears"][0]]
    assert mlp0 == [["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"], ["model.layers.0.mlp.down_proj"]]
    assert mlp1[0][:2] == ["model.layers.1.mlp.gate", "model.layers.1.mlp.experts.gate_up_proj"]
    assert sorted(residual_layout(dense).writers) == sorted([
        "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.shared_expert.down_proj.weight",
        "model.layers.1.mlp.experts.down_proj"])


@pytest.mark.parametrize("arch", TABLES)
def test_scaling_alone_keeps_the_logits(arch):
    model = _double(build_tiny_moe(arch))
    before = _logits(model, IDS)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(state)
    g = torch.Generator().manual_seed(0)
    for grp in as_groups(smoothing_groups(model)):
        s = torch.rand(group_shape(params, grp).prev, generator=g, dtype=torch.float64) * 4 + 0.25
        params.update(fold(params, grp, s))
    router = f"model.layers.1.mlp.{'router' if arch == 'gpt_oss' else 'gate'}.weight"
    assert not torch.equal(params[router], state[router])  # the router was scaled too
    model.load_state_dict(params)
    after = _logits(model, IDS)
    assert torch.allclose(after, before, atol=1e-6 * before.abs().max(), rtol=0)
    model.load_state_dict({**params, **{k: v for k, v in state.items() if ".experts." in k}})
    assert not torch.allclose(_logits(model, IDS), before, atol=1e-3 * before.abs().max(), rtol=0)  # sensitive


@pytest.mark.parametrize("arch", TABLES)
def test_rotation_alone_keeps_the_logits(arch):
    model = _double(build_tiny_moe(arch))
    before = _logits(model, IDS)
    params = dict(model.state_dict())
    layout = residual_layout(model)
    assert "model.layers.1.mlp.experts.down_proj" in layout.writers
    assert all(".experts." not in p for p in layout.down)  # no online R4 inside an experts module
    R1 = qt.rotation.random_orthogonal(model.config.hidden_size, 3, dtype=torch.float64)
    R2 = qt.rotation.random_orthogonal(layout.heads[0].head_dim, 4, dtype=torch.float64) if layout.heads else None
    rotated = qt.rotate(params, layout, R1, R2)
    up = "model.layers.1.mlp.experts.gate_up_proj"
    g = params["model.layers.1.post_attention_layernorm.weight"]
    if arch == "gpt_oss":  # stored (experts, hidden, 2 inter): rotated on its first matrix axis
        assert torch.allclose(rotated[up], R1.T @ (params[up] * g[:, None]))
    else:  # every expert, as one matrix each would be
        assert torch.allclose(rotated[up], params[up] * g @ R1)
    model.load_state_dict(rotated)
    after = _logits(model, IDS)
    assert torch.allclose(after, before, atol=1e-6 * before.abs().max(), rtol=0)


def _fast(recipe):
    """The preset's recipe with SpinQuant at 3 iterations (100 would take minutes here)."""
    steps = tuple(qt.Step(s.name, **{**s.options, "iters": 3}) if s.name == "spinquant" else s for s in recipe.steps)
    return dataclasses.replace(recipe, steps=steps)


def _build(arch):
    model = _outliers(build_tiny_moe(arch))
    model.config._experts_implementation = "eager"  # the float model's loop (grouped_mm's first calls are slow)
    return model


def _error(arch, recipe, calib, ref):
    model = _build(arch)
    result = bridge.quantize_params(model, recipe, calibration=calib)
    q = bridge.to_module(model, result)
    return float((_logits(q, IDS) - ref).pow(2).mean() / ref.pow(2).mean()), q, result


PRESETS = ("w8a8-int8-sq", "gptq-w8a8", "awq4-g64", "awq4-g128", "awq3-g64", "awq-gptq4-g128", "quarot-w4a8",
           "spinquant-w4a8")
#: Every preset on Mixtral; one of each algorithm on the other families (time).
CASES = ([("mixtral", n) for n in PRESETS] + [(a, n) for a in MOE[1:] for n in ("w8a8-int8-sq", "awq4-g64",
                                                                                "awq-gptq4-g128", "quarot-w4a8")]
         + [("olmoe", "awq4-g64"), ("deepseek_v3", "w8a8-int8-sq"), ("deepseek_v3", "quarot-w4a8"),
            ("gpt_oss", "awq4-g64"), ("gpt_oss", "quarot-w4a8")])


@pytest.mark.parametrize("arch,name", CASES)
def test_presets_beat_round_to_nearest_and_keep_routers_float(arch, name):
    calib = [torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    ref = _logits(_build(arch), IDS)
    recipe = _fast(qt.get_preset(name).recipe)
    err, q, result = _error(arch, recipe, calib, ref)
    rtn, _, _ = _error(arch, dataclasses.replace(recipe, steps=()), calib, ref)
    assert err < rtn, f"{name} on {arch}: relative error {err:.3g}, round to nearest {rtn:.3g}"
    name = "router" if arch == "gpt_oss" else "gate"
    for i in [i for i in range(2) if hasattr(q.model.layers[i].mlp, "experts")]:
        gate = getattr(q.model.layers[i].mlp, name)
        assert isinstance(gate.weight, torch.nn.Parameter) and gate.weight.is_floating_point()
        assert not isinstance(result.qtree[f"model.layers.{i}.mlp.{name}.weight"], qt.QTensor)
    assert isinstance(result.qtree["model.layers.1.mlp.experts.gate_up_proj"], qt.QTensor)


@pytest.mark.parametrize("name", ["quarot-w4a4", "spinquant-w4a4"])
def test_four_bit_activation_rotations_are_refused_on_experts(name):
    calib = [torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.down_proj: .*online Hadamard rotation R4"):
        bridge.quantize_params(build_tiny_moe("mixtral"), _fast(qt.get_preset(name).recipe), calibration=calib)

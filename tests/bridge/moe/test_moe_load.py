"""Quantized experts through every way in and out: bridge.save -> from_pretrained and bridge.load (same logits),
quantize-on-load from a float checkpoint stored per expert (as save_pretrained writes it) equal to
bridge.quantize, QExperts' buffers and dtype handling."""

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import bridge
import qtransform as qt

from .tiny_moe import build_tiny_moe

IDS = torch.tensor([[3, 7, 1, 9, 22, 5, 14, 2, 8, 31]])


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_save_from_pretrained_and_load_give_the_same_logits(model_type, tmp_path):
    model = build_tiny_moe(model_type)
    qmodel = bridge.quantize(model, qt.get_preset("int4-g32-asym").recipe)
    with torch.no_grad():
        want = qmodel(IDS).logits
    bridge.save(qmodel, tmp_path / "q")
    names = set()
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    experts = [n for n, m in qmodel.named_modules() if isinstance(m, bridge.QExperts)]
    assert experts
    for e in experts:  # codes and parameters of each stacked weight, under the weight's own name
        assert {f"{e}.gate_up_proj", f"{e}.gate_up_proj_scale", f"{e}.gate_up_proj_zero_point",
                f"{e}.down_proj", f"{e}.down_proj_scale"} <= names
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()
    again = bridge.load(tmp_path / "q", like=model)
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, want)
        assert torch.equal(again(IDS).logits, want)


def test_quantize_on_load_from_a_per_expert_checkpoint_equals_bridge_quantize(tmp_path):
    model = build_tiny_moe("qwen2_moe")
    model.save_pretrained(tmp_path / "f")
    with safe_open(str(tmp_path / "f" / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in stored  # per expert on disk, fused in the model
    recipe = qt.get_preset("int4-g32").recipe
    on_load = AutoModelForCausalLM.from_pretrained(tmp_path / "f",
                                                   quantization_config=bridge.QTransformConfig(recipe=recipe)).eval()
    assert isinstance(on_load.model.layers[0].mlp.experts, bridge.QExperts)
    ref = bridge.quantize(AutoModelForCausalLM.from_pretrained(tmp_path / "f").eval(), recipe)
    with torch.no_grad():
        assert torch.equal(on_load(IDS).logits, ref(IDS).logits)


def test_qexperts_keep_their_codes_through_to_and_state_dict():
    model = build_tiny_moe("mixtral")
    qmodel = bridge.quantize(model, qt.get_preset("int8-channel").recipe)
    experts = qmodel.model.layers[0].mlp.experts
    q = experts.qtensor("down_proj")
    qmodel.to(torch.bfloat16)
    assert torch.equal(experts.qtensor("down_proj").codes, q.codes)  # codes and scales are never cast
    assert experts.qtensor("down_proj").qparams.scale.dtype == q.qparams.scale.dtype
    assert experts.compute_dtype == torch.bfloat16
    with torch.no_grad():
        out = qmodel(IDS).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="the experts need"):
        experts.set_qtensor("down_proj", qt.quantize(torch.zeros(2, 3, 4), qt.choose_qparams(
            torch.zeros(2, 3, 4), qt.stacked_spec(qt.QuantSpec(format="int8"), (2, 3, 4)))))


def test_an_output_quantizer_on_experts_is_refused_by_name():
    model = build_tiny_moe("mixtral")
    spec = qt.QuantSpec(format="int8", dynamic=True, granularity=qt.PerChannel(0))
    recipe = qt.Recipe(type_rules={"Linear": qt.QuantSpec(format="int8")}, exclude=["lm_head*"], output=spec)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.gate_up_proj: the recipe quantizes the output"):
        bridge.plan(model, recipe)
    ok = qt.Recipe(type_rules={"Linear": qt.QuantSpec(format="int8")}, exclude=["lm_head*"], output=spec,
                   act_rules={"*.experts.*:output": None})
    assert bridge.plan(model, ok).activations

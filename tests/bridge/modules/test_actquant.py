"""Activation quantization from recipes: static scales calibrated from data, dynamic specs, and both
surviving save -> bridge.load and save -> from_pretrained with identical logits."""

import json

import pytest
import torch

import qtransform as qt
import bridge
from bridge_util import REPO, tiny_causal_lm

W8 = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
FP8 = qt.QuantSpec(format="fp8_e4m3", granularity=qt.PerChannel(0))
SCHEMES = {
    "int8 static per tensor": dict(type_rules={"Linear": W8, "Conv1D": W8}, input=qt.QuantSpec(format="int8")),
    "int8 dynamic per token": dict(type_rules={"Linear": W8, "Conv1D": W8},
                                   input=qt.QuantSpec(format="int8", granularity=qt.PerChannel(0), dynamic=True)),
    "fp8 static per tensor": dict(type_rules={"Linear": FP8, "Conv1D": FP8}, input=qt.QuantSpec(format="fp8_e4m3")),
    "uint8 static per feature, outputs too": dict(
        type_rules={"Linear": W8, "Conv1D": W8},
        input=qt.QuantSpec(format="uint8", symmetric=False, granularity=qt.PerChannel(-1)),
        output=qt.QuantSpec(format="int8"), act_rules={"*down_proj:input": None, "*fc2:input": None}),
}
ARCHS = ["llama", "qwen2", "opt", "gpt2"]


def calibration(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 100, (2, 12), generator=g) for _ in range(n)]


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("arch", ARCHS)
def test_activation_quantizers_survive_both_loaders(arch, scheme, tmp_path):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = tiny_causal_lm(arch).eval()
    recipe = qt.Recipe(exclude=["lm_head*"], **SCHEMES[scheme])
    qmodel = bridge.quantize(model, recipe, calibration=calibration())
    sites = bridge.modules.actquant.activation_specs(qmodel)
    assert len(sites) >= 8
    ids = torch.randint(3, 100, (2, 9))
    ref = logits(qmodel, ids)
    wonly = bridge.quantize(model, qt.Recipe(exclude=["lm_head*"], type_rules=recipe.type_rules))
    assert not torch.equal(ref, logits(wonly, ids))  # the activations are quantized
    bridge.save(qmodel, tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())["quantization_config"]
    assert cfg["version"] == 3 and len(cfg["activations"]) == len(sites)
    a = bridge.load(tmp_path / "ck", like=model)
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "ck")
    for m in (a, b):
        assert bridge.modules.actquant.activation_specs(m) == sites
        assert torch.equal(logits(m, ids), ref)
    b.save_pretrained(tmp_path / "again")  # transformers' own save keeps them
    c = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert torch.equal(logits(c, ids), ref)


def test_static_scale_is_the_calibrated_absmax():
    """The first layer's q_proj input does not depend on any quantized weight: its scale must be
    max |input| over every calibration batch / 127.5 (int8 symmetric over the full code range
    [-128, 127], the house convention), captured here with a plain hook."""
    torch.manual_seed(0)
    model = tiny_causal_lm("llama").eval()
    batches = calibration(4)
    seen = []
    q_proj = model.model.layers[0].self_attn.q_proj
    handle = q_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().abs().max()))
    with torch.no_grad():
        for b in batches:
            model(b)
    handle.remove()
    want = torch.stack(seen).max() / 127.5
    recipe = qt.Recipe(type_rules={"Linear": W8}, input=qt.QuantSpec(format="int8"), exclude=["lm_head*"])
    qmodel = bridge.quantize(model, recipe, calibration=batches)
    got = qmodel.model.layers[0].self_attn.q_proj.input_scale
    assert got.shape == (1, 1)
    torch.testing.assert_close(got.reshape(()), want, rtol=1e-6, atol=0)


def test_percentile_observer_clips_the_outliers():
    torch.manual_seed(0)
    model = tiny_causal_lm("llama").eval()
    recipe = qt.Recipe(type_rules={"Linear": W8}, input=qt.QuantSpec(format="int8"), exclude=["lm_head*"])
    a = bridge.quantize(model, recipe, calibration=calibration())
    b = bridge.quantize(model, recipe, calibration=calibration(), act_observer={"name": "percentile", "percentile": 90.0})
    name = "model.layers.0.self_attn.q_proj"
    assert b.get_submodule(name).input_scale.item() < a.get_submodule(name).input_scale.item()


def test_static_activations_need_calibration_before_any_step_runs():
    model = tiny_causal_lm("llama").eval()
    recipe = qt.Recipe(type_rules={"Linear": W8}, input=qt.QuantSpec(format="int8"), steps=["hqq"])
    with pytest.raises(ValueError, match=r"static activation specs .* need calibration data"):
        bridge.quantize(model, recipe)


def test_recipe_activation_fields_checked_and_round_trip():
    with pytest.raises(ValueError, match="Recipe.input: a static activation spec cannot be per token"):
        qt.Recipe(input=qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)))
    with pytest.raises(ValueError, match="act_rules"):
        qt.Recipe(act_rules={"*.q_proj": None})
    with pytest.raises(TypeError, match="Recipe.output must be a QuantSpec"):
        qt.Recipe(output="int8")
    r = qt.Recipe(default=W8, input=qt.QuantSpec(format="int8"), act_rules={"*.down_proj:input": None})
    assert qt.Recipe.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    assert r.resolve_activation("m.down_proj", "input").spec is None
    assert r.resolve_activation("m.up_proj", "input").spec == qt.QuantSpec(format="int8")
    assert r.resolve_activation("m.up_proj", "output").spec is None
    preset = qt.recipe_from_dict({"default": W8.to_dict(), "input": {"format": "int8"},
                                  "act_rules": {"*.o_proj:input": None}})
    assert preset.recipe.input == qt.QuantSpec(format="int8") and preset.recipe.act_rules == (("*.o_proj:input", None),)


def test_plan_activations_skip_embedding_inputs():
    params = {"emb.weight": torch.randn(10, 8), "fc.weight": torch.randn(4, 8)}
    spec = qt.QuantSpec(format="int8", dynamic=True)
    plan = qt.Recipe(default=W8, input=spec, output=spec).plan(params, types={"emb.weight": "Embedding",
                                                                             "fc.weight": "Linear"})
    assert set(plan.activations) == {qt.Site("emb", "output"), qt.Site("fc", "input"), qt.Site("fc", "output")}


def test_the_readme_recipe_file_with_activations_parses():
    import re
    import tomllib

    text = (REPO / "docs" / "command.md").read_text()
    block = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
    recipe = qt.recipe_from_dict(tomllib.loads("\n".join(line[2:] for line in block.splitlines()))).recipe
    assert recipe.input == qt.QuantSpec(format="int8", granularity=qt.PerChannel(0), dynamic=True)
    assert recipe.act_rules == (("*.down_proj:input", qt.QuantSpec(format="int8", dynamic=True)),)


def test_cli_static_preset_without_calibration_is_one_line_before_loading(tmp_path, capsys):
    from bridge.app.cli import main

    out = tmp_path / "ck"
    rc = main(["quantize", "--model", str(tmp_path / "no-such-model"), "--recipe", "w8a8-int8", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and not out.exists()
    assert "static scales" in err and "--calib N" in err and len(err.strip().splitlines()) == 1

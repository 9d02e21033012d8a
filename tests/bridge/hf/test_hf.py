"""transformers integration on tiny untrained models: save -> from_pretrained, quantize on load."""

import pytest
import torch

import qtransform as qt
import bridge
from bridge_util import same_bits, tiny_causal_lm

ARCHS = ["llama", "mistral", "qwen2", "opt", "gpt2", "bert"]
RECIPE = qt.Recipe(default=qt.QuantSpec(format="int4", granularity=qt.PerGroup(32), symmetric=False),
                   rules={"*mlp.down_proj.weight": qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)),
                          "*.fc2.weight": qt.QuantSpec(format="nf4")},
                   type_rules={"Conv1D": qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))},
                   exclude=["lm_head*", "*embed*", "*wte*", "*wpe*", "cls.*"])


def auto_class(arch):
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM
    return AutoModelForMaskedLM if arch == "bert" else AutoModelForCausalLM


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_save_then_from_pretrained_gives_same_logits(arch, tmp_path):
    torch.manual_seed(0)
    model = tiny_causal_lm(arch).eval()
    qmodel = bridge.quantize(model, RECIPE)
    n_q = sum(isinstance(m, bridge.QModule) for m in qmodel.modules())
    assert n_q >= 8
    ids = torch.randint(3, 128, (2, 9))
    ref = logits(qmodel, ids)
    bridge.save(qmodel, tmp_path / "ck")
    back = auto_class(arch).from_pretrained(tmp_path / "ck")
    assert sum(isinstance(m, bridge.QModule) for m in back.modules()) == n_q
    assert torch.equal(logits(back, ids), ref)
    for (k, a), b in zip(qmodel.state_dict().items(), back.state_dict().values()):
        assert same_bits(a, b), k
    if arch != "bert":
        out = back.generate(ids[:1], max_new_tokens=4, do_sample=False)
        assert out.shape == (1, 13)
    back.save_pretrained(tmp_path / "sp")  # transformers' own save of the quantized model
    again = auto_class(arch).from_pretrained(tmp_path / "sp")
    assert torch.equal(logits(again, ids), ref)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_quantize_on_load_matches_bridge_quantize(arch, tmp_path):
    torch.manual_seed(0)
    model = tiny_causal_lm(arch).eval()
    model.save_pretrained(tmp_path / "fp")
    cfg = bridge.QTransformConfig(recipe=RECIPE, skip_modules=[])
    loaded = auto_class(arch).from_pretrained(tmp_path / "fp", quantization_config=cfg)
    ids = torch.randint(3, 128, (1, 7))
    ref = bridge.quantize(model, RECIPE)
    assert torch.equal(logits(loaded, ids), logits(ref, ids))
    q_paths = set(loaded.config.quantization_config.entries)
    assert q_paths == {p for p, m in bridge.plan(model, RECIPE).items() if m.spec is not None}
    loaded.save_pretrained(tmp_path / "q")
    back = auto_class(arch).from_pretrained(tmp_path / "q")
    assert torch.equal(logits(back, ids), logits(ref, ids))


@pytest.fixture
def scaled_step():
    """A calibration-free, one-tensor-at-a-time step of the test's own (registered for this test only)."""
    calls = []

    def scaled_range(params, plan, *, context, factor=1.0):
        calls.extend(plan.specs)
        return qt.Fit(qparams={p: qt.choose_qparams(params[p] * factor, s) for p, s in plan.specs.items()})

    qt.register_algorithm("test_scaled", scaled_range, local=True)
    qt.register_algorithm("test_global", lambda params, plan, *, context: qt.Fit())  # not local
    yield calls
    qt.ALGORITHMS.unregister("test_scaled")
    qt.ALGORITHMS.unregister("test_global")


def test_quantize_on_load_default_skips_and_runs_the_recipe_steps(tmp_path, scaled_step):
    torch.manual_seed(0)
    model = tiny_causal_lm("llama").eval()
    model.save_pretrained(tmp_path / "fp")
    spec = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
    cfg = bridge.QTransformConfig(recipe=spec, algorithm="test_scaled", algorithm_options={"factor": 0.5})
    assert cfg.recipe.steps == (qt.Step("test_scaled", factor=0.5),)
    loaded = auto_class("llama").from_pretrained(tmp_path / "fp", quantization_config=cfg)
    assert type(loaded.lm_head).__name__ == "Linear"  # transformers' default skip keeps the output layer
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, bridge.QLinear)
    assert "model.layers.0.self_attn.q_proj.weight" in scaled_step
    w = model.model.layers[0].self_attn.q_proj.weight.detach()
    want = qt.quantize(w, qt.choose_qparams(w * 0.5, spec))
    assert same_bits(loaded.model.layers[0].self_attn.q_proj.weight, want.codes)
    loaded.save_pretrained(tmp_path / "q")  # the steps are part of the saved config and load back
    back = auto_class("llama").from_pretrained(tmp_path / "q")
    assert back.config.quantization_config.recipe.steps == (qt.Step("test_scaled", factor=0.5),)
    assert same_bits(back.model.layers[0].self_attn.q_proj.weight, want.codes)
    with pytest.raises(ValueError, match=r"rtn: unknown option\(s\) \['factor'\]"):
        bridge.QTransformConfig(recipe=spec, algorithm="rtn", algorithm_options={"factor": 0.5})
    with pytest.raises(ValueError, match="unknown algorithm 'nope'"):
        bridge.QTransformConfig(recipe=spec, algorithm="nope")
    with pytest.raises(TypeError, match="skip_modules must be a list of module names"):
        bridge.QTransformConfig(recipe=spec, skip_modules="lm_head")
    with pytest.raises(ValueError, match=r"\['rules'\] describe a saved checkpoint and come with its 'version'"):
        bridge.QTransformConfig(recipe=spec, rules={"a": 1})
    with pytest.raises(ValueError, match="'test_global' changes several tensors together"):
        auto_class("llama").from_pretrained(tmp_path / "fp", quantization_config=bridge.QTransformConfig(
            recipe=spec, steps=["test_global"]))


def test_from_pretrained_rejects_bad_quantization_config(tmp_path):
    import json
    model = tiny_causal_lm("llama").eval()
    bridge.save(bridge.quantize(model, qt.QuantSpec(format="int8")), tmp_path / "ck")
    p = tmp_path / "ck" / "config.json"
    cfg = json.loads(p.read_text())
    cfg["quantization_config"]["version"] = 7
    p.write_text(json.dumps(cfg))
    with pytest.raises(bridge.CheckpointError, match="version 7"):
        auto_class("llama").from_pretrained(tmp_path / "ck")


def test_save_pretrained_of_bridge_quantized_model_with_tied_output(tmp_path):
    torch.manual_seed(0)
    model = tiny_causal_lm("gpt2").eval()  # lm_head is tied to transformer.wte
    recipe = qt.Recipe(default=qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)), exclude=["*wte*", "*wpe*"])
    qm = bridge.quantize(model, recipe)
    assert isinstance(qm.lm_head, bridge.QLinear) and type(qm.transformer.wte).__name__ == "Embedding"
    ids = torch.randint(0, 128, (1, 6))
    qm.save_pretrained(tmp_path / "sp")
    bridge.save(qm, tmp_path / "ck")
    for d in ("sp", "ck"):
        back = auto_class("gpt2").from_pretrained(tmp_path / d)
        assert isinstance(back.lm_head, bridge.QLinear)
        assert torch.equal(logits(back, ids), logits(qm, ids)), d

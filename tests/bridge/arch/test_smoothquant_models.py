"""SmoothQuant on tiny models of every supported family (random weights, random norm weights and biases,
outlier channels): smoothed but unquantized, the logits are the original ones; through
``bridge.quantize`` with calibration data the step gets the model's groups; errors are named."""

import copy

import pytest
import torch

import bridge
import qtransform as qt
from bridge.arch import smoothing_groups
from bridge.calibrate import ModelCalibrator
from bridge.pipeline import plan
from bridge_util import tiny_causal_lm, tiny_with_outliers

W8 = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
A8 = qt.QuantSpec(format="int8")
ARCHS = ("llama", "mistral", "qwen2", "opt", "gpt2", "phi3")


_outliers = tiny_with_outliers


def _batches(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (2, 12), generator=g), torch.randint(0, 128, (1, 9), generator=g)]


def _recipe(**step):
    return qt.Recipe(type_rules={"Linear": W8, "Conv1D": W8}, exclude=["lm_head*"], input=A8,
                     steps=[qt.Step("smoothquant", **step)])


def _smoothed(m, recipe):
    fit = qt.run_steps(bridge.extract(m), plan(m, recipe), calibrator=ModelCalibrator(m, _batches()))
    out = copy.deepcopy(m)
    out.load_state_dict({**out.state_dict(), **fit.params})
    return fit, out


@pytest.mark.parametrize("alpha", [0.5, "auto"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_smoothed_unquantized_model_gives_the_original_logits(arch, alpha):
    m = _outliers(arch)
    fit, smoothed = _smoothed(m, _recipe(alpha=alpha))
    groups = smoothing_groups(m)
    touched = {f"{p}.{t}" for g in groups for p in (g["prev"], *g["linears"]) for t in ("weight", "bias")}
    assert fit.params and set(fit.params) <= touched
    if alpha == 0.5:  # every group changes: its producer's and its linears' weights
        assert {f"{p}.weight" for g in groups for p in (g["prev"], *g["linears"])} <= set(fit.params)
    original = dict(m.state_dict())
    assert any(not torch.allclose(t, original[p]) for p, t in fit.params.items())
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = m(ids).logits, smoothed(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_auto_uses_the_recipes_input_spec_of_the_group():
    m = _outliers("llama")
    dyn = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0), dynamic=True)
    by_recipe, _ = _smoothed(m, qt.Recipe(type_rules={"Linear": W8}, exclude=["lm_head*"], input=dyn,
                                          steps=[qt.Step("smoothquant", alpha="auto")]))
    by_option, _ = _smoothed(m, _recipe(alpha="auto", activation=dyn.to_dict()))
    default, _ = _smoothed(m, _recipe(alpha="auto"))
    assert sorted(by_recipe.params) == sorted(by_option.params)
    assert all(torch.equal(by_recipe.params[p], by_option.params[p]) for p in by_recipe.params)
    assert sorted(default.params) != sorted(by_option.params) or any(
        not torch.equal(default.params[p], by_option.params[p]) for p in default.params)


def test_bridge_quantize_runs_smoothquant_on_calibration_data():
    m = _outliers("qwen2")
    qm = bridge.quantize(m, qt.Recipe(type_rules={"Linear": W8}, exclude=["lm_head*"], steps=["smoothquant"]),
                         calibration=_batches(), kernel="dequant")
    ids = _batches(3)[0]
    with torch.no_grad():
        want, got = m(ids).logits, qm(ids).logits
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * float(want.abs().max()))  # int8 weights only
    # the smoothing moved into the quantized weights: the model's norms are untouched, the new model's differ
    assert not torch.equal(qm.model.layers[0].input_layernorm.weight, m.model.layers[0].input_layernorm.weight)


def test_missing_calibration_groups_or_architecture_are_named():
    m = _outliers("llama")
    with pytest.raises(ValueError, match=r"'smoothquant' runs block by block on calibration data"):
        bridge.quantize(m, qt.Recipe(type_rules={"Linear": W8}, steps=["smoothquant"]))
    p = plan(m, qt.Recipe(type_rules={"Linear": W8}, steps=["smoothquant"])).replace(groups=None)
    with pytest.raises(ValueError, match=r"steps\[0\] \(smoothquant\): needs the model's smoothing groups \(Plan.groups\)"):
        qt.run_steps(bridge.extract(m), p, calibrator=ModelCalibrator(m, _batches()))
    across = [{"prev": "model.layers.0.input_layernorm", "linears": ["model.layers.1.self_attn.q_proj"]}]
    p = plan(m, qt.Recipe(type_rules={"Linear": W8}, steps=[qt.Step("smoothquant", groups=across)]))
    with pytest.raises(ValueError, match=r"input_layernorm.*is not inside one block of model.layers"):
        qt.run_steps(bridge.extract(m), p, calibrator=ModelCalibrator(m, _batches()))
    bert = tiny_causal_lm("bert")
    with pytest.raises(ValueError, match=r"steps\[0\] \(smoothquant\): needs the groups of BertForMaskedLM.*"
                                         r"no architecture table fits BertForMaskedLM"):
        bridge.quantize(bert, qt.Recipe(type_rules={"Linear": W8}, steps=["smoothquant"]), calibration=_batches())

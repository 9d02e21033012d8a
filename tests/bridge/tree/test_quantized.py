"""The pipeline's result (``bridge.Quantized``) as the one input of ``to_module`` and ``save``: its
tree, plan, activation quantizers and online rotations travel together."""

import warnings

import pytest
import torch

import bridge
import qtransform as qt
from bridge_util import tiny_causal_lm

W4 = qt.QuantSpec(format="int4", granularity=qt.PerGroup(16))
A8 = qt.QuantSpec(format="int8", dynamic=True)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)).eval()


def _same_modules(a, b):
    assert [type(m).__name__ for m in a.modules()] == [type(m).__name__ for m in b.modules()]
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_quantize_is_quantize_params_then_to_module_of_the_result():
    model = _mlp()
    recipe = qt.Recipe(default=W4, input=A8, steps=["hqq"])
    r = bridge.quantize_params(model, recipe)
    assert isinstance(r, bridge.Quantized) and r.activations and r.plan is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the result form warns of nothing
        got = bridge.to_module(model, r)
    _same_modules(got, bridge.quantize(model, recipe))
    assert got[0].input_spec == A8  # the activation quantizers came with the result
    x = torch.randn(3, 32)
    torch.testing.assert_close(got(x), bridge.quantize(model, recipe)(x))


def test_online_rotations_travel_with_the_result():
    model = tiny_causal_lm("llama").eval()
    recipe = qt.Recipe(type_rules={"Linear": W4}, exclude=["lm_head*"], steps=[qt.Step("rotate", r3=True)])
    r = bridge.quantize_params(model, recipe)
    assert r.online
    ids = torch.tensor([[1, 5, 9, 2, 17, 3]])
    got = bridge.to_module(model, r)
    with torch.no_grad():
        torch.testing.assert_close(got(ids).logits, bridge.quantize(model, recipe)(ids).logits)


def test_save_takes_the_result_and_load_gives_its_model(tmp_path):
    model = _mlp()
    recipe = qt.Recipe(default=W4, input=A8)
    r = bridge.quantize_params(model, recipe)
    bridge.save(r, tmp_path / "ck")
    meta = bridge.read_metadata(tmp_path / "ck")
    assert meta.recipe == r.plan.recipe and meta.rules == {"0.weight": "default", "2.weight": "default"}
    assert meta.activations == r.activations
    back = bridge.load(tmp_path / "ck", like=model)
    _same_modules(back, bridge.to_module(model, r))


def test_save_refuses_a_result_with_static_activation_scales(tmp_path):
    model = _mlp()
    r = bridge.quantize_params(model, qt.Recipe(default=W4, input=qt.QuantSpec(format="int8")),
                               calibration=[torch.randn(4, 32)])
    with pytest.raises(ValueError, match=r"save: the static activation quantizers .* save its model"):
        bridge.save(r, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()
    bridge.save(bridge.to_module(model, r), tmp_path / "ck")  # the way the message names
    _same_modules(bridge.load(tmp_path / "ck", like=model), bridge.to_module(model, r))

"""SpinQuant: rotations learned on the quantized model's loss through torch.func.grad. The learned
rotations stay orthogonal, so the rotated but unquantized model keeps its function (with its online
rotations); the training loss falls; zero iterations is QuaRot's rotate step from the same seed; the
rotation not learned keeps its starting matrix; the calibration loss is the model's own loss."""

import pytest
import torch
from bridge_util import tiny_with_outliers

import bridge
import qtransform as qt
from bridge.arch import with_layout
from bridge.calibrate import ModelCalibrator
from bridge.calibrate.loss import CalibrationLoss

W4 = qt.QuantSpec(format="int4", granularity=qt.PerChannel(0))
A4 = qt.QuantSpec(format="int4", granularity=qt.PerChannel(0), dynamic=True)
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def _cal(n=4):
    return [torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(20 + i)) for i in range(n)]


def _recipe(*steps, input=A4):
    return qt.Recipe(type_rules={"Linear": W4}, exclude=["lm_head*"], input=input, steps=list(steps))


def _fit(model, *steps, cal=None):
    p = with_layout(model, bridge.plan(model, _recipe(*steps)))
    return qt.run_steps(bridge.extract(model), p, calibrator=ModelCalibrator(model, cal or _cal()))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_learned_rotations_keep_the_float_function_and_lower_the_loss(arch):
    """(The output head is scaled x10 so that the tiny model's predictions are peaked: with near-uniform
    ones, as a random model's, quantization barely moves the loss and there is nothing to learn. One
    thread: int4 straight-through training amplifies summation-order noise, which multi-threaded BLAS
    varies with the machine's load.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _learn_and_check(arch)
    finally:
        torch.set_num_threads(threads)


def _learn_and_check(arch):
    model = tiny_with_outliers(arch)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    fit = _fit(model, qt.Step("spinquant", iters=12, lr=0.1))
    before, after = map(float, next(iter(fit.info.values()))["spinquant_loss"].split(" -> "))
    assert after < 0.95 * before
    rotated = bridge.to_module(model, qt.apply_fit(bridge.extract(model), fit), online=fit.online)
    with torch.no_grad():
        assert torch.allclose(rotated(IDS).logits, model(IDS).logits, atol=1e-4, rtol=1e-4)
    assert {s.role for s in fit.online} == {"input"}  # R4; R3 only with a key quantizer


def test_zero_iterations_is_the_rotate_step():
    model = tiny_with_outliers("llama")
    spin, rot = _fit(model, qt.Step("spinquant", iters=0, seed=3)), _fit(model, qt.Step("rotate", seed=3))
    assert spin.online == rot.online and set(spin.params) == set(rot.params)
    for p in rot.params:
        assert torch.allclose(spin.params[p], rot.params[p], atol=1e-6), p


def test_only_the_named_rotations_are_learned():
    model = tiny_with_outliers("llama")
    rot = _fit(model, "rotate")
    r2 = _fit(model, qt.Step("spinquant", iters=6, learn=["r2"]))
    emb, v = "model.embed_tokens.weight", "model.layers.0.self_attn.v_proj.weight"
    assert torch.allclose(r2.params[emb], rot.params[emb], atol=1e-6)  # R1 kept: the embeddings are E R1
    assert not torch.allclose(r2.params[v], rot.params[v], atol=1e-4)  # R2 learned


def test_the_calibration_loss_is_the_models_own_and_differentiable():
    model = tiny_with_outliers("llama")
    params = bridge.extract(model)
    ids = _cal(1)
    plain = CalibrationLoss(model, ids, bridge.plan(model, _recipe(input=None)))
    with torch.no_grad():
        assert torch.allclose(plain(params, 0), model(ids[0], labels=ids[0]).loss)
    quantized = CalibrationLoss(model, ids, bridge.plan(model, _recipe()))
    g = torch.func.grad(lambda w: quantized({**params, "model.layers.0.mlp.up_proj.weight": w}, 0))(
        params["model.layers.0.mlp.up_proj.weight"])
    assert g.abs().sum() > 0 and not torch.allclose(quantized(params, 0), plain(params, 0))
    with pytest.raises(IndexError, match=r"batch 3 out of range \[0, 1\)"):
        plain(params, 3)


def test_spinquant_needs_data_and_valid_options():
    model = tiny_with_outliers("llama")
    with pytest.raises(ValueError, match="'spinquant' learns on the model's loss over calibration data"):
        bridge.quantize(model, _recipe("spinquant", "rtn"))
    with pytest.raises(ValueError, match="lr must be a number > 0"):
        bridge.quantize(model, _recipe(qt.Step("spinquant", lr=0), "rtn"), calibration=_cal())
    with pytest.raises(ValueError, match=r"learn must be a non-empty list of \['r1', 'r2'\]"):
        bridge.quantize(model, _recipe(qt.Step("spinquant", learn=["r3"]), "rtn"), calibration=_cal())
    with pytest.raises(ValueError, match="normalises with LayerNorm"):
        from bridge_util import tiny_causal_lm
        bridge.quantize(tiny_causal_lm("opt"), _recipe("spinquant", "rtn"), calibration=_cal())

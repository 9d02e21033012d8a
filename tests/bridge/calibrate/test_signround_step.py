"""The ``signround`` step through the bridge: it lowers a block's output error below round to nearest's for every
format family on tiny models of each architecture (Llama, GPT-2's Conv1D, OPT, mixture-of-experts), its offsets
and factors stay in their ranges, the chains after AWQ and QuaRot run, the preset from the command line saves and
reloads with identical logits, and bad options are refused by name before any calibration work."""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest
import torch

import bridge
import qtransform as qt
import tiny_lm
from bridge.app.cli import main
from bridge_util import on_command_model
from bridge_util import tiny_block_model as _model
from bridge_util import token_batches as _batches

sr_step = importlib.import_module("qtransform.algorithms.signround")
sr_math = importlib.import_module("qtransform.algorithms.signround_math")
U4 = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False)
U2 = qt.QuantSpec(format="uint2", granularity=qt.PerGroup(32), symmetric=False)
FAMILIES = {"uint4-asym": U4, "int4-sym": qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)),
            "nf4": qt.QuantSpec(format="nf4", granularity=qt.PerGroup(32)),
            "fp4": qt.QuantSpec(format="fp4_e2m1", granularity=qt.PerGroup(32)),
            "mxfp4": qt.QuantSpec(format="mxfp4"), "nvfp4": qt.QuantSpec(format="nvfp4")}
FIRST = {"llama": "model.layers.0", "gpt2": "transformer.h.0", "opt": "model.decoder.layers.0",
         "qwen3_moe": "model.layers.0", "mixtral": "model.layers.0"}
# every family on Llama, two on each other architecture
CASES = [("llama", f) for f in FAMILIES] + [("gpt2", "uint4-asym"), ("gpt2", "nvfp4"), ("opt", "int4-sym"),
                                             ("opt", "mxfp4"), ("qwen3_moe", "uint4-asym"), ("mixtral", "nf4")]


pytestmark = pytest.mark.usefixtures("one_thread")


def _recipe(spec, *steps):
    return qt.Recipe(type_rules={"Linear": spec, "Conv1D": spec, "Experts": spec}, exclude=["lm_head*"], steps=steps)


def _first_block_output(model, block, ids):
    """The output of the first block on ``ids`` (its inputs are the embeddings: the same for every model)."""
    seen = {}
    h = model.get_submodule(block).register_forward_hook(lambda m, a, out: seen.update(y=out[0] if isinstance(
        out, tuple) else out))
    with torch.no_grad():
        logits = model(ids).logits
    h.remove()
    return seen["y"], logits


def _errors(model, arch, recipe, calib, ids_list, step):
    """The first block's output MSE against the float block's, through the rebuilt quantized modules, summed over
    ``ids_list``: (with ``step``, round to nearest), and the step's result."""
    result = bridge.quantize_params(model, dataclasses.replace(recipe, steps=(step,)), calibration=calib)
    learned = bridge.to_module(model, result, kernel="dequant")
    rtn = bridge.quantize(model, recipe, kernel="dequant")
    err_sr = err_rtn = 0.0
    for ids in ids_list:
        y, _ = _first_block_output(model, FIRST[arch], ids)
        y_sr, logits = _first_block_output(learned, FIRST[arch], ids)
        assert torch.isfinite(logits).all()
        err_sr += float((y_sr - y).pow(2).mean())
        err_rtn += float((_first_block_output(rtn, FIRST[arch], ids)[0] - y).pow(2).mean())
    return err_sr, err_rtn, result


@pytest.mark.parametrize("arch,family", CASES)
def test_signround_lowers_the_block_output_error_below_round_to_nearest(arch, family):
    """On the calibration tokens (the error the step minimises, measured here through the quantized modules)."""
    model = _model(arch)
    calib = _batches(4, 1, model.config.vocab_size)
    err_sr, err_rtn, result = _errors(model, arch, _recipe(FAMILIES[family]), calib, calib,
                                      qt.Step("signround", iters=30))
    assert err_sr < 0.9 * err_rtn, (err_sr, err_rtn)
    # every planned weight of the blocks was trained: its best loss below round to nearest's (iteration 0)
    planned = [p for p in result.plan.specs if p.startswith(FIRST[arch][:-1])]
    assert planned and set(result.info) == set(planned)
    for p in planned:
        assert result.info[p]["signround_loss"] < result.info[p]["rtn_loss"], p
        assert result.qtree[p].spec == result.plan.specs[p]


@pytest.mark.parametrize("lr", [0.5, 0.02])
def test_the_kept_state_is_never_worse_than_the_start_on_all_the_batches(lr):
    """The best iterate is judged on its own iteration's batches; the step then compares it with the start on all
    of them. The info's losses are the first block's output MSE over every calibration batch (measured here through
    the rebuilt modules), the kept one never above the start's, and a step far too large (lr 0.5: every offset
    moved half a level at once) keeps round to nearest's weights."""
    model = _model("llama")
    calib = _batches(4, 1)
    err_sr, err_rtn, result = _errors(model, "llama", _recipe(U4), calib, calib,
                                      qt.Step("signround", iters=3, lr=lr, batch_size=2))
    planned = [p for p in result.plan.specs if p.startswith("model.layers.")]  # both blocks
    assert len(planned) == 14
    for p in planned:
        info = result.info[p]
        assert info["signround_loss"] <= info["rtn_loss"]
        if p.startswith(FIRST["llama"] + "."):  # the first block: its inputs are the embeddings on both chains
            assert info["rtn_loss"] == pytest.approx(err_rtn / len(calib), rel=1e-4)
            assert info["signround_loss"] == pytest.approx(err_sr / len(calib), rel=1e-4)
    if lr == 0.5:
        rtn = bridge.quantize_params(model, _recipe(U4))
        assert all(torch.equal(qt.dequantize(result.qtree[p]), qt.dequantize(rtn.qtree[p])) for p in planned)


@pytest.mark.parametrize("lr", [0.3, 0.05])
def test_the_kept_state_is_never_worse_than_the_last_iterate(lr):
    """``best=True`` keeps the lowest of the start, the best iterate and the last iterate; ``best=False`` the last.
    On the first block (the same inputs, the embeddings, in both runs) the kept state's error on all the batches,
    measured through the rebuilt modules, is never above the last iterate's."""
    model = _model("llama")
    calib = _batches(4, 1)
    err_best, _, _ = _errors(model, "llama", _recipe(U2), calib, calib,
                             qt.Step("signround", iters=5, lr=lr, batch_size=2))
    err_last, _, _ = _errors(model, "llama", _recipe(U2), calib, calib,
                             qt.Step("signround", iters=5, lr=lr, batch_size=2, best=False))
    assert err_best <= err_last * (1 + 1e-5), (err_best, err_last)


def test_holdout_batches_judge_and_are_never_trained_on():
    """``holdout=2``: calibration batches 1 and 3 (every second) are left out of the tuning passes (run with
    gradients) and are the ones the start, the best and the last iterate are compared on; the info's losses are the first
    block's output MSE over those two batches' elements alone (measured here through the rebuilt modules)."""
    model = _model("llama")
    g = torch.Generator().manual_seed(1)
    calib = [torch.randint(0, 128, (2, 20 + i), generator=g) for i in range(4)]  # batch i: 20 + i tokens
    recipe = _recipe(U2)
    seen = []
    hook = model.get_submodule(FIRST["llama"]).self_attn.q_proj.register_forward_pre_hook(
        lambda m, a: seen.append((a[0].shape[-2], torch.is_grad_enabled())))
    try:
        result = _quantize(model, recipe, calib, qt.Step("signround", iters=6, batch_size=2, lr=0.1, holdout=2))
    finally:
        hook.remove()
    tuned = [n for n, grad in seen if grad]
    assert len(tuned) == 6 and set(tuned) == {20, 22}, tuned
    untuned = [n for n, grad in seen if not grad]
    # + the three states judged: the start, the best iterate (not the start here) and the last one (every batch
    # also once in the capture of the blocks' own inputs, which runs the first block)
    assert untuned.count(21) == untuned.count(23) == untuned.count(20) + 3, untuned
    learned, rtn = bridge.to_module(model, result, kernel="dequant"), bridge.quantize(model, recipe, kernel="dequant")
    sse = {"signround_loss": 0.0, "rtn_loss": 0.0}
    for ids in (calib[1], calib[3]):
        y = _first_block_output(model, FIRST["llama"], ids)[0]
        for key, m in (("signround_loss", learned), ("rtn_loss", rtn)):
            sse[key] += float((_first_block_output(m, FIRST["llama"], ids)[0] - y).pow(2).sum())
    count = 2 * (21 + 23) * model.config.hidden_size
    info = result.info[f"{FIRST['llama']}.self_attn.q_proj.weight"]
    for key in sse:
        assert info[key] == pytest.approx(sse[key] / count, rel=1e-4), key
    assert info["signround_loss"] < info["rtn_loss"]


@pytest.mark.parametrize("family", ["uint4-asym", "nvfp4"])
def test_on_held_out_tokens_too(family):
    model = _model("llama")
    err_sr, err_rtn, _ = _errors(model, "llama", _recipe(FAMILIES[family]), _batches(4, 1), _batches(2, 99),
                                 qt.Step("signround", iters=30))
    assert err_sr < 0.9 * err_rtn, (err_sr, err_rtn)


@pytest.mark.parametrize("amp", [True, False])
def test_amp_runs_only_the_tuning_passes_in_bfloat16_and_still_learns(amp):
    """With ``amp`` every tuning pass (iters x the batches each draws) runs under bfloat16 autocast and no other
    pass does (the float targets, the check against the start, the next block's inputs); without it none does.
    Learned under amp, the first block's error on held-out tokens is still well below round to nearest's (at 2 bits:
    at 4 bits this tiny model's errors, ~1e-6 on outputs of ~1, are below bfloat16's resolution)."""
    model = _model("llama")
    iters, calib = 12, _batches(4, 1)  # batch_size 2 of 2-row batches: one batch per iteration
    modes = []
    hook = model.get_submodule(FIRST["llama"]).self_attn.q_proj.register_forward_pre_hook(
        lambda m, a: modes.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu")))
    try:
        err_sr, err_rtn, result = _errors(model, "llama", _recipe(U2), calib, _batches(2, 99),
                                          qt.Step("signround", iters=iters, batch_size=2, lr=1 / iters, amp=amp))
    finally:
        hook.remove()
    assert modes.count(torch.bfloat16) == (iters if amp else 0)
    assert len(modes) - modes.count(torch.bfloat16) >= 4 * len(calib)  # targets, check x2, next inputs
    assert err_sr < 0.9 * err_rtn, (err_sr, err_rtn)
    info = result.info[f"{FIRST['llama']}.self_attn.q_proj.weight"]
    assert info["signround_loss"] < info["rtn_loss"]


def _quantize(model, recipe, calib, *steps):
    return bridge.quantize_params(model, dataclasses.replace(recipe, steps=steps), calibration=calib)


@pytest.mark.parametrize("arch,family,init", [
    ("llama", "uint4-asym", "gptq"), ("llama", "int4-sym", "gptq"), ("llama", "nf4", "gptq"),
    ("llama", "nvfp4", "gptq"), ("gpt2", "uint4-asym", "gptq"), ("qwen3_moe", "uint4-asym", "gptq"),
    ("llama", "uint4-asym", "gptaq"), ("gpt2", "int4-sym", "gptaq"), ("qwen3_moe", "uint4-asym", "gptaq")])
def test_init_gptq_starts_from_gptqs_result_exactly(arch, family, init):
    """``init="gptq"`` with no iterations gives the ``gptq`` step's result, value for value (GPTQ's unrounded
    weights rounded to nearest with its parameters); ``init="gptaq"`` the ``gptq`` step's with ``gptaq=True``.
    Stacked experts (solved expert by expert, no unrounded weights kept) start from min-max ranges instead (so a
    MoE model's later blocks see other inputs: compared in its first block only)."""
    model = _model(arch)
    calib, recipe = _batches(4, 1), _recipe(FAMILIES[family])
    gptq = _quantize(model, recipe, calib, qt.Step("gptq", gptaq=init == "gptaq"))
    start = _quantize(model, recipe, calib, qt.Step("signround", iters=0, init=init))
    planned = [p for p in gptq.plan.specs if "gptq_loss" in gptq.info.get(p, {})]
    if arch == "qwen3_moe":
        planned = [p for p in planned if p.startswith(FIRST[arch] + ".")]
    experts = [p for p in planned if gptq.plan[p].module_type == "Experts"]
    assert len(planned) >= 6 and bool(experts) == (arch == "qwen3_moe")
    for p in planned:
        same = torch.equal(qt.dequantize(start.qtree[p]), qt.dequantize(gptq.qtree[p]))
        assert same != (p in experts), p


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_init_gptq_learns_below_gptq_at_2_bits(arch):
    """From GPTQ's solution, 20 signed steps lower the first block's output error (through the rebuilt modules)
    below GPTQ's own; the kept state's loss on all the batches is at most the start's (GPTQ's) for every weight."""
    model = _model(arch)
    calib, recipe = _batches(4, 1), _recipe(U2)
    err_sr, _, result = _errors(model, arch, recipe, calib, calib,
                                qt.Step("signround", iters=20, batch_size=2, init="gptq"))
    assert all(i["signround_loss"] <= i["rtn_loss"] for i in result.info.values() if "signround_loss" in i)
    qm = bridge.to_module(model, _quantize(model, recipe, calib, qt.Step("gptq")), kernel="dequant")
    err_gptq = sum(float((_first_block_output(qm, FIRST[arch], ids)[0]
                          - _first_block_output(model, FIRST[arch], ids)[0]).pow(2).mean()) for ids in calib)
    assert err_sr < 0.9 * err_gptq, (err_sr, err_gptq)


def _kept_states(monkeypatch) -> list:
    """The ``Learned`` state each weight is finalized with, in the order the step finalizes them."""
    seen = []
    real = sr_step.finalize

    def spy(lq, t, **kw):
        seen.append(t)
        return real(lq, t, **kw)

    monkeypatch.setattr(sr_step, "finalize", spy)
    return seen


def test_offsets_and_factors_stay_in_range_and_the_result_is_the_codec_grid(monkeypatch):
    seen = _kept_states(monkeypatch)
    model = _model("llama")
    step = qt.Step("signround", iters=40, lr=0.05, minmax_lr=0.05)  # large steps: pushed against the bounds
    bridge.quantize_params(model, _recipe(U4, step), calibration=_batches(2, 3))
    assert len(seen) == 14
    off = torch.cat([t.offset.reshape(-1) for t in seen])
    fac = torch.cat([torch.cat([t.alpha.reshape(-1), t.beta.reshape(-1)]) for t in seen])
    assert float(off.abs().max()) == 0.5 and float(fac.min()) >= 0.5 and float(fac.max()) <= 1.0
    assert float(fac.min()) < 1.0 and (off != 0).float().mean() > 0.2


def test_offsets_false_learns_the_clipping_factors_alone(monkeypatch):
    """``offsets=False``: every kept offset is exactly 0, the clipping factors moved, and the first block's error
    (through the rebuilt modules) is below round to nearest's at 2 bits."""
    seen = _kept_states(monkeypatch)
    model, calib = _model("llama"), _batches(4, 1)
    err, rtn, _ = _errors(model, "llama", _recipe(U2), calib, calib, qt.Step("signround", iters=20, offsets=False))
    assert len(seen) == 14 and all(int(torch.count_nonzero(t.offset)) == 0 for t in seen)
    assert float(torch.cat([torch.cat([t.alpha.reshape(-1), t.beta.reshape(-1)]) for t in seen]).min()) < 1.0
    assert err < rtn, (err, rtn)


def test_init_mse_starts_from_each_groups_least_error_clip():
    """iters=0: the stored weights are the start itself, clip_init's round to nearest of each float weight (the
    first block's; its inputs do not depend on the chain), with fewer squared weight errors than min-max's."""
    model = _model("llama")
    spec = qt.QuantSpec(format="uint2", granularity=qt.PerGroup(32), symmetric=False)
    mse = bridge.quantize_params(model, _recipe(spec, qt.Step("signround", iters=0, init="mse")),
                                 calibration=_batches(2, 3))
    rtn = bridge.quantize_params(model, _recipe(spec), calibration=_batches(2, 3))
    float_tree = bridge.tree.extract(model)
    for path in [p for p in mse.plan.specs if p.startswith("model.layers.0.")]:
        w = float_tree[path].detach()
        want, _ = sr_math.finalize(sr_math.prepare_weight(w, spec, path=path), sr_math.clip_init(sr_math.prepare_weight(w, spec)))
        got = qt.dequantize(mse.qtree[path], dtype=w.dtype)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert float((got - w).square().sum()) < float((qt.dequantize(rtn.qtree[path], dtype=w.dtype) - w).square().sum())


@pytest.mark.parametrize("first", ["awq", "rotate"])
def test_chains_after_awq_and_quarot_beat_the_first_step_alone(first):
    model = _model("llama")
    calib, held = _batches(4, 1), _batches(1, 99)[0]
    spec = qt.QuantSpec(format="uint3", granularity=qt.PerGroup(32), symmetric=False)
    with torch.no_grad():
        ref = model(held).logits

    def err(*steps):
        with torch.no_grad():
            q = bridge.quantize(model, _recipe(spec, *steps), calibration=calib, kernel="dequant")
            return float((q(held).logits - ref).pow(2).mean())

    alone = err(qt.Step(first))
    chained = err(qt.Step(first), qt.Step("signround", iters=30))
    assert chained < alone, (chained, alone)


def test_the_preset_from_the_command_line_saves_and_reloads_with_identical_logits(tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM

    src = tmp_path / "llama"
    _model("llama").save_pretrained(src)
    tiny_lm.tokenizer().save_pretrained(src)
    seen = {}
    ids = _batches(1, 7)[0]
    on_command_model(monkeypatch, lambda qmodel: seen.update(logits=qmodel(ids).logits.detach()))
    out = tmp_path / "ckpt"
    rc = main(["quantize", "--in-memory", "--model", str(src), "--recipe", "signround4-g128", "--out", str(out), "--threads", "1",
               "--no-eval", "--calib", "4", "--seq-len", "16"])
    assert rc == 0, capsys.readouterr().err
    rep = json.loads((out / "report.json").read_text())
    assert {v.keys() >= {"signround_loss", "rtn_loss"} for v in rep["step_info"].values()} == {True}
    assert "signround_loss" in capsys.readouterr().out
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, seen["logits"])


@pytest.mark.parametrize("options,message", [
    ({"iters": -1}, "iters must be an int >= 0"), ({"lr": 0.0}, "lr must be"), ({"batch_size": 0}, "batch_size"),
    ({"zero_point": "floor"}, "zero_point must be one of"), ({"init": "hqq"}, "init must be one of"),
    ({"holdout": 1}, "holdout must be an int, 0 .none. or >= 2"),
    ({"offsets": False, "minmax": False}, "offsets=False with minmax=False learns nothing"), ({"minmax": "yes"}, "minmax must be true or false"),
    ({"itres": 3}, "itres")])
def test_bad_options_are_refused_by_name_before_calibration(options, message):
    calls = []

    def batches():
        calls.append(1)
        yield torch.randint(0, 128, (1, 8))

    with pytest.raises((ValueError, TypeError), match=message):
        bridge.quantize_params(_model("llama"), _recipe(U4, qt.Step("signround", **options)), calibration=batches())
    assert calls == []


def test_a_model_without_calibration_is_refused():
    with pytest.raises(ValueError, match="signround"):
        bridge.quantize_params(_model("llama"), _recipe(U4, qt.Step("signround", iters=2)))

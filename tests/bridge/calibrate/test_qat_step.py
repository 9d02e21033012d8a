"""The ``qat`` step (Block-AP) through the bridge: it lowers the block output error below its start for every format
family on tiny models of several architectures, with no iterations it is exactly its start (RTN, GPTQ), the kept
state is never worse than the start on the judging batches, what trains is what is packed (the quantized model's
blocks compute what the trained fake quantizer computed), and bad options are refused by name before any work."""

from __future__ import annotations

import dataclasses
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

U2 = qt.QuantSpec(format="uint2", granularity=qt.PerGroup(32), symmetric=False)
FAMILIES = {"uint2-asym": U2, "int4-sym": qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)),
            "uint3-float-zp": qt.QuantSpec(format="uint3", granularity=qt.PerGroup(32), symmetric=False,
                                           zero_point_domain="float", scale_dtype="float16"),
            "nf4": qt.QuantSpec(format="nf4", granularity=qt.PerGroup(32)),
            "fp4": qt.QuantSpec(format="fp4_e2m1", granularity=qt.PerGroup(32)),
            "mxfp4": qt.QuantSpec(format="mxfp4"), "nvfp4": qt.QuantSpec(format="nvfp4")}
FIRST = {"llama": "model.layers.0", "gpt2": "transformer.h.0", "qwen3_moe": "model.layers.0"}
#: every family on Llama (make test: one integer, one codebook, one two-level; the rest `long`), Conv1D, experts
CASES = [pytest.param("llama", f, marks=() if f in ("uint2-asym", "nf4", "nvfp4") else pytest.mark.long)
         for f in FAMILIES] + [("gpt2", "uint2-asym"), pytest.param("qwen3_moe", "int4-sym", marks=pytest.mark.long)]

pytestmark = pytest.mark.usefixtures("one_thread")


def _recipe(spec, *steps):
    return qt.Recipe(type_rules={"Linear": spec, "Conv1D": spec, "Experts": spec}, exclude=["lm_head*"], steps=steps)


def _block_error(model, ref, block, batches):
    """The summed squared error of ``block``'s output in ``model`` against ``ref``'s on ``batches``."""
    outs = {}

    def hook(key):
        return lambda m, a, out: outs.__setitem__(key, out[0] if isinstance(out, tuple) else out)

    err = 0.0
    for ids in batches:
        hs = [model.get_submodule(block).register_forward_hook(hook("q")),
              ref.get_submodule(block).register_forward_hook(hook("f"))]
        with torch.no_grad():
            model(ids), ref(ids)
        for h in hs:
            h.remove()
        err += float((outs["q"].double() - outs["f"].double()).square().sum())
    return err


@pytest.mark.parametrize("arch,family", CASES)
def test_qat_lowers_the_block_error_below_its_start(arch, family):
    model = _model(arch)
    calib = _batches(6, 1, model.config.vocab_size)
    recipe = _recipe(FAMILIES[family])
    # NVFP4's fp8 block scales move in steps of 1/8: its ranges learn slowly (at this size, a larger step rounds
    # them back and forth)
    range_lr = 1e-4 if family == "nvfp4" else 0.01
    result = bridge.quantize_params(model, dataclasses.replace(
        recipe, steps=(qt.Step("qat", iters=30, lr=0.05, range_lr=range_lr, batch_size=4, holdout=3),)),
        calibration=calib)
    trained = bridge.to_module(model, result, kernel="dequant")
    rtn = bridge.quantize(model, recipe, kernel="dequant")
    first = [p for p in result.plan.specs if p.startswith(FIRST[arch] + ".")]
    assert first and all(result.info[p]["kept"] == "trained" for p in first)
    assert all(result.info[p]["qat_loss"] < result.info[p]["start_loss"] for p in first)
    # measured independently through the rebuilt modules on the first block (its inputs: the embeddings)
    assert _block_error(trained, model, FIRST[arch], calib) < 0.95 * _block_error(rtn, model, FIRST[arch], calib)


@pytest.mark.parametrize("init,start", [("minmax", ()), ("gptq", (qt.Step("gptq"),)),
                                        ("gptaq", (qt.Step("gptq", gptaq=True),))])
def test_no_iterations_is_exactly_the_start(init, start):
    model = _model("llama")
    calib = _batches(4, 2)
    got = bridge.quantize_params(model, _recipe(U2, qt.Step("qat", iters=0, init=init)), calibration=calib)
    want = bridge.quantize_params(model, _recipe(U2, *start), calibration=calib if start else None)
    assert set(got.qtree) == set(want.qtree)
    for p, q in want.qtree.items():
        if isinstance(q, qt.QTensor):
            assert torch.equal(got.qtree[p].codes, q.codes), p
            assert all(torch.equal(a, b) for a, b in zip(got.qtree[p].qparams.tensors().values(),
                                                         q.qparams.tensors().values())), p


def test_a_step_that_diverges_keeps_the_start():
    """A step size far too large: the trained state is worse on the judging batches, so the start is kept (and
    best=False keeps the trained one as asked)."""
    model = _model("llama")
    calib = _batches(6, 3)
    wild = dict(iters=8, lr=20.0, range_lr=0.5, holdout=3)
    kept = bridge.quantize_params(model, _recipe(U2, qt.Step("qat", **wild)), calibration=calib)
    rtn = bridge.quantize_params(model, _recipe(U2))
    assert all(v["kept"] == "start" and v["qat_loss"] == v["start_loss"] for v in kept.info.values())
    assert all(torch.equal(kept.qtree[p].codes, q.codes) for p, q in rtn.qtree.items() if isinstance(q, qt.QTensor))
    last = bridge.quantize_params(model, _recipe(U2, qt.Step("qat", **wild, best=False)), calibration=calib)
    assert all(v["kept"] == "trained" and v["qat_loss"] > v["start_loss"] for v in last.info.values())


def test_ranges_alone_train_without_moving_a_weight():
    """weights=False: the ranges learn, the weights stay the float ones (the result is their round trip with the
    learned parameters)."""
    model = _model("llama")
    calib = _batches(6, 4)
    r = bridge.quantize_params(model, _recipe(U2, qt.Step("qat", iters=20, weights=False, range_lr=0.01, holdout=3)),
                               calibration=calib)
    params = dict(model.named_parameters())
    trained = [p for p, v in r.info.items() if v["kept"] == "trained"]
    assert trained
    for p in trained:
        q = r.qtree[p]
        assert torch.equal(q.codes, qt.quantize(params[p].detach(), q.qparams).codes), p


@pytest.mark.parametrize("options,match", [({"lr": 0}, "qat: lr must be a number > 0"),
                                           ({"init": "hqq"}, "init must be one of"),
                                           ({"holdout": 1}, "holdout must be"),
                                           ({"zero_point": "floor"}, "zero_point must be one of"),
                                           ({"iterations": 3}, "unknown option")])
def test_bad_options_are_refused_by_name_before_any_work(options, match):
    model = _model("llama")

    def calib():
        raise AssertionError("calibration data was read before the options were checked")
        yield  # pragma: no cover

    with pytest.raises(ValueError, match=match):
        bridge.quantize_params(model, _recipe(U2, qt.Step("qat", **options)), calibration=calib())


def test_the_preset_from_the_command_line_saves_and_reloads_with_identical_logits(tmp_path, monkeypatch, capsys):
    """``qtransform quantize --recipe qat2-g64 --calib N``: the report holds each tensor's losses, and the
    checkpoint loads in transformers with the logits the command's quantized model computed."""
    from transformers import AutoModelForCausalLM

    src = tmp_path / "llama"
    _model("llama").save_pretrained(src)
    tiny_lm.tokenizer().save_pretrained(src)
    seen = {}
    ids = _batches(1, 7)[0]
    on_command_model(monkeypatch, lambda qmodel: seen.update(logits=qmodel(ids).logits.detach()))
    out = tmp_path / "ckpt"
    rc = main(["quantize", "--in-memory", "--model", str(src), "--recipe", "qat2-g64", "--out", str(out),
               "--threads", "1", "--no-eval", "--calib", "4", "--seq-len", "16"])
    assert rc == 0, capsys.readouterr().err
    rep = json.loads((out / "report.json").read_text())
    assert {v.keys() >= {"qat_loss", "start_loss", "kept"} for v in rep["step_info"].values()} == {True}
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, seen["logits"])


def test_the_activation_quantizers_are_in_the_loop():
    """W4A4 (int4 dynamic per-token inputs): with ``activations`` (the default) the block trains and is judged
    under the inputs' fake quantization, so the same start measures a larger error than without it."""
    model = _model("llama")
    calib = _batches(4, 5)
    recipe = qt.get_preset("quarot-w4a4").recipe

    def info(**kw):
        steps = (qt.Step("rotate"), qt.Step("qat", iters=2, holdout=0, **kw))
        return bridge.quantize_params(model, dataclasses.replace(recipe, steps=steps), calibration=calib).info

    with_acts, without = info(), info(activations=False)
    first = [p for p in with_acts if p.startswith("model.layers.0.")]
    assert first and all(with_acts[p]["start_loss"] > 1.5 * without[p]["start_loss"] for p in first)

"""Low-rank corrections through the bridge: the QLinear forward, the error they take back after rtn, hqq
and gptq on tiny models, save -> bridge.load / from_pretrained with identical logits, exports refused by
path, the command line's --lowrank and its report, streamed runs refused."""

import json

import pytest
import torch

import bridge
import qtransform as qt
import tiny_lm
from bridge.app.cli import main
from bridge.modules import QLinear
from bridge.modules.lowrank import lowrank_bytes, lowrank_of, lowrank_ranks
from bridge_util import tiny_causal_lm

U2 = qt.QuantSpec(format="uint2", granularity=qt.PerGroup(32), symmetric=False)
U2F = qt.QuantSpec(format="uint2", granularity=qt.PerGroup(32), symmetric=False, zero_point_domain="float")
G = torch.Generator().manual_seed(1)
CALIB = [torch.randint(0, 128, (4, 32), generator=G) for _ in range(3)]
IDS = torch.randint(0, 128, (2, 24), generator=G)


pytestmark = pytest.mark.usefixtures("one_thread")


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _model(arch, seed=0):
    torch.manual_seed(seed)
    return tiny_causal_lm(arch).eval()


@pytest.mark.parametrize("transposed", [False, True])
def test_qlinear_runs_the_correction_after_its_kernel(transposed):
    w = torch.randn(16, 32, generator=G)  # logical (out, in)
    stored = w.T.contiguous() if transposed else w
    q = qt.quantize(stored, qt.choose_qparams(stored, qt.QuantSpec(format="int4", granularity=qt.PerGroup(16))))
    m = QLinear(q, torch.randn(16 if not transposed else 16, generator=G), transposed=transposed, kernel="dequant")
    a, b = torch.randn(3, 32, generator=G), torch.randn(16, 3, generator=G)
    m.set_lowrank(qt.LowRank(a=a, b=b))
    x = torch.randn(5, 32, generator=G)
    dq = qt.dequantize(q)
    want = x @ (dq.T if not transposed else dq) + x @ (b @ a).T + m.bias  # hand-built: Q x + B A x + bias
    torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-5)
    assert "lowrank=3" in repr(m) and sorted(n for n, _ in m.named_buffers() if "lowrank" in n) == [
        "lowrank_a", "lowrank_b"]
    with pytest.raises(ValueError, match="do not fit"):
        m.set_lowrank(qt.LowRank(a=torch.ones(2, 31), b=torch.ones(16, 2)))
    m.set_lowrank(None)
    torch.testing.assert_close(m(x), x @ (dq.T if not transposed else dq) + m.bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch,steps,spec", [("llama", ["rtn"], U2), ("llama", ["hqq"], U2F),
                                             ("llama", ["gptq"], U2), ("gpt2", ["gptq"], U2)])
def test_corrections_lower_the_logits_error(arch, steps, spec):
    m = _model(arch)
    ref = _logits(m)
    errors = []
    for rank in (None, 4, 32):
        lr = [qt.Step("lowrank", rank=rank)] if rank else []
        q = bridge.quantize(m, qt.Recipe(default=spec, steps=[*map(qt.Step, steps), *lr], exclude=["lm_head*"]),
                            calibration=CALIB)
        errors.append(float((_logits(q) - ref).pow(2).mean()))
        if rank:
            assert set(lowrank_ranks(q).values()) == {rank}
            # 2 layers x 7 linears (GPT-2: 4 Conv1D each), r * (in + out) float32 elements each
            assert lowrank_bytes(q) == 4 * rank * sum(c.a.shape[1] + c.b.shape[0] for c in lowrank_of(q).values())
    assert errors[2] < errors[1] < errors[0], errors


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_full_rank_after_gptq_gives_back_the_float_weights(arch):
    """GPTQ leaves its weights on the grid; the step corrects towards the weights GPTQ was given."""
    m = _model(arch)
    q = bridge.quantize(m, qt.Recipe(default=U2, steps=[qt.Step("gptq"), qt.Step("lowrank", rank=512, weighted=False)],
                                     exclude=["lm_head*"]), calibration=CALIB[:1])
    float_weights = dict(m.named_parameters())
    corrected = lowrank_of(q)
    assert len(corrected) == 14 if arch == "llama" else len(corrected) == 8
    for path, c in corrected.items():
        module = q.get_submodule(path.rpartition(".")[0])
        logical = lambda w: w.T if module.transposed else w  # noqa: E731
        torch.testing.assert_close(logical(module.dequantized_weight()) + c.delta(), logical(float_weights[path]),
                                   rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_save_then_load_and_from_pretrained_give_identical_logits(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    m = _model(arch)
    recipe = qt.Recipe(default=U2, steps=[qt.Step("gptq"), qt.Step("lowrank", rank=8)])
    q = bridge.quantize(m, recipe, calibration=CALIB)
    want = _logits(q)
    bridge.save(q, tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())["quantization_config"]
    assert cfg["version"] == 5 and set(cfg["lowrank"].values()) == {8} and len(cfg["lowrank"]) == len(lowrank_of(q))
    assert torch.equal(_logits(bridge.load(tmp_path / "ck", like=_model(arch, seed=5))), want)
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "ck").eval()), want)
    # transformers' own save_pretrained of the bridge's model, and model.dequantize() (the corrections folded in)
    q.save_pretrained(tmp_path / "hf")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(_logits(back), want)
    torch.testing.assert_close(_logits(back.dequantize()), want, rtol=1e-4, atol=1e-4)
    # the pipeline's result saved as a tree carries its corrections too
    result = bridge.quantize_params(m, recipe, calibration=CALIB)
    bridge.save(result, tmp_path / "tree")
    assert torch.equal(_logits(bridge.load(tmp_path / "tree", like=_model(arch, seed=5))), want)
    # a checkpoint whose corrections are missing is refused, naming them
    from safetensors.torch import load_file, save_file
    stored = load_file(str(tmp_path / "tree" / "model.safetensors"))
    name = next(n for n in stored if n.endswith("lowrank_b"))
    stored.pop(name)
    save_file(stored, str(tmp_path / "tree" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(bridge.CheckpointError, match=name.replace(".", r"\.")):
        bridge.load(tmp_path / "tree", like=_model(arch), verify=False)


@pytest.fixture(scope="module")
def corrected_checkpoint(tmp_path_factory):
    q = bridge.quantize(_model("llama"), qt.Recipe(default=qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32),
                                                                        symmetric=False),
                                                   steps=[qt.Step("lowrank", rank=4, weighted=False)]))
    path = tmp_path_factory.mktemp("lowrank") / "ck"
    bridge.save(q, path)
    return path


@pytest.mark.parametrize("target", ["quark", "compressed-tensors", "gguf", "onnx"])
def test_exports_refuse_corrections_by_path(target, corrected_checkpoint, tmp_path):
    from bridge.interop import export

    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj: a low-rank correction \(rank 4\)"):
        export(corrected_checkpoint, to=target, out=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_command_line_lowrank_flag_and_report(tmp_path, monkeypatch, capsys):
    src = tmp_path / "src"
    _model("llama").save_pretrained(src)
    tiny_lm.tokenizer().save_pretrained(src)
    out = tmp_path / "ck"
    rc = main(["quantize", "--model", str(src), "--recipe", "gptq4-g64", "--lowrank", "8", "--out", str(out),
               "--threads", "1", "--no-eval", "--calib", "4", "--seq-len", "16"])
    text = capsys.readouterr().out
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert [s["name"] for s in rep["steps"]] == ["gptq", "lowrank"]
    assert rep["steps"][1]["options"] == {"rank": 8, "weighted": True}
    assert set(rep["lowrank"].values()) == {8} and rep["lowrank_bytes"] > 0
    assert "low-rank corrections:" in text and "rank 8" in text
    assert torch.equal(_logits(bridge.load(out, like=_model("llama"))),
                       _logits(bridge.load(out, like=_model("llama", seed=3))))
    with pytest.raises(SystemExit) as e:
        main(["quantize", "--model", str(src), "--lowrank", "0", "--out", str(tmp_path / "x")])
    assert e.value.code == 2 and "argument --lowrank: must be at least 1" in capsys.readouterr().err


def test_streamed_runs_refuse_the_step(tmp_path):
    from bridge.stream.accept import plan_streamed

    with pytest.raises(ValueError, match=r"recipe\.steps\[1\] \(lowrank\): low-rank corrections are not written"):
        plan_streamed(_model("llama"), qt.Recipe(default=U2, steps=[qt.Step("rtn"), qt.Step("lowrank", weighted=False)]),
                      calibrated=False)

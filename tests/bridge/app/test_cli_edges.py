"""The ``qtransform`` command's edges: every bad input gets one line on stderr and a non-zero exit,
is found before the slow steps (loading the model, the perplexity of the original), and leaves
nothing behind. The command runs in-process (``main([...])``) except where a real pipe is needed.

Also the library's edges of the same path: ``bridge.quantize`` with a recipe that selects nothing,
and the storage the quantized copy shares with the original.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import bridge
import qtransform as qt
import tiny_lm
from bridge.app import models
from bridge.app.cli import main
from bridge_util import tiny_causal_lm

# Third-party warnings only, by category and module (ours, from bridge.* and qtransform.*, stay visible):
# TorchScript's deprecation, raised when transformers is first imported (`-W default -rw` shows no other).
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama (32 wide) with the offline tokenizer, as a transformers directory."""
    d = tmp_path_factory.mktemp("edges") / "tiny"
    model = tiny_lm.model(seed=3)
    model.save_pretrained(d)
    tiny_lm.tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def checkpoint(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("edges-ckpt") / "ckpt"
    assert main(["quantize", "--model", str(model_dir), "--recipe", "int4-g32", "--out", str(out), "--no-eval"]) == 0
    return out


@pytest.fixture
def no_loading(monkeypatch):
    """Fails the test if the command gets as far as loading the weights."""
    def refuse(*a, **k):
        raise AssertionError("the command loaded the model before finding the error")
    monkeypatch.setattr(models, "load_with_tokenizer", refuse)


def cli(capsys, *args):
    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(result, *needles):
    rc, out, err = result
    assert rc not in (0, None), (out, err)
    ours = [line for line in err.splitlines() if line.startswith("qtransform")]
    assert len(ours) == 1 and ": error: " in ours[0], err
    assert "Traceback" not in err
    for n in needles:
        assert n in ours[0], ours[0]
    return ours[0]


def nothing_in(directory, *, but=()):
    left = sorted(p.name for p in directory.iterdir() if p.name not in but)
    assert not left, left


# ------------------------------------------------------------------ found before loading
def test_a_group_that_does_not_divide_is_refused_before_loading(model_dir, tmp_path, capsys, no_loading):
    recipe = tmp_path / "g128.json"  # no padding asked for: int4 g128 on 64-wide layers is an error
    recipe.write_text(json.dumps({"type_rules": {"Linear": {"format": "int4",
                                                            "granularity": {"type": "PerGroup", "size": 128}}}}))
    line = one_line_error(cli(capsys, "quantize", "--model", model_dir, "--recipe", recipe, "--out", tmp_path / "o"),
                          "model.layers.0.self_attn.q_proj.weight", "type_rules[Linear]",
                          "group size 128 does not divide axis -1 of size 32", "pad=True")
    assert "recipe" in line
    nothing_in(tmp_path, but={"g128.json"})


def test_the_library_refuses_it_before_any_step_runs():
    ran = []
    qt.register_algorithm("edges_probe", lambda params, plan, *, context: ran.append(1) or qt.Fit({}, {}),
                          replace=True)
    lin = torch.nn.Sequential(torch.nn.Linear(64, 8))
    spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(128))
    with pytest.raises(ValueError, match=r"0\.weight: recipe default .*group size 128 does not divide axis -1 "
                                         r"of size 64"):
        bridge.quantize(lin, qt.Recipe(default=spec, steps=["edges_probe"]))
    assert not ran


@pytest.mark.parametrize("where", ["below-a-file", "is-a-file", "is-a-file-overwrite", "unwritable"])
def test_out_that_cannot_be_written(where, model_dir, tmp_path, capsys, no_loading):
    (tmp_path / "file.txt").write_text("keep")
    out, extra, needle = {
        "below-a-file": (tmp_path / "file.txt" / "ckpt", [], "is a file, not a directory"),
        "is-a-file": (tmp_path / "file.txt", [], "is a file, not a directory"),
        "is-a-file-overwrite": (tmp_path / "file.txt", ["--overwrite"], "is a file, not a directory"),
        "unwritable": ("/proc/qtransform-test/ckpt", [], "cannot write in /proc"),
    }[where]
    one_line_error(cli(capsys, "quantize", "--model", model_dir, "--out", out, *extra), "--out", needle)
    assert (tmp_path / "file.txt").read_text() == "keep"
    nothing_in(tmp_path, but={"file.txt"})


def test_out_that_exists_needs_overwrite(model_dir, tmp_path, capsys, no_loading):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "keep.txt").write_text("x")
    one_line_error(cli(capsys, "quantize", "--model", model_dir, "--out", tmp_path / "ckpt"), "exists and is not empty")
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("command", ["quantize", "eval"])
@pytest.mark.parametrize("where", ["missing-dir", "is-a-dir", "below-a-file"])
def test_json_that_cannot_be_written(command, where, model_dir, tmp_path, capsys, no_loading):
    (tmp_path / "file.txt").write_text("keep")
    (tmp_path / "adir").mkdir()
    target, needle = {"missing-dir": (tmp_path / "no" / "such" / "r.json", "does not exist"),
                      "is-a-dir": (tmp_path / "adir", "is a directory"),
                      "below-a-file": (tmp_path / "file.txt" / "r.json", "is a file, not a directory")}[where]
    args = ["--out", tmp_path / "o"] if command == "quantize" else []
    one_line_error(cli(capsys, command, "--model", model_dir, "--json", target, *args), "--json", needle)
    nothing_in(tmp_path, but={"file.txt", "adir"})
    nothing_in(tmp_path / "adir")


BAD_NUMBERS = [("--seq-len", "0", "at least 2"), ("--seq-len", "1", "at least 2"), ("--seq-len", "x", "integer"),
               ("--eval-sequences", "-1", "at least 1"), ("--eval-sequences", "0", "at least 1"),
               ("--threads", "0", "at least 1")]


@pytest.mark.parametrize("command, option, value, needle",
                         [("quantize", *b) for b in BAD_NUMBERS + [("--calib", "-1", "at least 0"),
                                                                  ("--calib-batch", "0", "at least 1")]]
                         + [("eval", *b) for b in BAD_NUMBERS + [("--max-new-tokens", "0", "at least 1")]])
def test_numbers_out_of_range(command, option, value, needle, model_dir, tmp_path, capsys, no_loading):
    extra = ["--out", tmp_path / "o"] if command == "quantize" else ["--json", tmp_path / "e.json"]
    rc, out, err = cli(capsys, command, "--model", model_dir, option, value, *extra)
    assert rc == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and option in lines[0] and needle in lines[0], err
    nothing_in(tmp_path)


def test_seq_len_beyond_the_model_positions(tmp_path, capsys, no_loading):
    d = tmp_path / "gpt2"
    torch.manual_seed(0)
    tiny_causal_lm("gpt2").save_pretrained(d)  # 64 learned positions
    tiny_lm.tokenizer().save_pretrained(d)
    one_line_error(cli(capsys, "quantize", "--model", d, "--seq-len", "128", "--out", tmp_path / "o"),
                   "--seq-len 128 exceeds the model's 64 positions")
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ damaged inputs
def test_eval_of_a_truncated_checkpoint(checkpoint, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    f = broken / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    line = one_line_error(cli(capsys, "eval", "--model", broken, "--seq-len", "16", "--eval-sequences", "1",
                              "--json", tmp_path / "e.json"), f"cannot load model {broken}")
    assert "safetensors" in line.lower() or "incomplete" in line.lower()
    assert not (tmp_path / "e.json").exists()
    one_line_error(cli(capsys, "quantize", "--model", broken, "--out", tmp_path / "o", "--no-eval"),
                   f"cannot load model {broken}")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("content", [b"this is not a gguf file", b"", b"GGUF\x03\x00\x00\x00" + b"\xff" * 64])
def test_a_damaged_gguf_file(content, tmp_path, capsys):
    g = tmp_path / "model.gguf"
    g.write_bytes(content)
    for args in (["quantize", "--model", g, "--out", tmp_path / "o"], ["eval", "--model", g]):
        line = one_line_error(cli(capsys, *args))
        assert "not a valid JSON" not in line and "config" not in line
        want = "is not a GGUF file" if not content.startswith(b"GGUF") else f"cannot load model {g}: not a readable GGUF"
        assert want in line, line
    nothing_in(tmp_path, but={"model.gguf"})


def test_inspect_into_a_closed_pipe(checkpoint):
    """``qtransform inspect DIR | head -1``: the reader goes away; no traceback, no 'Broken pipe'."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    p = subprocess.Popen([sys.executable, "-m", "bridge.app.cli", "inspect", str(checkpoint)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdout.close()  # before the command writes anything
    with p.stderr:
        err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141
    assert "Traceback" not in err and "Broken pipe" not in err and "BrokenPipeError" not in err, err
    assert err.strip() == ""


def test_a_failure_while_writing_leaves_nothing(model_dir, tmp_path, capsys, monkeypatch):
    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bridge.io, "checkpoint_writer", lambda *a, **k: full_disk)  # checked, then the write fails
    one_line_error(cli(capsys, "quantize", "--in-memory", "--model", model_dir, "--out", tmp_path / "a" / "b" / "ckpt", "--no-eval",
                       "--json", tmp_path / "r.json"), "No space left on device")
    nothing_in(tmp_path)


# ------------------------------------------------------------------ the library
INT8 = {"format": "int8"}


@pytest.mark.parametrize("recipe, names", [
    ({"rules": {"*.no_such_layer.weight": INT8}}, ["'*.no_such_layer.weight'"]),
    ({"default": INT8, "exclude": ["*"]}, ["exclude ['*']", "exclude[*]"]),
    ({"type_rules": {"Conv2d": INT8}}, ["type_rules ['Conv2d']", "no module of type ['Conv2d']"]),
    ({"exclude": ["lm_head"]}, ["no rule"]),
])
def test_a_recipe_that_selects_nothing(recipe, names, model_dir, tmp_path, capsys):
    """The library and the command refuse it, naming the rules (not an unquantized copy)."""
    model = tiny_lm.model()
    with pytest.raises(ValueError, match="selects no tensor of this LlamaForCausalLM") as e:
        bridge.quantize(model, qt.recipe_from_dict(recipe).recipe)
    for n in names:
        assert n in str(e.value)
    f = tmp_path / "r.json"
    f.write_text(json.dumps(recipe))
    one_line_error(cli(capsys, "quantize", "--model", model_dir, "--recipe", f, "--out", tmp_path / "o"),
                   "selects no tensor", *names)
    assert not (tmp_path / "o").exists()


def test_the_quantized_model_shares_what_it_does_not_quantize():
    """Documented (docstring and README): no second copy of a large model; in-place changes show in both."""
    model = tiny_lm.model()
    qmodel = bridge.quantize(model, qt.get_preset("int8-channel").recipe)
    norm, q_norm = model.model.norm.weight, qmodel.model.norm.weight
    assert q_norm.data_ptr() == norm.data_ptr()
    with torch.no_grad():
        norm.mul_(2)
    assert torch.equal(q_norm, norm)

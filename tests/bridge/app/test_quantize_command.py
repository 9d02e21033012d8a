"""``qtransform quantize`` on the library's pipeline: the command and ``bridge.quantize`` make the same
model (the same saved bytes) for a recipe, the command resolves its input once, and a killed run
leaves only what the checkpoint store's cleanup recognises and removes."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import bridge
import qtransform as qt
import tiny_lm
from bridge.app import models
from bridge.app.cli import main

RECIPE = {"type_rules": {"Linear": {"format": "int4", "granularity": {"type": "PerGroup", "size": 32}}},
          "exclude": ["lm_head*"], "steps": [{"name": "rotate", "r3": True}, "hqq"],
          "input": {"format": "int8", "dynamic": True}}

KILL_WHILE_WRITING = """
import os, signal
import bridge.io

real = bridge.io.checkpoint_writer


def checkpoint_writer(*args, **kwargs):
    write = real(*args, **kwargs)

    def killed(directory):
        write(directory)
        os.kill(os.getpid(), signal.SIGKILL)

    return killed


bridge.io.checkpoint_writer = checkpoint_writer
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cmd") / "tiny"
    tiny_lm.model(seed=5).save_pretrained(d)
    tiny_lm.tokenizer().save_pretrained(d)
    return d


def test_the_command_and_bridge_quantize_save_the_same_bytes(model_dir, tmp_path):
    """Rotation (online R3/R4), HQQ and dynamic input quantizers: everything to_module takes from the result."""
    from transformers import AutoModelForCausalLM

    recipe_file = tmp_path / "r.json"
    recipe_file.write_text(json.dumps(RECIPE))
    assert main(["quantize", "--model", str(model_dir), "--recipe", str(recipe_file), "--out", str(tmp_path / "cmd"),
                 "--no-eval"]) == 0
    preset = qt.recipe_from_dict(RECIPE, name=str(recipe_file))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    qmodel = bridge.quantize(model, preset.recipe)
    assert qmodel.model.layers[0].mlp.down_proj._qt_online  # the result's online rotations are installed
    bridge.save(qmodel, tmp_path / "lib", recipe=preset.recipe, recipe_name=preset.name)
    cmd, lib = tmp_path / "cmd", tmp_path / "lib"
    assert (cmd / "model.safetensors").read_bytes() == (lib / "model.safetensors").read_bytes()
    config = [json.loads((d / "config.json").read_text())["quantization_config"] for d in (cmd, lib)]
    assert config[0] == config[1] and config[0]["online"] and config[0]["activations"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cmd", "lib", "r.json"]  # no temporary leftovers


def test_the_input_is_resolved_and_loaded_once(model_dir, tmp_path, monkeypatch):
    calls = {"resolve": 0, "imported_format": 0, "load_causal_lm": 0, "load_tokenizer": 0}
    for name, module in (("resolve", models), ("imported_format", models), ("load_causal_lm", models),
                         ("load_tokenizer", models)):
        real = getattr(module, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(module, name, counted)
    assert main(["quantize", "--in-memory", "--model", str(model_dir), "--recipe", "int4-g32", "--out", str(tmp_path / "o"),
                 "--no-eval"]) == 0
    # resolve: once by the command; the loaders get the source it returned (and pass it through)
    assert calls["imported_format"] == 1 and calls["load_causal_lm"] == 1 and calls["load_tokenizer"] == 1
    assert calls["resolve"] >= 1


def test_a_killed_run_leaves_what_the_store_cleans(model_dir, tmp_path):
    plugin = tmp_path / "kill.py"
    plugin.write_text(KILL_WHILE_WRITING)
    out = tmp_path / "ckpt"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1")
    res = subprocess.run([sys.executable, "-m", "bridge.app.cli", "quantize", "--in-memory", "--model", str(model_dir), "--recipe",
                          "int4-g32", "--out", str(out), "--no-eval", "--plugin", str(plugin)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == -signal.SIGKILL, res.stderr
    assert not out.exists()
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.tmp-")]
    assert len(left) == 1 and (left[0] / "model.safetensors").is_file()  # killed after the checkpoint's files
    assert main(["quantize", "--model", str(model_dir), "--recipe", "int4-g32", "--out", str(out), "--no-eval"]) == 0
    assert not left[0].exists()  # the next save to the same place removed the dead run's directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "kill.py"]
    assert (out / "report.json").is_file()

"""The ``qtransform`` command's ``--plugin``: the README's own step, registered by a plugin file, runs through
the command; a recipe that names it without the plugin, a missing and a broken plugin are one-line errors.

The run that loads the plugin is a real process (a plugin registers for good: not in the test's process);
the others go through ``main(argv)`` (:mod:`cli_util`)."""

import json

import pytest
import torch

import qtransform as qt
from cli_util import main_cli as cli
from cli_util import one_line_error, run_cli

# Third-party warnings only, by category and module (ours, from bridge.* and qtransform.*, stay visible):
# TorchScript's deprecation, raised when transformers is first imported (`-W default -rw` shows no other).
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")


def test_a_step_of_your_own_from_the_readme_runs_through_the_command(tiny_llama_dir, tmp_path):
    """The README's ``shrink`` plugin and recipe file, as written there: shrink, then HQQ."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from qtransform.algorithms import hqq
    from test_readme import readme_block

    plugin, recipe, out = tmp_path / "shrink.py", tmp_path / "shrink.toml", tmp_path / "ck"
    plugin.write_text(readme_block("# shrink.py"))
    recipe.write_text(readme_block("# shrink.toml", "toml"))
    res = run_cli("quantize", "--plugin", str(plugin), "--model", str(tiny_llama_dir), "--recipe", str(recipe),
                  "--out", str(out), "--no-eval")
    assert res.returncode == 0, res.stderr
    assert "shrink (factor=0.25) -> hqq (error_norm=4)" in res.stdout
    key = "model.layers.1.mlp.up_proj.weight"
    w = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).get_parameter(key).detach()
    shrunk = w - 0.25 * (w - w.mean(-1, keepdim=True))  # by hand, independently of the plugin
    want = qt.quantize(shrunk, hqq.optimize(shrunk, qt.get_preset("hqq4-g64").spec, error_norm=4))
    stored = load_file(out / "model.safetensors")
    assert torch.equal(stored[key], want.codes) and torch.equal(stored[key + "_zero_point"], want.qparams.zero_point)
    steps = json.loads((out / "config.json").read_text())["quantization_config"]["recipe"]["steps"]
    assert steps == [{"name": "shrink", "options": {"factor": 0.25}}, {"name": "hqq", "options": {"error_norm": 4}}]
    res = cli("inspect", str(out))  # reading the checkpoint needs no plugin: steps are provenance
    assert res.returncode == 0 and "steps: shrink (factor=0.25) -> hqq (error_norm=4)" in res.stdout
    one_line_error(cli("quantize", "--model", str(tiny_llama_dir), "--recipe", str(recipe), "--out", str(tmp_path / "x")),
                   "recipe.steps[0] (shrink): unknown algorithm 'shrink'")
    one_line_error(cli("recipes", "--plugin", str(tmp_path / "none.py")), "plugin file not found")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('oops')\n")
    one_line_error(cli("recipes", "--plugin", str(broken)), "RuntimeError: oops")
    assert not (tmp_path / "x").exists()


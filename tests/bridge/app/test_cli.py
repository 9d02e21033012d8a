"""The ``qtransform`` command: end to end on a tiny local model, and its one-line errors."""

import json
import os
import subprocess
import sys

import pytest
import torch

import qtransform as qt

# Third-party warnings only, by category and module (ours, from bridge.* and qtransform.*, stay visible):
# TorchScript's deprecation, raised when transformers is first imported (`-W default -rw` shows no other).
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")


def run(*args, cwd=None):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1")
    return subprocess.run([sys.executable, "-m", "bridge.app.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=600)


def _one_line_error(res, *needles):
    assert res.returncode != 0
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr and lines[0].startswith("qtransform: error:")
    for n in needles:
        assert n in lines[0], lines[0]


def test_quantize_report_plot_and_reload(tiny_llama_dir, tmp_path):
    out = tmp_path / "ckpt"
    rep_json = tmp_path / "r.json"
    res = run("quantize", "--model", str(tiny_llama_dir), "--recipe", "hqq4-g64", "--out", str(out),
              "--seq-len", "64", "--eval-sequences", "2", "--plot", "--json", str(rep_json))
    assert res.returncode == 0, res.stderr
    assert "worst layers" in res.stdout and "perplexity" in res.stdout and str(out) in res.stdout
    rep = json.loads(rep_json.read_text())
    assert json.loads((out / "report.json").read_text()) == rep
    assert len(rep["layers"]) == 2 * 7  # q k v o gate up down per layer (lm_head excluded, tied)
    assert all(l["spec"] == "uint4 g64 asym(float zp)" for l in rep["layers"])
    assert 4.4 < rep["bits_per_weight"] < 4.6  # 4 + (16 + 16) / 64
    assert rep["bits_per_weight_before"] == 32  # the tiny model is float32
    assert rep["ppl_before"] > 1 and rep["ppl_after"] > 1 and rep["size_after"] < rep["size_before"]
    assert (out / "report.png").stat().st_size > 10_000
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary leftovers

    from transformers import AutoModelForCausalLM

    import bridge
    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model.model.layers[0].mlp.up_proj, bridge.QLinear)

    res = run("inspect", str(out))
    assert res.returncode == 0, res.stderr
    assert "model.layers.1.mlp.down_proj.weight" in res.stdout and "type_rules[Linear]" in res.stdout
    assert "steps: hqq (error_norm=4.0, refine_scale=False); recipe: hqq4-g64" in res.stdout

    res = run("eval", "--model", str(out), "--baseline", str(tiny_llama_dir), "--seq-len", "64",
              "--eval-sequences", "2", "--max-new-tokens", "4", "--json", str(tmp_path / "e.json"))
    assert res.returncode == 0, res.stderr
    ev = json.loads((tmp_path / "e.json").read_text())
    assert [r["role"] for r in ev["results"]] == ["model", "baseline"]
    assert abs(ev["results"][0]["perplexity"] - rep["ppl_after"]) / rep["ppl_after"] < 0.05


def test_recipe_files_json_and_toml(tiny_llama_dir, tmp_path):
    recipe = {"algorithm": "rtn", "type_rules": {"Linear": "int4-g32"},
              "rules": {"*.down_proj.weight": {"format": "int8", "granularity": {"type": "PerChannel", "axis": 0}},
                        "*.no_such_layer.weight": None}}
    f = tmp_path / "r.json"
    f.write_text(json.dumps(recipe))
    res = run("quantize", "--model", str(tiny_llama_dir), "--recipe", str(f), "--out", str(tmp_path / "a"), "--no-eval")
    assert res.returncode == 0, res.stderr
    assert "warning: recipe pattern '*.no_such_layer.weight' matches no tensor" in res.stderr
    rep = json.loads((tmp_path / "a" / "report.json").read_text())
    specs = {l["path"].split(".")[-2]: l["spec"] for l in rep["layers"]}
    assert specs["down_proj"] == "int8 channel(axis=0) sym" and specs["q_proj"] == "int4 g32 sym"
    toml = tmp_path / "r.toml"
    toml.write_text('nbits = 3\ngroup_size = 32\n[options]\nerror_norm = 4\niters = 3\n'
                    '[dynamic_config."mlp.up_proj"]\nnbits = 2\ngroup_size = 16\n')
    res = run("quantize", "--model", str(tiny_llama_dir), "--recipe", str(toml), "--out", str(tmp_path / "b"), "--no-eval")
    assert res.returncode == 0, res.stderr
    assert "(hqq (error_norm=4, iters=3))" in res.stdout
    rep = json.loads((tmp_path / "b" / "report.json").read_text())
    hqq_step = {"name": "hqq", "options": {"error_norm": 4, "iters": 3}}
    assert {l["spec"] for l in rep["layers"]} == {"uint2 g16 asym(float zp)"} and rep["steps"] == [hqq_step]
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())["quantization_config"]
    assert cfg["recipe"]["steps"] == [hqq_step]
    # the stored parameters are the ones these options give, not the defaults'
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from qtransform.algorithms import hqq
    from qtransform.pipeline import hqq_spec
    key = "model.layers.0.mlp.up_proj.weight"
    w = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).get_parameter(key).detach()
    stored = load_file(tmp_path / "b" / "model.safetensors")[key + "_zero_point"]
    want = hqq.optimize(w, hqq_spec(2, 16), error_norm=4, iters=3).zero_point
    assert torch.equal(stored, want)
    assert not torch.equal(stored, hqq.optimize(w, hqq_spec(2, 16)).zero_point)


def test_bad_input_gives_one_line_and_writes_nothing(tiny_llama_dir, tmp_path):
    _one_line_error(run("quantize", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "x")),
                    "model not found")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"default": {"format": "int9"}}))
    _one_line_error(run("quantize", "--model", str(tiny_llama_dir), "--recipe", str(bad), "--out", str(tmp_path / "x")),
                    "unknown format 'int9'")
    bad.write_text("{not json")
    _one_line_error(run("quantize", "--recipe", str(bad)), "cannot read recipe file")
    _one_line_error(run("quantize", "--recipe", "int5-g7"), "unknown recipe 'int5-g7'")
    bad.write_text(json.dumps({"algorithm": "hqq", "default": "hqq4-g64", "options": {"iter": 3}}))
    _one_line_error(run("quantize", "--recipe", str(bad)), "unknown option(s) ['iter']")
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "keep.txt").write_text("x")
    _one_line_error(run("quantize", "--model", str(tiny_llama_dir), "--out", str(existing)), "exists and is not empty")
    assert (existing / "keep.txt").read_text() == "x"
    _one_line_error(run("quantize", "--model", str(tiny_llama_dir), "--out", str(tmp_path / "y"),
                        "--corpus", str(tmp_path / "no.txt")), "cannot read corpus")
    _one_line_error(run("eval", "--model", str(tmp_path / "nope")), "model not found")
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    _one_line_error(run("eval", "--model", str(tiny_llama_dir), "--corpus", str(short)), "corpus", "tokens")
    _one_line_error(run("inspect", str(tiny_llama_dir)), "quantization_config")
    res = run("quantize", "--bogus")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_formats_and_recipes_listings():
    res = run("formats")
    assert res.returncode == 0, res.stderr
    for name in qt.FORMATS:
        assert f"\n{name} " in res.stdout
    res = run("recipes")
    assert res.returncode == 0
    for name in ("int4-g128", "hqq4-g64", "hqq3-g64", "hqq2-g16", "int8-channel", "int4-g32-asym"):
        assert f"\n{name} " in res.stdout


def test_a_step_of_your_own_from_the_readme_runs_through_the_command(tiny_llama_dir, tmp_path):
    """The README's ``shrink`` plugin and recipe file, as written there: shrink, then HQQ."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from qtransform.algorithms import hqq
    from test_readme import readme_block

    plugin, recipe, out = tmp_path / "shrink.py", tmp_path / "shrink.toml", tmp_path / "ck"
    plugin.write_text(readme_block("# shrink.py"))
    recipe.write_text(readme_block("# shrink.toml", "toml"))
    res = run("quantize", "--plugin", str(plugin), "--model", str(tiny_llama_dir), "--recipe", str(recipe),
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
    res = run("inspect", str(out))  # reading the checkpoint needs no plugin: steps are provenance
    assert res.returncode == 0 and "steps: shrink (factor=0.25) -> hqq (error_norm=4)" in res.stdout
    _one_line_error(run("quantize", "--model", str(tiny_llama_dir), "--recipe", str(recipe), "--out", str(tmp_path / "x")),
                    "recipe.steps[0] (shrink): unknown algorithm 'shrink'")
    _one_line_error(run("recipes", "--plugin", str(tmp_path / "none.py")), "plugin file not found")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('oops')\n")
    _one_line_error(run("recipes", "--plugin", str(broken)), "RuntimeError: oops")
    assert not (tmp_path / "x").exists()


def test_rotation_presets_report_save_and_reload_their_online_rotations(tiny_llama_dir, tmp_path):
    """A rotation preset (SpinQuant, W4A4) from the command line with a calibrated fp8 key cache: the report lists the online
    rotations (a Hadamard of the MLP width before each down projection, one of the head width on queries
    and keys) and what the step did, `inspect` lists them from the checkpoint, and from_pretrained gives
    the logits the command's own `eval` measures for the checkpoint."""
    out = tmp_path / "ckpt"
    res = run("quantize", "--model", str(tiny_llama_dir), "--recipe", "spinquant-w4a4", "--out", str(out), "--calib", "4",
              "--seq-len", "32", "--eval-sequences", "2", "--kv-cache", "fp8_e4m3")
    assert res.returncode == 0, res.stderr
    rep = json.loads((out / "report.json").read_text())
    rows = sorted((r["module"], r["role"], r["size"]) for r in rep["online"])
    assert rows == sorted([(f"model.layers.{i}.mlp.down_proj", "input", 128) for i in range(2)]
                          + [(f"model.layers.{i}.self_attn", "key", 16) for i in range(2)])
    assert "online rotations: 2 input hadamard 128; 2 query/key hadamard 16" in res.stdout
    info = rep["step_info"]["model.layers.0.mlp.down_proj.weight"]
    assert info["rotation"] == "SpinQuant (r1, r2 learned, 100 iterations, weights float)"  # GPTQ follows
    before, _, kept = info["spinquant_loss"].partition(" -> ")  # (the loss falls: test_spinquant)
    assert 0 < float(kept.split()[0]) <= float(before)
    res = run("inspect", str(out))
    assert res.returncode == 0 and "online rotations: 2 input hadamard 128; 2 query/key hadamard 16" in res.stdout
    assert "metadata version 4" in res.stdout

    from transformers import AutoModelForCausalLM

    from bridge.app import corpus, evaluate, models
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    seqs = corpus.token_sequences(corpus.load_text("builtin", part="eval"), models.load_tokenizer(str(tiny_llama_dir)),
                                  seq_len=32, max_sequences=2)
    with torch.no_grad():
        assert evaluate.perplexity(model, seqs).perplexity == pytest.approx(rep["ppl_after"], rel=1e-5)

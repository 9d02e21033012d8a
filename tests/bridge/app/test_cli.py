"""The ``qtransform`` command: end to end on a tiny local model, and its one-line errors.

Most runs go through ``main(argv)`` in this process (:func:`cli_util.main_cli`: the same parser, checks and
dispatch, seconds of imports less each); a few run the real ``python -m bridge.app.cli`` process
(:func:`cli_util.run_cli`): its exit status, its whole stderr, nothing written. The ``--plugin`` path:
test_cli_plugin.py; the rotation presets: test_cli_rotation.py."""

import json

import pytest
import torch

import qtransform as qt
from cli_util import main_cli as cli
from cli_util import one_line_error, run_cli

# Third-party warnings only, by category and module (ours, from bridge.* and qtransform.*, stay visible):
# TorchScript's deprecation, raised when transformers is first imported (`-W default -rw` shows no other).
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")


def test_quantize_report_plot_and_reload(tiny_llama_dir, tmp_path):
    out = tmp_path / "ckpt"
    rep_json = tmp_path / "r.json"
    res = run_cli("quantize", "--model", str(tiny_llama_dir), "--recipe", "hqq4-g64", "--out", str(out),  # a real process
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

    res = cli("inspect", str(out))
    assert res.returncode == 0, res.stderr
    assert "model.layers.1.mlp.down_proj.weight" in res.stdout and "type_rules[Linear]" in res.stdout
    assert "steps: hqq (error_norm=4.0, refine_scale=False); recipe: hqq4-g64" in res.stdout

    res = cli("eval", "--model", str(out), "--baseline", str(tiny_llama_dir), "--seq-len", "64",
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
    res = cli("quantize", "--model", str(tiny_llama_dir), "--recipe", str(f), "--out", str(tmp_path / "a"), "--no-eval")
    assert res.returncode == 0, res.stderr
    assert "warning: recipe pattern '*.no_such_layer.weight' matches no tensor" in res.stderr
    rep = json.loads((tmp_path / "a" / "report.json").read_text())
    specs = {l["path"].split(".")[-2]: l["spec"] for l in rep["layers"]}
    assert specs["down_proj"] == "int8 channel(axis=0) sym" and specs["q_proj"] == "int4 g32 sym"
    toml = tmp_path / "r.toml"
    toml.write_text('nbits = 3\ngroup_size = 32\n[options]\nerror_norm = 4\niters = 3\n'
                    '[dynamic_config."mlp.up_proj"]\nnbits = 2\ngroup_size = 16\n')
    res = cli("quantize", "--model", str(tiny_llama_dir), "--recipe", str(toml), "--out", str(tmp_path / "b"), "--no-eval")
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
    # in real processes: exit status 1 (a user mistake), 2 (bad arguments), one line on the whole of stderr
    one_line_error(run_cli("quantize", "--model", tmp_path / "missing", "--out", tmp_path / "x"), "model not found")
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "keep.txt").write_text("x")
    res = run_cli("quantize", "--model", tiny_llama_dir, "--out", existing)
    one_line_error(res, "exists and is not empty")
    assert res.returncode == 1 and (existing / "keep.txt").read_text() == "x"
    res = run_cli("quantize", "--bogus")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    # the other checks through main(argv): the same exit status and line
    res = cli("quantize", "--bogus")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert cli("quantize", "--model", tmp_path / "missing", "--out", tmp_path / "x").returncode == 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"default": {"format": "int9"}}))
    one_line_error(cli("quantize", "--model", str(tiny_llama_dir), "--recipe", str(bad), "--out", str(tmp_path / "x")),
                   "unknown format 'int9'")
    bad.write_text("{not json")
    one_line_error(cli("quantize", "--recipe", str(bad)), "cannot read recipe file")
    one_line_error(cli("quantize", "--recipe", "int5-g7"), "unknown recipe 'int5-g7'")
    bad.write_text(json.dumps({"algorithm": "hqq", "default": "hqq4-g64", "options": {"iter": 3}}))
    one_line_error(cli("quantize", "--recipe", str(bad)), "unknown option(s) ['iter']")
    one_line_error(cli("quantize", "--model", str(tiny_llama_dir), "--out", str(existing)), "exists and is not empty")
    assert (existing / "keep.txt").read_text() == "x"
    one_line_error(cli("quantize", "--model", str(tiny_llama_dir), "--out", str(tmp_path / "y"),
                       "--corpus", str(tmp_path / "no.txt")), "cannot read corpus")
    one_line_error(cli("eval", "--model", str(tmp_path / "nope")), "model not found")
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    one_line_error(cli("eval", "--model", str(tiny_llama_dir), "--corpus", str(short)), "corpus", "tokens")
    one_line_error(cli("inspect", str(tiny_llama_dir)), "quantization_config")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_formats_and_recipes_listings():
    res = cli("formats")
    assert res.returncode == 0, res.stderr
    for name in qt.FORMATS:
        assert f"\n{name} " in res.stdout
    res = cli("recipes")
    assert res.returncode == 0
    for name in ("int4-g128", "hqq4-g64", "hqq3-g64", "hqq2-g16", "int8-channel", "int4-g32-asym"):
        assert f"\n{name} " in res.stdout

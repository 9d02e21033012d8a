"""``qtransform search`` end to end on a tiny model: the recipe file it writes is what ``quantize --recipe`` reads,
its rules' comments state the bytes the quantized tensors then hold, the report and the plot come with it; bad
arguments are one line naming the option, and nothing is written."""

import importlib.util
import json
import re
import tomllib

import pytest

import bridge
import qtransform as qt
import tiny_lm
from bridge.app import inputs
from bridge.app.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("search") / "tiny"
    tiny_lm.model(seed=5).save_pretrained(d)
    tiny_lm.tokenizer().save_pretrained(d)
    return d


ARGS = ["--calib", "2", "--calib-batch", "2", "--seq-len", "32"]


def test_search_writes_a_recipe_quantize_reads(model_dir, tmp_path):
    out, report = tmp_path / "r.toml", tmp_path / "r.json"
    argv = ["search", "--model", str(model_dir), "--budget", "4.25", "--pin", "*.down_proj.weight=int8", *ARGS,
            "--reference", "kl", "--reference-layers", "2", "--reference-sequences", "1", "--candidates",
            "int8,uint4-g64,uint2-g64", "--fisher-tokens", "32", "--out", str(out), "--json", str(report)]
    if importlib.util.find_spec("matplotlib") is not None:  # --plot needs it
        argv += ["--plot", str(tmp_path / "front.png")]
    assert main(argv) == 0
    rep = json.loads(report.read_text())
    text = out.read_text()
    recipe = inputs.load_recipe(str(out)).recipe  # what `quantize --recipe` reads
    assert recipe == qt.pipeline.recipe_from_dict(tomllib.loads(text)).recipe
    model = tiny_lm.model(seed=5)
    result = bridge.quantize_params(model, bridge.plan(model, recipe))
    stored = {p: v.nbytes() for p, v in result.qtree.items() if qt.is_qtensor(v)}
    assert sum(stored.values()) == rep["bytes"] <= rep["budget_bytes"]
    for path, n in stored.items():
        assert f"{n} bytes" in text.split(f'"{path}"')[0].rsplit("\n", 2)[-2]  # the comment above its rule
    assert all(rep["choice"][p] == "int8" for p in stored if p.endswith("down_proj.weight"))
    assert rep["reference"]["pairs"] == 6 and -1 <= rep["reference"]["spearman"] <= 1
    assert rep["estimate"] == "fisher" and "KL ~ sum_j F_j/2" in text
    assert rep["fisher_tokens"] == 32 and "(Fisher on 32 positions)" in text
    if "--plot" in argv:
        assert (tmp_path / "front.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(x.name for x in tmp_path.iterdir()) == sorted(["r.toml", "r.json"] + (["front.png"] if "--plot" in argv else []))


def test_compressed_tensors_target_keeps_what_vllm_loads(model_dir, tmp_path):
    out = tmp_path / "r.json"
    assert main(["search", "--model", str(model_dir), "--budget", "5", "--to", "compressed-tensors", *ARGS,
                 "--estimate", "hessian", "--out", str(out)]) == 0
    rules = json.loads(out.read_text())["rules"]
    for spec in rules.values():
        s = qt.QuantSpec.from_dict(spec)
        assert s.format in ("int4", "int8", "fp8_e4m3", "mxfp4", "nvfp4"), s


@pytest.mark.parametrize("extra, message", [
    (["--budget", "0.5"], "--budget: .* below the smallest possible size"),
    (["--budget", "-2"], "--budget must be a positive number"),
    (["--budget", "4", "--candidates", "int4-g128,int5x"], "--candidates: unknown candidate 'int5x'"),
    (["--budget", "4", "--pin", "nothing.*=int8"], r"--pin nothing\.\*=int8: the pattern matches no searched layer"),
    (["--budget", "4", "--pin", "*.q_proj.weight=bogus"], r"--pin \*\.q_proj\.weight=bogus: unknown candidate"),
    (["--budget", "4", "--to", "nowhere"], "--to 'nowhere': unknown target"),
    (["--budget", "4", "--to", "compressed-tensors", "--pin", "*=uint3-g64"], "--to compressed-tensors cannot hold"),
])
def test_bad_arguments_name_the_option_and_write_nothing(model_dir, tmp_path, capsys, extra, message):
    out = tmp_path / "r.toml"
    assert main(["search", "--model", str(model_dir), *ARGS, "--out", str(out), *extra]) == 1
    err = capsys.readouterr().err
    assert err.startswith("qtransform: error: ") and len(err.strip().splitlines()) == 1, err  # before loading
    assert re.search(message, err), err
    assert not any(tmp_path.iterdir())

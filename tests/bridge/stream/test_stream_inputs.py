"""Bad inputs to a streamed run are refused before anything is written, naming the file and the tensor; the
activation cache spills to disk beyond its budget without changing a byte; the calibrated block runs on the
device asked for."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import qtransform as qt
from bridge.checkpoint import CheckpointError
from bridge.stream import quantize_checkpoint
from bridge.stream.cache import ActivationCache

from stream_util import digests, quantize, save_tiny

RECIPE = qt.get_preset("gptq4-g64").recipe
CALIB = [torch.randint(0, 60, (2, 12), generator=torch.Generator().manual_seed(i)) for i in range(3)]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("inputs") / "src")


def _copy(source, tmp_path):
    d = tmp_path / "src"
    shutil.copytree(source, d)
    return d


def _index(d):
    return json.loads((d / "model.safetensors.index.json").read_text())


def _edit_index(d, fn):
    index = _index(d)
    fn(index["weight_map"])
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _truncate(d):
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)


BAD = {
    "a missing shard": (lambda d: sorted(d.glob("model-*.safetensors"))[0].unlink(),
                        r"model-00001-of-\d+\.safetensors: shard listed in the index is missing"),
    "an index naming a file that is not there": (
        lambda d: _edit_index(d, lambda m: m.update({"model.norm.weight": "model-00099-of-00099.safetensors"})),
        r"model-00099-of-00099\.safetensors: shard listed in the index is missing"),
    "an index mapping a tensor to the wrong shard": (
        lambda d: _edit_index(d, lambda m: m.update({"model.norm.weight": sorted(set(m.values()))[0]})),
        r"tensor 'model.norm.weight' is mapped to .*, but it is stored in"),
    "a shard disagreeing with config.json": (lambda d: _edit_config(d, intermediate_size=96),
                                             r"tensor 'model.layers.0.mlp.\w+_proj.weight' has shape \[\d+, \d+\], "
                                             r"the model of config.json has"),
    "a tensor config.json has and no shard holds": (lambda d: _edit_config(d, num_hidden_layers=3),
                                                    r"tensor 'model.layers.2.\S+' of shape .*, which no shard holds"),
    "a truncated shard": (_truncate, r"lies outside the file .*truncated"),
    "no config.json": (lambda d: (d / "config.json").unlink(), r"no config.json"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoints_are_refused_before_anything_is_written(case, source, tmp_path):
    d = _copy(source, tmp_path)
    corrupt, message = BAD[case]
    corrupt(d)
    with pytest.raises((CheckpointError, OSError, ValueError), match=message):
        quantize_checkpoint(d, tmp_path / "out", RECIPE, calibration=CALIB)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no work directory


def test_tensors_config_json_lacks_are_carried_as_stored_not_dropped(source, tmp_path):
    """Stored tensors the model of config.json does not load (as transformers leaves out a checkpoint's
    multi-token-prediction layers) are written unchanged and recorded, never dropped."""
    from safetensors import safe_open

    d = _copy(source, tmp_path)
    _edit_config(d, num_hidden_layers=1)
    done = quantize_checkpoint(d, tmp_path / "out", RECIPE, calibration=CALIB)
    wmap = _index(d)["weight_map"]
    layer1 = sorted(n for n in wmap if n.startswith("model.layers.1."))
    assert layer1 and sorted(done.written.carried) == layer1
    out = tmp_path / "out"
    assert json.loads((out / "config.json").read_text())["quantization_config"]["carried"] == layer1
    out_files = [out / "model.safetensors"] if (out / "model.safetensors").is_file() else sorted(out.glob("model-*"))
    out_map = {}
    for f in out_files:
        with safe_open(f, "pt") as h:
            out_map.update({n: f for n in h.keys()})
    for name in layer1:
        with safe_open(d / wmap[name], "pt") as a, safe_open(out_map[name], "pt") as b:
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name


def _whole_model_step(params, plan, *, context):
    return qt.Fit(params={p: t * 2 for p, t in params.items() if p.endswith("norm.weight")})


@pytest.fixture
def whole_model_demo():
    qt.register_algorithm("whole_model_demo", _whole_model_step)
    yield
    qt.ALGORITHMS.unregister("whole_model_demo")


@pytest.mark.parametrize("recipe,message", [
    (qt.get_preset("spinquant-w4a8").recipe, r"recipe.steps\[0\] \(spinquant\): learns on the whole model's loss"),
    (qt.Recipe(default=qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)), steps=[qt.Step("whole_model_demo")]),
     r"recipe.steps\[0\] \(whole_model_demo\): changes tensors across the whole model together")])
def test_steps_that_need_the_whole_model_are_refused_by_name(recipe, message, source, tmp_path, whole_model_demo):
    with pytest.raises(ValueError, match=message):
        quantize_checkpoint(source, tmp_path / "out", recipe, calibration=CALIB)
    assert not any(tmp_path.iterdir())


def test_the_command_refuses_what_it_cannot_stream(tmp_path, capsys):
    from bridge.app.cli import main

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    assert main(["quantize", "--model", str(gguf), "--out", str(tmp_path / "o"), "--stream", "--no-eval"]) == 1
    assert "--stream" in capsys.readouterr().err
    assert main(["quantize", "--out", str(tmp_path / "o"), "--max-memory", "1GB", "--no-eval"]) == 1
    err = capsys.readouterr().err
    assert "--max-memory" in err and "--stream" in err  # (--device works in memory too: test_device_memory.py)
    assert not (tmp_path / "o").exists()


def test_the_cache_spills_beyond_its_budget_and_reads_back_the_same(tmp_path):
    cache = ActivationCache(tmp_path / "spill", budget=1000)
    a, b = torch.randn(10, 20), torch.randn(5, 20)  # 800 and 400 bytes: the second goes to disk
    cache.put("a", a)
    cache.put("b", b)
    assert cache.spilled == 1 and cache.held == 800 and cache.total == 1200
    assert torch.equal(cache.get("a"), a) and torch.equal(cache.get("b"), b)
    cache.pop("b")
    assert not list((tmp_path / "spill").iterdir()) and "b" not in cache


def test_a_tight_memory_budget_spills_and_changes_no_byte(source, tmp_path):
    free = quantize_checkpoint(source, tmp_path / "free", RECIPE, calibration=CALIB)
    tight = quantize_checkpoint(source, tmp_path / "tight", RECIPE, calibration=CALIB, max_memory=1)
    assert digests(tmp_path / "free") == digests(tmp_path / "tight")
    assert free.info and tight.info.keys() == free.info.keys()


def test_the_command_with_max_memory(source, tmp_path):
    extra = ("--no-eval", "--calib", "4", "--calib-batch", "1")
    quantize(source, tmp_path / "a", "awq4-g64", *extra, "--stream", "--max-memory", "1KB")
    quantize(source, tmp_path / "b", "awq4-g64", *extra)
    assert digests(tmp_path / "a") == digests(tmp_path / "b")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (make test-gpu on a GPU machine)")


@cuda
@pytest.mark.cuda
def test_the_block_runs_on_cuda_and_the_checkpoint_is_the_same_format(source, tmp_path):
    on_gpu = quantize_checkpoint(source, tmp_path / "gpu", RECIPE, calibration=CALIB, device="cuda")
    on_cpu = quantize_checkpoint(source, tmp_path / "cpu", RECIPE, calibration=CALIB)
    assert on_gpu.info.keys() == on_cpu.info.keys()
    a, b = digests(tmp_path / "gpu"), digests(tmp_path / "cpu")
    assert a.keys() == b.keys() and a["config.json"] == b["config.json"]


def test_a_tensor_tied_three_ways_is_read_under_whichever_name_is_stored():
    """A group of three tied paths (an output head and two embeddings) stored under any one name: every path
    maps to that name (a map from each path to one other path misses it for one of the three)."""
    from torch import nn

    from bridge.stream.skeleton import model_tensors

    model = nn.ModuleDict({"a": nn.Embedding(8, 4), "b": nn.Embedding(8, 4), "head": nn.Linear(4, 8, bias=False)})
    model.b.weight = model.a.weight
    model.head.weight = model.a.weight
    for stored in ("a.weight", "b.weight", "head.weight"):
        _, tied = model_tensors(model, {stored})
        assert all(tied[p] == stored for p in ("a.weight", "b.weight", "head.weight") if p != stored), (stored, tied)

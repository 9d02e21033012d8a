"""Checkpoints: bit-exact round trips for every registry format and module type; bad files."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import qtransform as qt
import bridge
from bridge import CheckpointError
from bridge_util import format_specs, same_bits


def assert_same_model(a: nn.Module, b: nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert same_bits(sa[k], sb[k]), k


@pytest.mark.parametrize("spec", format_specs(), ids=str)
def test_every_format_round_trips_bit_exact(spec, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 48, bias=False))
    qmodel = bridge.quantize(model, spec, kernel="dequant")
    bridge.save(qmodel, tmp_path / "ck")
    back = bridge.load(tmp_path / "ck", like=model)
    assert_same_model(qmodel, back)
    assert back[0].spec == spec
    x = torch.randn(2, 64)
    back[0].kernel = back[1].kernel = "dequant"
    assert torch.equal(back(x), qmodel(x))


def test_every_module_type_round_trips(tmp_path, convnet, embednet):
    recipe = qt.Recipe(default=qt.QuantSpec(format="int4", granularity=qt.PerGroup(8), symmetric=False),
                       type_rules={"ConvTranspose2d": qt.QuantSpec(format="int8", granularity=qt.PerChannel(1)),
                                   "Conv2d": qt.QuantSpec(format="uint4", granularity=qt.PerChannel(0), symmetric=False)})
    for i, model in enumerate((convnet, embednet)):
        qmodel = bridge.quantize(model, recipe)
        kinds = {type(m).__name__ for m in qmodel.modules()}
        assert kinds & {"QConv2d", "QConvTranspose2d", "QEmbedding", "QEmbeddingBag", "QLinear"}
        bridge.save(qmodel, tmp_path / f"m{i}")
        back = bridge.load(tmp_path / f"m{i}", like=model)
        assert_same_model(qmodel, back)
    assert isinstance(back.bag, bridge.QEmbeddingBag) and isinstance(back.emb, bridge.QEmbedding)


def test_qtree_save_sharding_and_aliases(tmp_path):
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(64, 64), "b": nn.Linear(64, 64), "c": nn.Linear(64, 64)})
    model["c"].weight = model["a"].weight  # tied float weight: stored once
    spec = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
    qtree = qt.quantize_tree({"b.weight": bridge.extract(model)["b.weight"]}, spec)
    tree = {**bridge.extract(model), **qtree}
    bridge.save(tree, tmp_path / "ck", max_shard_size="5KB")
    files = sorted(os.listdir(tmp_path / "ck"))
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())["quantization_config"]
    assert cfg["aliases"] == {"c.weight": "a.weight"} and list(cfg["tensors"]) == ["b.weight"]
    back = bridge.load(tmp_path / "ck", like=model)
    assert same_bits(back["b"].weight, qtree["b.weight"].codes)
    assert back["c"].weight is back["a"].weight


def test_save_refuses_non_empty_dir_and_is_atomic(tmp_path, monkeypatch):
    model = nn.Sequential(nn.Linear(32, 16))
    qmodel = bridge.quantize(model, qt.QuantSpec(format="int8"))
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        bridge.save(qmodel, tmp_path / "ck")
    from bridge.checkpoint import store

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(store, "write_safetensors", boom)
    with pytest.raises(OSError, match="disk full"):
        bridge.save(qmodel, tmp_path / "ck", overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["ck"] and os.listdir(tmp_path / "ck") == ["keep.txt"]
    monkeypatch.undo()
    bridge.save(qmodel, tmp_path / "ck", overwrite=True)
    assert "keep.txt" not in os.listdir(tmp_path / "ck")
    with pytest.raises(ValueError, match="max_shard_size"):
        bridge.save(qmodel, tmp_path / "x", max_shard_size="lots")
    # arguments that would write a checkpoint load cannot read fail before anything is written
    with pytest.raises(ValueError, match="'rules' must be an object of path -> string.*rules= arguments"):
        bridge.save(qmodel, tmp_path / "x", rules={"0.weight": 3})
    with pytest.raises(ValueError, match="'recipe_name' must be a string"):
        bridge.save(qmodel, tmp_path / "x", recipe_name=5)
    with pytest.raises(TypeError, match="save: model_or_qtree must be a module or a tree"):
        bridge.save("abc", tmp_path / "x")
    assert not (tmp_path / "x").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="exists and is not a directory"):
        bridge.save(qmodel, tmp_path / "file", overwrite=True)


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32))
    qmodel = bridge.quantize(model, qt.QuantSpec(format="int4", granularity=qt.PerGroup(32), symmetric=False))
    d = tmp_path / "ck"
    bridge.save(qmodel, d)
    return model, d


def _edit_config(d, fn):
    p = d / "config.json"
    cfg = json.loads(p.read_text())
    fn(cfg["quantization_config"])
    p.write_text(json.dumps(cfg))


def _edit_tensors(d, fn):
    p = str(d / "model.safetensors")
    t = load_file(p)
    fn(t)
    save_file(t, p)


def test_a_float_tensor_stored_in_another_float_dtype_loads_in_the_models_dtype(saved):
    model, d = saved
    stored = {}
    _edit_tensors(d, lambda t: stored.update(w=t["1.weight"].to(torch.bfloat16)) or t.update({"1.weight": stored["w"]}))
    back = bridge.load(d, like=model, verify=False)  # the edit rewrote the file without our checksums
    assert back[1].weight.dtype == torch.float32
    assert torch.equal(back[1].weight, stored["w"].float())


def test_a_checkpoint_written_by_an_older_qtransform_loads(saved):
    model, d = saved
    assert json.loads((d / "config.json").read_text())["quantization_config"]["qtransform_version"] == qt.__version__
    now = bridge.load(d, like=model)
    _edit_config(d, lambda c: c.update(qtransform_version="0.2.0"))  # what 0.2.0 wrote; the layout is the same
    assert_same_model(bridge.load(d, like=model), now)


BAD_FILES = {
    "truncated shard": (lambda d: open(d / "model.safetensors", "r+b").truncate(os.path.getsize(d / "model.safetensors") - 10),
                        r"model\.safetensors: not a readable safetensors file"),
    "garbage shard": (lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 5),
                      r"model\.safetensors: not a readable safetensors file"),
    "missing tensor": (lambda d: _edit_tensors(d, lambda t: t.pop("0.weight_zero_point")),
                       r"missing tensor\(s\) \['0.weight_zero_point'\]"),
    "extra tensor": (lambda d: _edit_tensors(d, lambda t: t.update(stray=torch.zeros(2))),
                     r"model\.safetensors: unexpected tensor\(s\) \['stray'\]"),
    "wrong shape": (lambda d: _edit_tensors(d, lambda t: t.update({"0.weight_scale": torch.ones(32, 3)})),
                    r"model\.safetensors: tensor '0.weight_scale' has shape \[32, 3\] and dtype F32, expected \[32, 2\]"),
    "wrong dtype": (lambda d: _edit_tensors(d, lambda t: t.update({"0.weight": t["0.weight"].to(torch.int8)})),
                    r"tensor '0.weight' has shape \[32, 32\] and dtype I8, expected \[32, 32\] and U8"),
    "float as int": (lambda d: _edit_tensors(d, lambda t: t.update({"1.weight": t["1.weight"].to(torch.int32)})),
                     r"tensor '1.weight' has .* dtype I32, expected \[32\] and F32"),
    "malformed json": (lambda d: (d / "config.json").write_text("{not json"),
                       r"config\.json: malformed JSON"),
    "no version": (lambda d: _edit_config(d, lambda c: c.pop("version")),
                   r"config\.json: quantization_config has no integer 'version'"),
    "future version": (lambda d: _edit_config(d, lambda c: c.update(version=99)),
                       r"config\.json: quantization_config has version 99; this qtransform reads versions \[1, 2, 3, 4, 5\]"),
    "unknown format": (lambda d: _edit_config(d, lambda c: c["specs"][0].update(format="int42")),
                       r"config\.json: quantization_config specs\[0\] is not a valid QuantSpec: unknown format 'int42'"),
    "bad entry": (lambda d: _edit_config(d, lambda c: c["tensors"]["0.weight"].pop("shape")),
                  r"entry for tensor '0.weight' is malformed"),
    "negative spec index": (lambda d: _edit_config(d, lambda c: c["tensors"]["0.weight"].update(spec=-1)),
                            r"entry for tensor '0.weight' is malformed \(IndexError: spec index -1"),
    "shape as text": (lambda d: _edit_config(d, lambda c: c["tensors"]["0.weight"].update(shape="32")),
                      r"entry for tensor '0.weight' is malformed \(TypeError: shape '32' is not a list of ints"),
    "recipe_name not text": (lambda d: _edit_config(d, lambda c: c.update(recipe_name=5)),
                             r"'recipe_name' must be a string"),
    "entry not in model": (lambda d: _edit_config(d, lambda c: c["tensors"].update({"9.weight": c["tensors"]["0.weight"]})),
                           r"tensor '9.weight' is not a tensor of Sequential"),
    "wrong quant_method": (lambda d: _edit_config(d, lambda c: c.update(quant_method="gptq")),
                           r"has quant_method 'gptq'"),
    "no weights": (lambda d: os.remove(d / "model.safetensors"), r"no model\.safetensors"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_files_give_clear_errors(saved, case):
    model, d = saved
    corrupt, message = BAD_FILES[case]
    corrupt(d)
    with pytest.raises(CheckpointError, match=message):
        bridge.load(d, like=model)


def test_bad_index(tmp_path):
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    qmodel = bridge.quantize(model, qt.QuantSpec(format="int8"))
    bridge.save(qmodel, tmp_path / "ck", max_shard_size=5000)
    idx = tmp_path / "ck" / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    first = sorted(data["weight_map"])[0]
    data["weight_map"][first] = "model-00009-of-00009.safetensors"
    idx.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="model-00009-of-00009.safetensors: shard listed in the index is missing"):
        bridge.load(tmp_path / "ck", like=model)

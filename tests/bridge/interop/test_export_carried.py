"""Carried tensors through the exports (issue 51): the tensors of the input checkpoint that the model class does not
load (multi-token-prediction layers), kept as stored in the qtransform checkpoint, are written as stored under
their own names by the compressed-tensors and Quark exports, their modules named in the format's list of layers left
float (``ignore``, ``exclude``); our importers read such an export back (the carried tensors recognised, the logits
of the qtransform checkpoint); GGUF and ONNX, which cannot hold them, refuse by name. The expected tensors are read
from the input's own file with safetensors, not from the code under test."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import bridge
import qtransform as qt
import tiny_lm
from bridge import interop
from bridge.app import models
from bridge.app.imported import load_imported
from bridge.checkpoint import CheckpointError
from cli_util import main_cli
from moe.tiny_moe import tiny_moe_config
from test_inventory import deepseek_mtp, qwen_mtp

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")
IDS = torch.tensor([[1, 5, 9, 2, 17, 3, 30, 4, 11, 7]])
#: the export targets that keep carried tensors, and the key of their list of layers left float
KEEP = {"compressed-tensors": "ignore", "quark": "exclude"}
EXTRA = {"qwen3_next": qwen_mtp, "deepseek_v3": deepseek_mtp}


def _source(model_type: str, directory: Path) -> list:
    """A tiny ``model_type`` checkpoint with its MTP tensors added to the file (as test_inventory's ``with_mtp``;
    DeepSeek-V3's low ranks 32, not 16, so that int4 groups of 32 divide ``q_b_proj``/``kv_b_proj``'s inputs:
    compressed-tensors and Quark write whole groups only)."""
    config = tiny_moe_config(model_type)
    if model_type == "deepseek_v3":
        config.q_lora_rank = config.kv_lora_rank = 32
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory)
    tiny_lm.tokenizer().save_pretrained(directory)
    stored = load_file(directory / "model.safetensors")
    added = EXTRA[model_type](config.hidden_size, config.num_hidden_layers)
    save_file({**stored, **added}, directory / "model.safetensors", metadata={"format": "pt"})
    return sorted(added)


def _stored(directory: Path) -> dict:
    """Every tensor of a safetensors checkpoint directory, read by safetensors itself."""
    index = directory / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"}
    out = {}
    for f in sorted(files):
        out.update(load_file(directory / f))
    return out


@pytest.fixture(scope="module", params=sorted(EXTRA))
def made(request, tmp_path_factory):
    """``(model type, directory, the MTP tensors' names)``: ``src`` (with MTP tensors), ``out`` (``qtransform quantize
    --to compressed-tensors``, which writes ``out-compressed-tensors``) and ``quark`` (``qtransform export --to
    quark``); the checkpoint records them as carried."""
    d = tmp_path_factory.mktemp(request.param)
    names = _source(request.param, d / "src")
    res = main_cli("quantize", "--model", d / "src", "--recipe", "int4-g32", "--out", d / "out", "--no-eval",
                   "--to", "compressed-tensors")
    assert res.returncode == 0, res.stderr
    (d / "out-compressed-tensors").rename(d / "compressed-tensors")
    res = main_cli("export", d / "out", "--to", "quark", "--out", d / "quark")
    assert res.returncode == 0, res.stderr
    assert json.loads((d / "out" / "config.json").read_text())["quantization_config"]["carried"] == names
    return request.param, d, names


@pytest.mark.parametrize("to", sorted(KEEP))
def test_the_export_holds_the_carried_tensors_as_stored_and_lists_them_float(made, to):
    model_type, d, names = made
    want = load_file(d / "src" / "model.safetensors")
    got = _stored(d / to)
    for name in names:  # under their own names, in their own dtype, bit for bit
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    qc = json.loads((d / to / "config.json").read_text())["quantization_config"]
    listed = qc[KEEP[to]]
    assert {n.rpartition(".")[0] for n in names} <= set(listed), listed
    if model_type == "qwen3_next":
        assert "mtp.fc" in listed
    else:
        assert "model.layers.2.eh_proj" in listed


@pytest.mark.parametrize("to", sorted(KEEP))
def test_a_new_recipe_on_the_export_keeps_the_carried_tensors(made, to, tmp_path):
    """Re-quantizing an export (its values dequantized, a new recipe) writes its carried tensors as stored."""
    _, d, names = made
    want = load_file(d / "src" / "model.safetensors")
    res = main_cli("quantize", "--model", d / to, "--recipe", "int8-channel", "--out", tmp_path / "again", "--no-eval")
    assert res.returncode == 0, res.stderr
    got = _stored(tmp_path / "again")
    for name in names:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    assert json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]["carried"] == names


@pytest.mark.parametrize("to", sorted(KEEP))
def test_our_importer_reads_the_export_back_to_the_checkpoints_logits(made, to):
    _, d, names = made
    want = load_file(d / "src" / "model.safetensors")
    back = interop.IMPORTERS[to].read(d / to)
    assert back.meta.carried == tuple(names) and sorted(back.carried) == names
    assert not set(names) & set(back.tree)  # recognised as carried, not as tensors of the model
    assert all(back.carried[n].dtype == want[n].dtype and torch.equal(back.carried[n], want[n]) for n in names)
    source = interop.read_source(d / "out")
    assert sorted(source.carried) == names and not set(names) & set(source.tree)
    assert set(back.tree) == set(source.tree)  # the model's tensors as the checkpoint holds them, bit for bit
    for path, leaf in source.tree.items():
        got = back.tree[path]
        assert type(got) is type(leaf), path
        pairs = [(got.codes, leaf.codes), *zip(got.qparams.tensors().values(), leaf.qparams.tensors().values())] \
            if isinstance(leaf, qt.QTensor) else [(got, leaf)]
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in pairs), path
    float_model = models.load_causal_lm(d / "src")
    ours = bridge.load(d / "out", like=float_model)
    reloaded = AutoModelForCausalLM.from_pretrained(d / "out").eval()
    with torch.no_grad():
        expected = ours(IDS).logits
        torch.testing.assert_close(reloaded(IDS).logits, expected, rtol=1e-4, atol=1e-4)
        for m in (bridge.load(d / to, like=float_model), load_imported(d / to)):  # bridge.load, the command's way
            torch.testing.assert_close(m(IDS).logits, expected, rtol=1e-5, atol=1e-6)  # (GDN's sums: not bitwise)


@pytest.mark.parametrize("to", ["gguf", "onnx"])
def test_targets_that_cannot_hold_them_refuse_by_name(made, to, tmp_path):
    _, d, names = made
    res = main_cli("export", d / "out", "--to", to, "--out", tmp_path / to, "--allow-nearest")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "carried tensor(s)" in res.stderr and all(n in res.stderr for n in names), res.stderr
    assert not (tmp_path / to).exists()
    with pytest.raises(ValueError, match=r"carried tensor\(s\) " + ", ".join(names).replace(".", r"\.")):
        interop.export(d / "out", to=to, out=tmp_path / to, allow_nearest=True)
    assert not (tmp_path / to).exists()


@pytest.mark.parametrize("to", sorted(KEEP))
def test_a_carried_tensor_missing_from_the_export_is_refused_by_name(made, to, tmp_path):
    _, d, names = made
    name = names[0]
    edited = tmp_path / to
    edited.mkdir()
    for f in (d / to).iterdir():
        (edited / f.name).write_bytes(f.read_bytes())
    with safe_open(str(edited / "model.safetensors"), "pt") as f:  # our metadata kept (compressed-tensors' record)
        kept = f.metadata()
    tensors = load_file(edited / "model.safetensors")
    del tensors[name]
    save_file(tensors, edited / "model.safetensors", metadata=kept)  # its digests now wrong: verify=False below
    with pytest.raises(CheckpointError, match=rf"carried tensor\(s\) \['{name}'\] recorded with the export"):
        interop.IMPORTERS[to].read(edited, verify=False)


def test_a_checkpoint_whose_carried_tensor_is_gone_is_refused_by_name(made, tmp_path):
    _, d, names = made
    name = names[0]
    edited = tmp_path / "out"
    edited.mkdir()
    for f in (d / "out").iterdir():
        if f.is_file():
            (edited / f.name).write_bytes(f.read_bytes())
    tensors = _stored(edited)
    del tensors[name]
    (edited / "model.safetensors.index.json").unlink(missing_ok=True)
    for f in edited.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, edited / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"carried tensor\(s\) \['{name}'\] are recorded but not stored"):
        interop.read_source(edited, verify=False)


@pytest.mark.slow
def test_transformers_loads_the_compressed_tensors_export_with_its_carried_tensors(made):
    """The peer's loader (transformers with compressed-tensors) reads the export with its carried tensors in it: each
    weight of the model is our dequantized weight, bit for bit."""
    _, d, _ = made
    model = AutoModelForCausalLM.from_pretrained(d / "compressed-tensors").eval()
    model(IDS)  # compressed-tensors decompresses on the first forward
    state = model.state_dict()
    for path, leaf in interop.read_source(d / "out").tree.items():
        want = qt.dequantize(leaf) if isinstance(leaf, qt.QTensor) else leaf
        assert torch.equal(state[path], want), path


@pytest.mark.long  # amd-quark imported in a clean process: ~40 s (make test-long)
def test_transformers_with_quark_loads_the_quark_export_with_its_carried_tensors(tmp_path):
    """The peer's loader (transformers with amd-quark, in a clean process) reads a Quark export with carried tensors
    in it and their modules in ``exclude``: a dense model (transformers' Quark layers do not take fused experts), to
    the logits of ours (the dequant kernel) to float32 rounding."""
    from interop.quark.helpers import quark_logits

    src, out = tmp_path / "src", tmp_path / "out"
    tiny_lm.model().save_pretrained(src)
    tiny_lm.tokenizer().save_pretrained(src)
    g = torch.Generator().manual_seed(7)
    added = {"mtp.fc.weight": torch.randn(32, 64, generator=g).to(torch.bfloat16), "mtp.norm.weight": torch.rand(32)}
    save_file({**load_file(src / "model.safetensors"), **added}, src / "model.safetensors", metadata={"format": "pt"})
    res = main_cli("quantize", "--model", src, "--recipe", "int4-g32", "--out", out, "--no-eval", "--to", "quark")
    assert res.returncode == 0, res.stderr
    export = tmp_path / "out-quark"
    assert {"mtp.fc", "mtp.norm"} <= set(json.loads((export / "config.json").read_text())["quantization_config"]["exclude"])
    got = quark_logits({"llama": (export, "AutoModelForCausalLM", IDS)}, tmp_path)["llama"]
    assert "error" not in got, got["error"]
    with torch.no_grad():
        want = bridge.load(out, like=tiny_lm.model(), kernel="dequant")(IDS).logits
    scale = want.abs().max().item()
    assert got["quark_layers"] == 2 * 7 and (got["logits"] - want).abs().max().item() <= 1e-5 * scale

"""Other tools' checkpoints loaded as ours, never re-quantized: ``bridge.load`` (into a given model), the
command's model loading (from the checkpoint's own config), ``qtransform inspect`` and ``quantize --model``.

The expected values are our own checkpoint's: exporting it and loading the export must give back the very
codes and scales (compared bit for bit) and the same logits as the checkpoint loaded by ``bridge.load``."""

import json

import pytest
import torch
from bridge_util import same_bits
from cli_util import main_cli
from interop.compressed_tensors.helpers import batches, recipe, tiny

import bridge
import qtransform as qt
from bridge import interop
from bridge.app import models
from bridge.app.imported import load_imported
from bridge.interop.gguf import tensors as gguf_tensors


IDS = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
Q4_1 = gguf_tensors.IMPORT_SPECS["Q4_1"]
# (target, architecture, recipe name or spec): every family each target's exporter takes
CASES = ([("quark", a, "int4-g32-asym") for a in ("llama", "opt", "phi3")] + [("quark", "qwen2", "fp8-static-kv")]
         + [("compressed-tensors", a, "int4-g32") for a in ("mistral", "qwen2")]
         + [("compressed-tensors", "llama", "w8a8-int8-dynamic"), ("quark", "bert", "int8-linear")]
         + [("gguf", a, "q4_1") for a in ("llama", "qwen2")])
# BERT's decoder is tied to the word embeddings, which Quark leaves in float
BERT = qt.Recipe(type_rules={"Linear": qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))}, exclude=["cls.*"])


def _checkpoint(arch, name, directory):
    model = tiny(arch)
    if name in ("q4_1", "int8-linear"):
        q = bridge.quantize(model, Q4_1 if name == "q4_1" else BERT)
    else:
        r = recipe(name)
        q = bridge.quantize(model, r, calibration=batches() if r.input is not None and not r.input.dynamic else None)
    bridge.save(q, directory)
    return directory


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("imports")
    out = {}
    for to, arch, name in CASES:
        ck = _checkpoint(arch, name, root / f"{arch}-{name}-ck")
        out[(to, arch, name)] = (ck, interop.export(ck, to=to, out=root / f"{arch}-{name}-{to}"))
    return out


def _same_tree(got: torch.nn.Module, want: torch.nn.Module):
    g, w = bridge.extract(got), bridge.extract(want)
    assert set(g) == set(w)
    for path, leaf in w.items():
        other = g[path]
        if isinstance(leaf, qt.QTensor):
            assert isinstance(other, qt.QTensor) and other.spec == leaf.spec, path
            assert same_bits(other.codes, leaf.codes), path
            assert all(same_bits(other.qparams.tensors()[k], t) for k, t in leaf.qparams.tensors().items()), path
        else:
            assert same_bits(other, leaf), path


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_bridge_load_reads_the_export_as_our_checkpoint(case, exports):
    to, arch, _ = case
    ck, exported = exports[case]
    assert bridge.io.imported_format(exported) == to and bridge.io.imported_format(ck) is None
    want = bridge.load(ck, like=tiny(arch))
    got = bridge.load(exported, like=tiny(arch))
    _same_tree(got, want)
    assert torch.equal(got(IDS).logits, want(IDS).logits)


@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[7], CASES[-1]], ids=lambda c: "-".join(c))
def test_the_command_builds_the_model_from_the_checkpoints_own_config(case, exports):
    to, arch, _ = case
    ck, exported = exports[case]
    want = bridge.load(ck, like=tiny(arch))
    got = load_imported(exported)
    assert type(got) is type(want)
    _same_tree(got, want)
    assert torch.equal(got(IDS).logits, want(IDS).logits)
    # dequantized: the float model of the same values (what `quantize --model` starts from)
    flat = load_imported(exported, dequantize=True)
    assert not any(isinstance(m, bridge.QModule) for m in flat.modules())
    state = flat.state_dict()
    for path, leaf in bridge.extract(want).items():
        assert torch.equal(state[path], qt.dequantize(leaf) if isinstance(leaf, qt.QTensor) else leaf), path


def test_a_model_of_other_shapes_is_refused_by_tensor_name(exports):
    _, exported = exports[("quark", "llama", "int4-g32-asym")]
    other = tiny("mistral")  # same names, but ask it to be wider
    other.model.embed_tokens = torch.nn.Embedding(128, 64 + 8)
    with pytest.raises(bridge.CheckpointError, match="model.embed_tokens.weight"):
        bridge.load(exported, like=other)
    with pytest.raises(bridge.CheckpointError, match="not tensors of"):
        bridge.load(exported, like=tiny("opt"))


def test_load_imported_refuses_a_directory_no_importer_reads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="not a checkpoint of a format qtransform imports"):
        load_imported(tmp_path)


# ---------------------------------------------------------------------------------------------- the command
def test_inspect_describes_an_export_as_imported(exports):
    ck, exported = exports[("compressed-tensors", "llama", "w8a8-int8-dynamic")]
    res = main_cli("inspect", str(exported))
    assert res.returncode == 0, res.stderr
    first = res.stdout.splitlines()[0]
    assert first.startswith("compressed-tensors checkpoint") and "not re-quantized" in first
    meta = bridge.read_metadata(ck)
    for path, e in meta.entries.items():  # every quantized tensor, with its spec's format
        line = next(ln for ln in res.stdout.splitlines() if ln.startswith(path + " "))
        assert e.spec.format in line.split(), line
    assert "activation quantizers:" in res.stdout and "dynamic" in res.stdout


@pytest.mark.slow
def test_quantize_and_eval_from_a_quark_export(tiny_llama_dir, tmp_path):
    """``quantize --model QUARK_DIR``: the recipe starts from the imported values (no amd-quark involved);
    ``eval --model QUARK_DIR`` runs the imported model as it is stored."""
    res = main_cli("quantize", "--model", str(tiny_llama_dir), "--recipe", "int4-g32-asym", "--no-eval",
                   "--out", str(tmp_path / "ck"), "--to", "quark")
    assert res.returncode == 0, res.stderr
    quark_dir = tmp_path / "ck-quark"
    res = main_cli("quantize", "--model", str(quark_dir), "--recipe", "int8-channel", "--no-eval",
                   "--out", str(tmp_path / "again"))
    assert res.returncode == 0, res.stderr
    assert "quark checkpoint, dequantized" in res.stderr + res.stdout
    source = interop.read_source(tmp_path / "ck").tree
    again = interop.read_source(tmp_path / "again").tree
    path = "model.layers.0.mlp.down_proj.weight"
    spec = again[path].spec
    want = qt.quantize(qt.dequantize(source[path]), qt.choose_qparams(qt.dequantize(source[path]), spec))
    assert same_bits(again[path].codes, want.codes)  # int8 of the imported int4 values, computed here
    res = main_cli("eval", "--model", str(quark_dir), "--baseline", str(tmp_path / "ck"), "--eval-sequences", "1",
                   "--seq-len", "32", "--max-new-tokens", "4", "--json", str(tmp_path / "eval.json"))
    assert res.returncode == 0, res.stderr
    ppl = [r["perplexity"] for r in json.loads((tmp_path / "eval.json").read_text())["results"]]
    assert ppl[0] == ppl[1]  # the imported model is our checkpoint, value for value and kernel for kernel
    assert models.load_causal_lm(quark_dir).model.layers[0].mlp.down_proj.__class__ is bridge.QLinear


def test_read_imported_passes_verify_and_keeps_importers_without_it(tmp_path):
    from bridge.interop.base import IMPORTERS, Checkpoint, Importer, read_imported, register_importer

    calls = []

    class Old(Importer):  # an importer written before verify existed: read(path) alone
        name = "test-old-importer"

        def detect(self, directory):
            return False

        def read(self, directory):
            calls.append(directory)
            return Checkpoint(directory, None, {}, {})

    register_importer(Old(), replace=True)
    try:
        assert read_imported("test-old-importer", tmp_path, verify=False).directory == tmp_path and calls == [tmp_path]
        with pytest.raises(TypeError, match="verify"):
            read_imported("test-old-importer", tmp_path, verify=1)
        with pytest.raises(ValueError, match="fmt"):
            read_imported("no-such-format", tmp_path)
    finally:
        IMPORTERS.unregister("test-old-importer")


def test_verify_digests_names_the_file_and_tensor():
    from bridge.checkpoint import CheckpointError
    from bridge.interop.base import verify_digests

    assert verify_digests("f.gguf", {"a": "1", "b": "2"}, {"a": "1", "b": "2"}) == 2
    for recorded, actual, msg in [({"a": "1"}, {"a": "2"}, r"f\.gguf: tensor 'a' does not match"),
                                  ({"a": "1"}, {"a": "1", "b": "2"}, r"f\.gguf: tensor\(s\) \['b'\] have no recorded"),
                                  ({"a": "1", "b": "2"}, {"a": "1"}, r"f\.gguf: tensor\(s\) \['b'\] have a recorded")]:
        with pytest.raises(CheckpointError, match=msg):
            verify_digests("f.gguf", recorded, actual)

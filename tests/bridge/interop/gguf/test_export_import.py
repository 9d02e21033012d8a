"""GGUF: export read back by the ``gguf`` package and by transformers in a process that never imports
``bridge``; import of GGUF blocks (random bytes, gguf's own quantizers, SmolLM2's file) bit for bit."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import bridge
import qtransform as qt
from bridge import interop
from bridge.interop.gguf import tensors as gguf_tensors
from bridge.interop.gguf import GGUFExporter, GGUFImporter, nearest_type
from bridge_util import tiny_causal_lm
from cli_util import main_cli

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402


Q4_1 = gguf_tensors.IMPORT_SPECS["Q4_1"]
Q8_0 = gguf_tensors.IMPORT_SPECS["Q8_0"]
Q4_0 = gguf_tensors.IMPORT_SPECS["Q4_0"]
IDS = torch.tensor([[1, 5, 9, 17, 33, 65, 100, 127]])


def _env():
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1")


# --------------------------------------------------------------------------- which spec is which type
@pytest.mark.parametrize("spec, kind, note", [
    (Q4_1, "exact", "Q4_1"),
    (Q8_0, "exact", "Q8_0"),
    (Q8_0.replace(symmetric_range="full"), "exact", "Q8_0"),
    (Q4_0, "exact", "Q4_0"),
    (qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), scale_dtype="float16"), "exact", "Q4_0"),
    (qt.QuantSpec(format="mxfp4"), "exact", "MXFP4"),
    (qt.QuantSpec(format="bf16"), "exact", "BF16"),
    (qt.QuantSpec(format="fp16"), "exact", "F16"),
    (Q4_1.replace(zero_point_domain="float"), "nearest", "Q4_1"),  # -m/d in fp16 cannot be d*q + m
    (Q4_1.replace(scale_dtype="float32"), "nearest", "Q4_1"),
    (Q4_1.replace(granularity=qt.PerGroup(64)), "nearest", "Q4_1"),
    (qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)), "nearest", "Q8_0"),
    (qt.QuantSpec(format="fp8_e4m3"), "nearest", "Q8_0"),
    (qt.QuantSpec(format="int6", granularity=qt.PerGroup(16)), "nearest", "Q8_0"),
])
def test_support_table(spec, kind, note):
    s = GGUFExporter().support(spec)
    assert s.kind == kind and note in s.note
    assert interop.EXPORTERS["gguf"].support(spec) == s


def test_k_quant_variant():
    ex = interop.EXPORTERS["gguf-k"]
    assert ex.name == "gguf-k" and ex.k_quants
    assert "Q4_K" in ex.support(NEAREST).note and "Q6_K" in ex.support(qt.QuantSpec(format="int6")).note
    assert ex.support(Q4_1).kind == "exact"
    from bridge.interop.gguf.exporter import _tensor
    w = torch.randn(8, 512, generator=torch.Generator().manual_seed(5))
    q = qt.quantize(w, qt.choose_qparams(w, NEAREST))
    data, qtype, info = _tensor("m.weight", q, {}, allow_nearest=True, k_quants=True)
    back = gguf_dequantize(data, gguf.GGMLQuantizationType.Q4_K)
    rel = np.sqrt(((back - qt.dequantize(q).numpy()) ** 2).mean() / (qt.dequantize(q).numpy() ** 2).mean())
    assert qtype == "Q4_K" and info["kind"] == "nearest" and info["rel_rms_error"] == pytest.approx(rel, rel=1e-4)
    assert _tensor("m.weight", q, {}, allow_nearest=True)[1] == "Q4_1"
    with pytest.raises(ValueError, match="m.weight: .* has no exact GGUF type"):
        _tensor("m.weight", q, {}, allow_nearest=False)


def test_activation_quantizers():
    ex = GGUFExporter()
    assert ex.support(qt.QuantSpec(format="int8", dynamic=True), "input").kind == "nearest"
    assert ex.support(qt.QuantSpec(format="int8"), "input").kind == "no"
    assert ex.support(qt.QuantSpec(format="fp8_e4m3"), "key").kind == "no"


def test_nearest_type_by_bits_and_rows():
    u4 = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(128), symmetric=False)
    assert (nearest_type(u4, 512), nearest_type(u4, 576), nearest_type(u4, 48)) == ("Q4_1", "Q4_1", "F16")
    assert (nearest_type(u4, 512, k_quants=True), nearest_type(u4, 576, k_quants=True)) == ("Q4_K", "Q4_1")
    i6 = qt.QuantSpec(format="int6", granularity=qt.PerGroup(16))
    assert (nearest_type(i6, 512), nearest_type(i6, 512, k_quants=True)) == ("Q8_0", "Q6_K")


# --------------------------------------------------------------------------- block bytes, both ways
def _random_blocks(qtype: str, rows: int, blocks: int, seed: int) -> np.ndarray:
    """Random GGUF blocks with finite fp16 scales (every other bit pattern is a valid block)."""
    size, nbytes = gguf_tensors.BLOCKS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks, nbytes), dtype=np.uint8)
    fp16 = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [208], "MXFP4": []}[qtype]
    for at in fp16:
        raw[..., at:at + 2] = (rng.standard_normal((rows, blocks)) * 0.01).astype(np.float16)[..., None].view(np.uint8)
    if qtype == "MXFP4":
        raw[..., 0] = rng.integers(100, 140, size=(rows, blocks))
    return raw.reshape(rows, -1)


def _assert_same(ours: np.ndarray, ref: np.ndarray, qtype: str) -> None:
    """Bit for bit; MXFP4's fp4 code 8 is -0 (OCP), which ggml's table reads as +0: equal values there."""
    ref = np.asarray(ref, np.float32)
    if qtype == "MXFP4":
        assert np.array_equal(ours, ref)
        ours, ref = ours[ref != 0], ref[ref != 0]
    assert np.array_equal(ours.view(np.int32), ref.view(np.int32))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "MXFP4", "Q4_K", "Q6_K"])
def test_decode_gives_the_gguf_package_bits(qtype):
    size, _ = gguf_tensors.BLOCKS[qtype]
    raw = _random_blocks(qtype, 6, 2, seed=len(qtype))
    q = gguf_tensors.decode_blocks(raw, qtype, (6, 2 * size))
    assert q.spec == gguf_tensors.IMPORT_SPECS[qtype]
    ref = gguf_dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float32)
    _assert_same(qt.dequantize(q).numpy(), ref, qtype)
    if qtype in gguf_tensors.EXACT_TYPES:  # and back to the same bytes
        assert np.array_equal(gguf_tensors.encode_blocks(q, qtype), raw)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "MXFP4"])
def test_gguf_quantizers_output_decodes_exactly(qtype):
    w = np.random.default_rng(1).standard_normal((8, 128)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    q = gguf_tensors.decode_blocks(raw, qtype, (8, 128))
    ref = gguf_dequantize(raw, gguf.GGMLQuantizationType[qtype])
    _assert_same(qt.dequantize(q).numpy(), ref, qtype)
    assert np.array_equal(gguf_tensors.encode_blocks(q, qtype), raw)


@pytest.mark.parametrize("spec, qtype", [(Q4_1, "Q4_1"), (Q8_0, "Q8_0"), (Q4_0, "Q4_0"),
                                         (qt.QuantSpec(format="mxfp4"), "MXFP4")])
def test_our_quantization_encodes_to_the_same_values(spec, qtype):
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(2)) * 0.05 + 0.01
    q = qt.quantize(w, qt.choose_qparams(w, spec))
    raw = gguf_tensors.encode_blocks(q, qtype)
    ref = gguf_dequantize(raw, gguf.GGMLQuantizationType[qtype])
    _assert_same(qt.dequantize(q).numpy(), ref, qtype)


@pytest.mark.parametrize("qtype, rel", [("Q4_K", 0.12), ("Q6_K", 0.03)])
def test_k_quants_round_trip_within_their_step(qtype, rel):
    w = torch.randn(8, 512, generator=torch.Generator().manual_seed(3))
    w[0, :256] = 0.0  # an all-zero super-block
    raw = gguf_tensors.quantize_k(w, qtype)
    back = gguf_dequantize(raw, gguf.GGMLQuantizationType[qtype])
    err = np.sqrt(((back - w.numpy()) ** 2).mean()) / np.sqrt((w.numpy() ** 2).mean())
    assert err < rel and np.array_equal(back[0, :256], np.zeros(256, np.float32))
    q = gguf_tensors.decode_blocks(raw, qtype, (8, 512))  # and our import of them is exact
    assert np.array_equal(qt.dequantize(q).numpy(), back)


def test_encode_refuses_what_is_not_the_type():
    w = torch.randn(4, 64)
    q = qt.quantize(w, qt.choose_qparams(w, Q4_1.replace(zero_point_domain="float")))
    with pytest.raises(ValueError, match="w.fc: .* is not GGUF Q4_1"):
        gguf_tensors.encode_blocks(q, "Q4_1", path="w.fc")
    with pytest.raises(ValueError, match="bytes do not hold"):
        gguf_tensors.decode_blocks(np.zeros((2, 19), np.uint8), "Q4_1", (2, 32), path="blk.0")


# --------------------------------------------------------------------------- tiny models, end to end
READER = r"""
import json, sys
import numpy as np
import torch
from gguf import GGUFReader, GGMLQuantizationType
from gguf.quants import dequantize
from transformers import AutoModelForCausalLM
ids = torch.tensor(json.loads(sys.argv[2]))
report = {}
for directory, name, out in json.loads(sys.argv[1]):  # one process for every export (transformers loads once)
    reader = GGUFReader(f"{directory}/{name}")
    arrays, types = {}, {}
    for t in reader.tensors:
        types[t.name] = GGMLQuantizationType(int(t.tensor_type)).name
        arrays["gguf/" + t.name] = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    with torch.no_grad():
        arrays["logits"] = model(ids).logits.numpy()
    for k, v in model.state_dict().items():
        arrays["hf/" + k] = v.numpy()
    np.savez(out, **arrays)
    report[out] = {"types": types, "class": type(model).__name__}
print(json.dumps({"exports": report, "bridge": "bridge" in sys.modules}))
"""

NEAREST = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(64), symmetric=False)
CASES = [(arch, sid) for arch in ("llama", "mistral", "qwen2") for sid in ("q4_1", "q8_0", "q4_0")] + \
        [("llama", "nearest")]
SPECS = {"q4_1": Q4_1, "q8_0": Q8_0, "q4_0": Q4_0, "nearest": NEAREST}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Every case exported, then read back by one clean process: ``{case: (qtree, report, types, arrays)}``."""
    root = tmp_path_factory.mktemp("gguf")
    jobs, made = [], {}
    for arch, sid in CASES:
        d = root / f"{arch}-{sid}"
        torch.manual_seed(0)
        bridge.save(bridge.quantize(tiny_causal_lm(arch).eval(), SPECS[sid]), d / "ck")
        out = interop.export(d / "ck", to="gguf", out=d / "g", allow_nearest=sid == "nearest")
        report = json.loads((out / "gguf_export.json").read_text())
        jobs.append([str(out), report["file"], str(d / "back.npz")])
        made[(arch, sid)] = (interop.read_source(d / "ck").tree, report, str(d / "back.npz"))
    script = root / "reader.py"
    script.write_text(READER)
    res = subprocess.run([sys.executable, str(script), json.dumps(jobs), json.dumps(IDS.tolist())],
                         capture_output=True, text=True, env=_env(), timeout=900, cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["bridge"] is False  # the reader never imported bridge
    return {case: (qtree, report, info["exports"][npz]["types"], dict(np.load(npz)))
            for case, (qtree, report, npz) in made.items()}


def _dequantized_model(arch, qtree):
    torch.manual_seed(0)
    model = tiny_causal_lm(arch).eval()
    state = {p: (qt.dequantize(v) if isinstance(v, qt.QTensor) else v) for p, v in qtree.items()}
    model.load_state_dict(state, strict=False)
    return model


@pytest.mark.parametrize("arch, sid", CASES[:-1])
def test_exact_export_reads_back_bit_for_bit(arch, sid, exports):
    qtree, report, types, back = exports[(arch, sid)]
    qtype = gguf_tensors.exact_type(SPECS[sid])
    quantized = {r["path"]: (name, r) for name, r in report["tensors"].items()
                 if isinstance(qtree[r["path"]], qt.QTensor)}
    assert quantized and all(types[n] == qtype and r["kind"] == "exact" for n, r in quantized.values())
    assert all(types[n] == "F32" for n, r in report["tensors"].items() if r["path"] not in quantized)
    for path, leaf in qtree.items():  # transformers' weights (Q/K rows restored) are our dequantized ones
        ours = qt.dequantize(leaf) if isinstance(leaf, qt.QTensor) else leaf
        assert np.array_equal(back["hf/" + path].view(np.int32), ours.numpy().view(np.int32)), path
    v = next(p for p in quantized if "v_proj" in p)  # unpermuted rows: the file's own blocks
    assert np.array_equal(back["gguf/" + quantized[v][0]], qt.dequantize(qtree[v]).numpy())
    ref = _dequantized_model(arch, qtree)(IDS).logits.detach().numpy()
    np.testing.assert_allclose(back["logits"], ref, rtol=1e-5, atol=1e-5)


def test_nearest_export_measures_its_extra_error(exports):
    qtree, report, types, back = exports[("llama", "nearest")]
    checked = 0
    for name, r in report["tensors"].items():
        if r["kind"] != "nearest":
            continue
        assert types[name] == "Q4_1" and 0 < r["rel_rms_error"] < 0.2
        diff = np.abs(back["hf/" + r["path"]] - qt.dequantize(qtree[r["path"]]).numpy()).max()
        assert diff == pytest.approx(r["max_abs_error"], rel=1e-6)
        checked += 1
    assert checked == sum(isinstance(v, qt.QTensor) for v in qtree.values())


def test_nearest_needs_to_be_allowed(tmp_path):
    torch.manual_seed(0)
    bridge.save(bridge.quantize(tiny_causal_lm("llama").eval(), NEAREST), tmp_path / "ck")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight: uint4 g64"):
        interop.export(tmp_path / "ck", to="gguf", out=tmp_path / "g")
    assert not (tmp_path / "g").exists()


def test_tokenizer_metadata_reads_back(tmp_path):
    from bridge_util import tiny_llama_with_tokenizer

    model, tok = tiny_llama_with_tokenizer(layers=1)
    recipe = qt.Recipe(default=Q4_1, exclude=["lm_head*", "*embed_tokens*"])  # tied float embedding
    bridge.save(bridge.quantize(model, recipe), tmp_path / "ck", tokenizer=tok)
    out = interop.export(tmp_path / "ck", to="gguf", out=tmp_path / "g")
    report = json.loads((out / "gguf_export.json").read_text())
    assert report["tokenizer"] == "written" and "output.weight" not in report["tensors"]  # tied: no output
    text = "def f(x):\n    return x ** 2  # Hello, wörld!"
    res = subprocess.run([sys.executable, "-c", (
        "import sys, json; from transformers import AutoTokenizer; "
        "t = AutoTokenizer.from_pretrained(sys.argv[1], gguf_file=sys.argv[2]); "
        "print(json.dumps([t(sys.argv[3])['input_ids'], t.eos_token_id, 'bridge' in sys.modules]))"),
        str(out), report["file"], text], capture_output=True, text=True, env=_env(), timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    ids, eos, imported = json.loads(res.stdout.strip().splitlines()[-1])
    assert ids == tok(text)["input_ids"] and eos == tok.eos_token_id and imported is False
    # every tokenizer key is the one SmolLM2's own GGUF file has (pre-tokenizer "smollm", special
    # tokens typed CONTROL, add_bos_token False, special ids, merges, chat template)
    from bridge.app import models

    ref = gguf.GGUFReader(str(models.default_model_file())).fields
    got = gguf.GGUFReader(str(out / report["file"])).fields
    keys = sorted(k for k in ref if k.startswith("tokenizer."))
    assert keys == sorted(k for k in got if k.startswith("tokenizer."))
    assert ref["tokenizer.ggml.pre"].contents() == "smollm"
    for k in keys:
        assert got[k].contents() == ref[k].contents(), k


def test_cli_export_and_refusal(tmp_path):
    torch.manual_seed(0)
    bridge.save(bridge.quantize(tiny_causal_lm("llama").eval(), Q4_1), tmp_path / "ok")
    bridge.save(bridge.quantize(tiny_causal_lm("llama").eval(), Q4_1.replace(granularity=qt.PerGroup(64))),
                tmp_path / "g64")
    res = main_cli("export", str(tmp_path / "ok"), "--to", "gguf", "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gguf_export.json", "ok.gguf"]
    res = main_cli("export", str(tmp_path / "g64"), "--to", "gguf", "--out", str(tmp_path / "refused"))
    assert res.returncode != 0 and "model.layers.0.mlp.down_proj.weight: uint4 g64" in res.stderr
    assert "--allow-nearest" in res.stderr and not (tmp_path / "refused").exists()


def test_unsupported_architecture_is_refused(tmp_path):
    bridge.save(bridge.quantize(tiny_causal_lm("gpt2").eval(), Q4_1.replace(granularity=qt.PerGroup(32))),
                tmp_path / "ck")
    with pytest.raises(ValueError, match="architecture 'gpt2': GGUF export supports"):
        interop.export(tmp_path / "ck", to="gguf", out=tmp_path / "g")
    assert not (tmp_path / "g").exists()


# --------------------------------------------------------------------------- import
def test_import_of_an_export_round_trips(tmp_path):
    torch.manual_seed(0)
    bridge.save(bridge.quantize(tiny_causal_lm("llama").eval(), Q4_1), tmp_path / "ck")
    out = interop.export(tmp_path / "ck", to="gguf", out=tmp_path / "g")
    assert interop.detect_format(out) == "gguf" and not GGUFImporter().detect(tmp_path / "ck")
    src = GGUFImporter().read(out)
    ours = interop.read_source(tmp_path / "ck").tree
    assert set(src.tree) == set(ours)
    for path, leaf in ours.items():
        got = src.tree[path]
        assert type(got) is type(leaf), path
        if isinstance(leaf, qt.QTensor):
            assert got.spec == leaf.spec and torch.equal(got.codes, leaf.codes), path
            assert all(torch.equal(a, b) for a, b in zip(got.qparams.tensors().values(), leaf.qparams.tensors().values()))
        else:
            assert torch.equal(got, leaf), path


def test_import_refuses_types_without_an_exact_spec(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    cfg = dict(model_type="llama", hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
               intermediate_size=128, vocab_size=64, max_position_embeddings=64)
    from bridge.interop.gguf import arch as gguf_arch
    gguf_arch.write_arch(w, cfg, "m")
    data = gguf.quants.quantize(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32),
                                gguf.GGMLQuantizationType.Q5_0)
    w.add_tensor("token_embd.weight", data, raw_dtype=gguf.GGMLQuantizationType.Q5_0)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ValueError, match=r"token_embd\.weight \(model\.embed_tokens\.weight\) is GGUF Q5_0"):
        GGUFImporter().read(tmp_path / "m.gguf")
    src = GGUFImporter(dequantize=True).read(tmp_path / "m.gguf")
    emb = src.tree["model.embed_tokens.weight"]
    assert emb.dtype == torch.float32 and np.array_equal(emb.numpy(), gguf_dequantize(data, gguf.GGMLQuantizationType.Q5_0))


@pytest.mark.slow
def test_smollm2_gguf_imports_losslessly(tmp_path):
    """Every tensor of SmolLM2's own file: our codes and parameters re-encode to the file's bytes, and our
    dequantized values are gguf's (Q/K rows in transformers' order, undone as transformers undoes them)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from bridge.app import models
    from bridge.interop.gguf import arch as gguf_arch

    path = models.default_model_file()
    src = GGUFImporter().read(path)
    reader = gguf.GGUFReader(str(path))
    names = {g: p for p, g in gguf_arch.hf_names(list(src.tree), "llama", src.config["num_hidden_layers"]).items()}
    proc = LlamaTensorProcessor(config=src.config)
    kinds = {}
    for t in reader.tensors:
        kind = gguf.GGMLQuantizationType(int(t.tensor_type)).name
        kinds[kind] = kinds.get(kind, 0) + 1
        leaf = src.tree[names[t.name]]
        ref = proc.process(weights=gguf_dequantize(t.data, t.tensor_type), name=t.name).weights
        ours = qt.dequantize(leaf) if isinstance(leaf, qt.QTensor) else leaf.float()
        assert np.array_equal(ours.numpy().view(np.int32), np.asarray(ref, np.float32).view(np.int32)), t.name
        if isinstance(leaf, qt.QTensor) and kind in gguf_tensors.EXACT_TYPES:
            index = gguf_arch.qk_rows(names[t.name], src.config, leaf.shape[0])
            q = gguf_arch.reorder_rows(leaf, index)
            assert np.array_equal(gguf_tensors.encode_blocks(q, kind), np.asarray(t.data)), t.name
    assert kinds.get("Q4_1", 0) > 100  # the linear weights
    GGUFExporter().write(src, tmp_path)  # and written back: the same tensors, byte for byte
    name = json.loads((tmp_path / "gguf_export.json").read_text())["file"]
    again = {t.name: t for t in gguf.GGUFReader(str(tmp_path / name)).tensors}
    for t in reader.tensors:
        assert again[t.name].tensor_type == t.tensor_type and np.array_equal(np.asarray(again[t.name].data),
                                                                                np.asarray(t.data)), t.name

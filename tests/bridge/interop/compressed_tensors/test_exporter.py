"""``--to compressed-tensors``: tiny models of every architecture transformers' compressed-tensors path loads,
quantized by our presets, exported, then loaded in a fresh interpreter that never imports the bridge
(transformers' compressed-tensors quantizer, CPU): same logits as our quantized model, and the weights that
compressed-tensors' own compressors decompress are our dequantized weights, bit for bit where the format is
exact; the export and the command refuse what the format cannot hold, by tree path (the importer:
``test_importer.py``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bridge_util import same_bits, tiny_causal_lm
from cli_util import main_cli
from interop.compressed_tensors.helpers import FP8, batches as _batches, needs_calibration, recipe as _recipe, tiny as _tiny
from safetensors.torch import load_file

import bridge
import qtransform as qt
from bridge import interop
from bridge.interop.compressed_tensors.config import judge
from bridge.modules import actquant


TO = "compressed-tensors"
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def _quantize(model, name, tmp_path):
    """Our quantized model (reference kernels) and its checkpoint."""
    recipe = _recipe(name)
    calib = _batches() if needs_calibration(recipe) else None
    q = bridge.quantize(model, recipe, calibration=calib, kernel="dequant")
    ckpt = tmp_path / f"{name}-ckpt"
    bridge.save(q, ckpt)
    return q, ckpt


# A fresh interpreter: compressed-tensors' own compressor of each layer's scheme decompresses the stored
# weights (straight from the safetensors file), then transformers (with compressed-tensors) loads each export
# and computes the logits.
_CLEAN = r"""
import json, sys, torch, transformers
from safetensors.torch import load_file, save_file
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationScheme
jobs = json.loads(sys.argv[1])
ids = torch.tensor(jobs["ids"])
for job in jobs["dirs"]:
    qc = json.load(open(job["dir"] + "/config.json"))["quantization_config"]
    groups = [QuantizationScheme.model_validate(g) for g in qc["config_groups"].values()]
    stored, out = load_file(job["dir"] + "/model.safetensors"), {}
    for name in sorted(k.removesuffix(".weight_scale") for k in stored if k.endswith(".weight_scale")):
        scheme = next(g for g in groups if name in g.targets or g.targets == ["Linear"])
        local = {k[len(name) + 1:]: v for k, v in stored.items() if k.startswith(name + ".weight")}
        compressor = BaseCompressor.get_value_from_registry(scheme.format)
        out["w." + name] = compressor.decompress(local, scheme)["weight"].contiguous()
    cfg, errors = transformers.AutoConfig.from_pretrained(job["dir"]), {}
    cls = getattr(transformers, cfg.architectures[0])
    try:  # compressed: compressed-tensors modules, decompressed on the first forward
        model = cls.from_pretrained(job["dir"]).eval()
        assert type(model.config.quantization_config).__name__ == "CompressedTensorsConfig"
        assert any(hasattr(m, "quantization_scheme") for m in model.modules())
        with torch.no_grad():
            out["logits"] = model(ids).logits.contiguous()
    except Exception as e:  # decompressed by compressed-tensors' compressors while loading
        errors["compressed"] = f"{type(e).__name__}: {e}"
        model = cls.from_pretrained(job["dir"], quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
        with torch.no_grad():
            out["logits"] = model.eval()(ids).logits.contiguous()
    json.dump(errors, open(job["out"] + ".json", "w"))
    save_file(out, job["out"])
assert not [m for m in sys.modules if m.split(".")[0] in ("bridge", "qtransform")], "bridge was imported"
print("clean")
"""


def _load_clean(dirs, tmp_path):
    """``[({name: tensor}, {"compressed": error})]`` per export directory, from the clean interpreter."""
    jobs = {"ids": IDS.tolist(), "dirs": [{"dir": str(d), "out": str(tmp_path / f"clean-{i}.safetensors")}
                                          for i, d in enumerate(dirs)]}
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1")
    res = subprocess.run([sys.executable, "-c", _CLEAN, json.dumps(jobs)], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=600)
    assert res.returncode == 0 and "clean" in res.stdout, res.stderr[-3000:]
    return [(load_file(j["out"]), json.loads(Path(j["out"] + ".json").read_text())) for j in jobs["dirs"]]


# What transformers 5.24 with compressed-tensors 0.20 cannot run compressed (it then loads them with
# CompressedTensorsConfig(dequantize=True): compressed-tensors' compressors decompress while loading):
# asymmetric pack-quantized layers (compressed-tensors compresses the empty model with its zero points left
# unpacked, so the stored packed ones mismatch; llm-compressor issue 1618), and NVFP4 and MXFP4/6/8 in a float32
# model (decompressed to bfloat16 weights that float32 inputs cannot multiply).
KNOWN = {"int4-g32-asym": "size", "nvfp4": "dtype", "mxfp4": "dtype", "mxfp6": "dtype", "mxfp8": "dtype"}


def _as_transformers_runs_it(q, arch=None):
    """``q`` computing what transformers 5.24 with compressed-tensors 0.20 computes for its export:

    * the key/value cache left unquantized: transformers 5's attention takes ``cache`` where compressed-tensors
      looks for ``past_key_values``, so ``kv_cache_scheme`` is not applied under this pairing (vLLM reads
      ``k_scale``/``v_scale``; the round-trip test checks them bit for bit);
    * OPT's ``fc1``/``fc2`` (which receive the hidden states flattened to 2-D) with dynamic per-*tensor* inputs
      where the spec is per token: compressed-tensors' ``token`` strategy reduces every axis past the first two,
      none of a 2-D input's (vLLM quantizes each row).
    """
    for name, m in q.named_modules():
        for role in ("key", "value"):
            if getattr(m, f"{role}_spec", None) is not None:
                actquant.attach(m, role, None)
        spec = getattr(m, "input_spec", None)
        if arch == "opt" and name.endswith((".fc1", ".fc2")) and spec is not None and spec.dynamic \
                and isinstance(spec.granularity, qt.PerChannel):
            actquant.attach(m, "input", spec.replace(granularity=qt.PerTensor()))
    return q


def _check(name, q, ckpt, clean, arch=None):
    """The clean process's decompressed weights are ours bit for bit (NVFP4: rounded to bfloat16, as
    compressed-tensors decompresses it), its logits ours; it ran the export compressed unless :data:`KNOWN`
    says why it cannot."""
    got, errors = clean
    known = KNOWN.get(name)
    assert ("compressed" in errors) == (known is not None), (name, errors)
    if known is not None:
        assert known in errors["compressed"], errors["compressed"]
    tree = interop.read_source(ckpt).tree
    quantized = {p: v for p, v in tree.items() if isinstance(v, qt.QTensor)}
    assert {f"w.{p.removesuffix('.weight')}" for p in quantized} == {k for k in got if k.startswith("w.")}
    for path, qw in quantized.items():
        ours, theirs = qt.dequantize(qw), got[f"w.{path.removesuffix('.weight')}"]
        if theirs.dtype != ours.dtype:  # compressed-tensors decompresses NVFP4 and the MX formats to bfloat16
            assert theirs.dtype == torch.bfloat16, (path, theirs.dtype)
            if name == "nvfp4":  # fp4 x fp8 x fp32 tensor scale: more bits than bfloat16 has
                ours = ours.to(torch.bfloat16)
            else:  # fp4/fp6/fp8 times a power of two: exact in bfloat16
                theirs = theirs.to(ours.dtype)
        assert same_bits(theirs, ours), (name, path)
    with torch.no_grad():
        ref = _as_transformers_runs_it(q, arch)(IDS).logits
    err = (got["logits"] - ref).abs().max() / ref.abs().max()
    assert err < (1e-2 if name == "nvfp4" else 2e-5), (name, float(err))


CAUSAL = ("llama", "mistral", "qwen2", "phi3", "opt")
SCHEMES = ("int4-g32", "int4-g32-asym", "int8-channel", "fp8-static-kv", "fp8-dynamic", "nvfp4")
OTHERS = (("llama", "mxfp4"), ("llama", "mxfp6"), ("llama", "mxfp8"), ("llama", "w8a8-int8-dynamic"), ("bert", "fp8-w8a8"))


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """``{arch: [(scheme, our model, checkpoint, export, the clean process's result)]}``: every architecture's
    exports (CAUSAL x SCHEMES) and the others (OTHERS, under "others") loaded by one clean process (its
    imports, transformers with compressed-tensors, are most of its time)."""
    runs = {}
    for arch in CAUSAL:
        tmp, model = tmp_path_factory.mktemp(arch), _tiny(arch)
        runs[arch] = [(name, *_quantize(model, name, tmp)) for name in SCHEMES]
    tmp, models = tmp_path_factory.mktemp("others"), {arch: _tiny(arch) for arch in {a for a, _ in OTHERS}}
    runs["others"] = [(name, *_quantize(models[arch], name, tmp)) for arch, name in OTHERS]
    for group in runs.values():
        for i, (name, q, ckpt) in enumerate(group):
            group[i] = (name, q, ckpt, interop.export(ckpt, to=TO, out=ckpt.parent / f"{name}-ct"))
    flat = [run for group in runs.values() for run in group]
    got = iter(_load_clean([r[3] for r in flat], tmp_path_factory.mktemp("clean")))
    return {key: [(*run, next(got)) for run in group] for key, group in runs.items()}


@pytest.mark.parametrize("arch", CAUSAL)
def test_tiny_models_load_in_transformers_without_bridge(arch, loaded):
    """int4 group symmetric, uint4 group with integer zero points, int8 per channel, fp8 with static inputs and
    key/value cache, fp8 with dynamic per-token inputs, NVFP4: each architecture's exports in the clean process."""
    runs = loaded[arch]
    for name, q, ckpt, out, got in runs:
        _check(name, q, ckpt, got, arch)
    qc = {name: json.loads((out / "config.json").read_text())["quantization_config"] for name, _, _, out, _ in runs}
    assert qc["int4-g32"]["format"] == "pack-quantized" and qc["int4-g32"]["ignore"] == ["lm_head"]
    g = qc["int4-g32-asym"]["config_groups"]["group_0"]
    assert g["targets"] == ["Linear"] and g["weights"]["symmetric"] is False and g["weights"]["group_size"] == 32
    assert qc["fp8-static-kv"]["format"] == "float-quantized" and qc["fp8-static-kv"]["kv_cache_scheme"]["type"] == "float"
    assert qc["fp8-dynamic"]["config_groups"]["group_0"]["input_activations"]["strategy"] == "token"
    assert qc["nvfp4"]["format"] == "nvfp4-pack-quantized"
    st = load_file(runs[3][3] / "model.safetensors")
    attn = "model.decoder.layers.0.self_attn" if arch == "opt" else "model.layers.0.self_attn"
    assert st[f"{attn}.k_scale"].shape == (1,) and st[f"{attn}.v_scale"].shape == (1,)


def test_mx_formats_int8_activations_and_bert(loaded):
    """MXFP4/6/8 (E8M0 scales), int8 weights with dynamic per-token int8 inputs (int-quantized), and a BERT
    encoder (fp8 weights and static inputs; its self-attention has no cache compressed-tensors quantizes)."""
    runs = loaded["others"]
    for name, q, ckpt, out, got in runs:
        _check(name, q, ckpt, got)
    formats = [json.loads((r[3] / "config.json").read_text())["quantization_config"]["format"] for r in runs]
    assert formats == ["mxfp4-pack-quantized", "mxfp6-pack-quantized", "mxfp8-quantized", "int-quantized",
                       "float-quantized"]


@pytest.mark.parametrize("spec", [qt.QuantSpec(format="int3", granularity=qt.PerGroup(32)),
                                  qt.QuantSpec(format="uint5", granularity=qt.PerGroup(32), symmetric=False),
                                  qt.QuantSpec(format="uint2", granularity=qt.PerChannel(0), symmetric=False),
                                  qt.QuantSpec(format="int8", granularity=qt.PerBlock((32, 32)))],
                         ids=["int3-g32", "uint5-asym-g32", "uint2-asym-channel", "int8-block32"])
def test_other_widths_and_blocks_decompress_bit_for_bit(spec, tmp_path):
    """3/5/2-bit codes (compressed-tensors' dense int32 packing) and 2-D blocks: its own compressor decompresses
    our exported tensors to our dequantized weights, bit for bit."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    bridge.save(bridge.quantize(_tiny("llama"), qt.Recipe(type_rules={"Linear": spec}, exclude=["lm_head*"])),
                tmp_path / "ckpt")
    out = interop.export(tmp_path / "ckpt", to=TO, out=tmp_path / "ct")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme.model_validate(qc["config_groups"]["group_0"])
    stored, tree = load_file(out / "model.safetensors"), interop.read_source(tmp_path / "ckpt").tree
    for path in [p for p, v in tree.items() if isinstance(v, qt.QTensor)]:
        name = path.removesuffix(".weight")
        local = {k[len(name) + 1:]: v for k, v in stored.items() if k.startswith(name + ".weight")}
        theirs = BaseCompressor.get_value_from_registry(scheme.format).decompress(local, scheme)["weight"]
        assert same_bits(theirs, qt.dequantize(tree[path])), path


def test_support_table():
    S = qt.QuantSpec
    exact = [S(format="int4", granularity=qt.PerGroup(128)), S(format="uint4", granularity=qt.PerGroup(64),
             symmetric=False), S(format="int8", granularity=qt.PerChannel(0)), S(format="uint8"),
             S(format="fp8_e4m3", granularity=qt.PerBlock((128, 128))), S(format="nvfp4"), S(format="mxfp4"),
             S(format="mxfp6_e2m3"), S(format="mxfp8_e4m3"), S(format="int3", granularity=qt.PerGroup(32))]
    nearest = [qt.pipeline.hqq_spec(4, 64), S(format="fp8_e5m2"), S(format="mxfp6_e3m2")]
    no = [S(format="nf4"), S(format="mx6"), S(format="bfp16"), S(format="mxint8"), S(format="fp4_e2m1"),
          S(format="int4", granularity=qt.PerGroup(32, axis=0)), S(format="int8", granularity=qt.PerChannel(1))]
    assert [judge(s).kind for s in exact] == ["exact"] * len(exact)
    assert [judge(s).kind for s in nearest] == ["nearest"] * len(nearest)
    assert [judge(s).kind for s in no] == ["no"] * len(no)
    assert judge(FP8, "key").kind == "exact" and judge(S(format="int8", dynamic=True), "key").kind == "no"
    assert judge(S(format="int8", granularity=qt.PerChannel(0), dynamic=True, symmetric=False), "input").kind == "exact"
    assert "integer" in judge(qt.pipeline.hqq_spec(4, 64)).note


def test_refusals_name_the_tree_path_and_write_nothing(tmp_path):
    torch.manual_seed(0)
    gpt2 = tiny_causal_lm("gpt2").eval()
    bridge.save(bridge.quantize(gpt2, qt.get_preset("int4-g32").recipe), tmp_path / "gpt2")
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn\.c_attn\.weight: Conv1D weight"):
        interop.export(tmp_path / "gpt2", to=TO, out=tmp_path / "gpt2-ct")
    llama = tiny_causal_lm("llama").eval()
    bridge.save(bridge.quantize(llama, qt.QuantSpec(format="int4", granularity=qt.PerGroup(48), pad=True)),
                tmp_path / "g48")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight: group size 48 does not divide"):
        interop.export(tmp_path / "g48", to=TO, out=tmp_path / "g48-ct")
    bridge.save(bridge.quantize(llama, qt.get_preset("hqq4-g64").recipe), tmp_path / "hqq")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight: .*allow-nearest"):
        interop.export(tmp_path / "hqq", to=TO, out=tmp_path / "hqq-ct")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith("-ct") or p.name.startswith(".")]
    interop.export(tmp_path / "hqq", to=TO, out=tmp_path / "hqq-ct", allow_nearest=True)
    spec = interop.IMPORTERS[TO].read(tmp_path / "hqq-ct").meta.entries["model.layers.0.mlp.up_proj.weight"].spec
    assert spec.zero_point_domain == "int" and spec.scale_dtype == "float16"
    # compressed-tensors holds scales in the model's dtype: float32 scales of a bfloat16 model are rounded
    bf16 = _tiny("llama").to(torch.bfloat16)
    bf16.config.dtype = torch.bfloat16  # as from_pretrained(..., dtype=torch.bfloat16) leaves it
    bridge.save(bridge.quantize(bf16, qt.get_preset("int4-g32").recipe), tmp_path / "bf16")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight: torch\.float32 scales in a "
                                         r"torch\.bfloat16 model"):
        interop.export(tmp_path / "bf16", to=TO, out=tmp_path / "bf16-ct")
    assert not (tmp_path / "bf16-ct").exists()
    interop.export(tmp_path / "bf16", to=TO, out=tmp_path / "bf16-ct", allow_nearest=True)
    src, got = interop.read_source(tmp_path / "bf16"), interop.IMPORTERS[TO].read(tmp_path / "bf16-ct")
    for path, w in src.meta.entries.items():
        assert got.meta.entries[path].spec == w.spec.replace(scale_dtype="bfloat16")
        assert torch.equal(got.tree[path].qparams.scale, src.tree[path].qparams.scale.to(torch.bfloat16))
        assert torch.equal(got.tree[path].codes, src.tree[path].codes)


def test_cli_quantize_to_and_export(tmp_path):
    torch.manual_seed(0)
    from bridge.app.models import load_tokenizer

    tiny = tmp_path / "tiny"
    _tiny("llama").save_pretrained(tiny)
    load_tokenizer(None).save_pretrained(tiny)
    res = main_cli("quantize", "--model", str(tiny), "--recipe", "int4-g32", "--no-eval", "--out", str(tmp_path / "q"),
                   "--to", TO)
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / f"q-{TO}" / "config.json").read_text())["quantization_config"]["quant_method"] == TO
    assert (tmp_path / f"q-{TO}" / "tokenizer.json").is_file()
    res = main_cli("export", str(tmp_path / "q"), "--to", TO, "--out", str(tmp_path / "again"))
    assert res.returncode == 0 and "wrote" in res.stdout, res.stderr
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (tmp_path / f"q-{TO}" / "model.safetensors").read_bytes()
    res = main_cli("quantize", "--model", str(tiny), "--recipe", "mx6", "--no-eval", "--out", str(tmp_path / "m"),
                   "--to", TO)
    assert res.returncode != 0 and "model.layers.0.self_attn.q_proj.weight" in res.stderr and "mx6" in res.stderr
    assert not (tmp_path / "m").exists() and not (tmp_path / f"m-{TO}").exists()
    res = main_cli("quantize", "--model", str(tiny), "--recipe", "mx6", "--no-eval", "--out", str(tmp_path / "m"))
    assert res.returncode == 0, res.stderr
    res = main_cli("export", str(tmp_path / "m"), "--to", TO, "--out", str(tmp_path / "m-ct"))
    assert res.returncode != 0 and "model.layers.1.mlp.down_proj.weight: mx6" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "m-ct").exists()


@pytest.mark.slow
def test_smollm2_int4_and_fp8_exports_load_in_transformers_without_bridge(tmp_path):
    """The default model (float32): int4 g64 weights, and fp8 weights with dynamic per-token fp8 inputs; one
    clean process loads both (about two minutes on two cores)."""
    from bridge.app.models import load_causal_lm

    model, runs = load_causal_lm(), []
    for name in ("int4-g64", "fp8-dynamic"):
        q = bridge.quantize(model, _recipe(name), kernel="dequant")
        bridge.save(q, tmp_path / f"{name}-ckpt")
        runs.append((name, q, tmp_path / f"{name}-ckpt",
                     interop.export(tmp_path / f"{name}-ckpt", to=TO, out=tmp_path / f"{name}-ct")))
    for (name, q, ckpt, _), got in zip(runs, _load_clean([r[3] for r in runs], tmp_path)):
        _check(name, q, ckpt, got)

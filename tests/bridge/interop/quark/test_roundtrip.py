"""Quark export then import gives back the very tree; what Quark can hold (exact / nearest / no) and the
refusals, by tree path. (Quark's own exports, read bit for bit against its own dequantization: in
test_exporter.py, whose one clean process runs amd-quark.)"""

import json

import pytest
import torch
from bridge_util import tiny_causal_lm
from interop.quark.helpers import quantize_save, round_trip, same_bits, spec, stored

import bridge
import qtransform as qt
from bridge import interop
from bridge.interop.quark import QuarkImporter


# ---------------------------------------------------------------------------------------------- round trip
ROUND_TRIP = {
    "int4-g16": spec("int4", qt.PerGroup(16)),
    "int4-g16-restricted-bf16": spec("int4", qt.PerGroup(16), symmetric_range="restricted", scale_dtype="bfloat16"),
    "uint4-g16-asym": spec("uint4", qt.PerGroup(16), symmetric=False),
    "uint4-g16-sym": spec("uint4", qt.PerGroup(16)),
    "int4-channel": spec("int4", qt.PerChannel(0)),
    "uint4-channel-asym": spec("uint4", qt.PerChannel(0), symmetric=False),
    "uint4-tensor-asym": spec("uint4", qt.PerTensor(), symmetric=False),
    "uint4-g16-float-zp-fp16": spec("uint4", qt.PerGroup(16), symmetric=False, zero_point_domain="float",
                                     scale_dtype="float16"),
    "int8-tensor-asym": spec("int8", qt.PerTensor(), symmetric=False),
    "int8-g16": spec("int8", qt.PerGroup(16), rounding="half_away"),
    "uint8-channel-asym": spec("uint8", qt.PerChannel(0), symmetric=False),
    "fp8-e4m3-tensor": spec("fp8_e4m3", qt.PerTensor()),
    "fp8-e4m3-channel-fp16": spec("fp8_e4m3", qt.PerChannel(0), scale_dtype="float16"),
    "fp8-e5m2-channel": spec("fp8_e5m2", qt.PerChannel(0)),
    "mxfp4": qt.QuantSpec(format="mxfp4"),
    "mxfp4-even": qt.QuantSpec(format="mxfp4", scale_rule="even"),
    "mxfp6-e3m2": qt.QuantSpec(format="mxfp6_e3m2"),
    "mxfp6-e2m3": qt.QuantSpec(format="mxfp6_e2m3"),
    "mxfp8-e4m3": qt.QuantSpec(format="mxfp8_e4m3"),
    "mxfp8-e5m2": qt.QuantSpec(format="mxfp8_e5m2"),
}


@pytest.mark.parametrize("name", ROUND_TRIP)
def test_export_then_import_gives_the_same_tree(name, tmp_path):
    quantize_save("llama", ROUND_TRIP[name], tmp_path / "ckpt")
    source, back = round_trip(tmp_path / "ckpt", tmp_path / "quark")
    assert len(source.meta.entries) == 2 * 7


@pytest.mark.parametrize("preset,arch", [("fp8-w8a8-kv", "llama"), ("w8a8-int8", "qwen2")])
def test_round_trip_with_static_activations_and_kv_cache(preset, arch, tmp_path):
    quantize_save(arch, preset, tmp_path / "ckpt", calib=True)
    source, back = round_trip(tmp_path / "ckpt", tmp_path / "quark")
    roles = {s.role for s in source.meta.activations}
    assert roles == ({"input", "key", "value"} if preset == "fp8-w8a8-kv" else {"input"})
    qcfg = json.loads((tmp_path / "quark" / "config.json").read_text())["quantization_config"]
    if preset == "fp8-w8a8-kv":
        assert qcfg["export"]["kv_cache_group"] == ["*k_proj", "*v_proj"]
        assert "model.layers.0.self_attn.k_proj.output_scale" in stored(tmp_path / "quark")
        assert same_bits(back.tree["model.layers.1.self_attn.v_scale"], source.tree["model.layers.1.self_attn.v_scale"])


# ---------------------------------------------------------------------------------------------- what Quark holds
@pytest.mark.parametrize("spec,role,kind", [
    (spec("int4", qt.PerGroup(128)), "weight", "exact"),
    (spec("uint4", qt.PerGroup(64), symmetric=False, zero_point_domain="float", scale_dtype="float16"), "weight",
     "exact"),
    (spec("int8", qt.PerTensor()), "input", "exact"),
    (spec("int8", qt.PerTensor(), symmetric_range="restricted"), "input", "nearest"),
    (spec("fp8_e4m3", qt.PerTensor()), "key", "exact"),
    (spec("int8", qt.PerTensor()), "key", "no"),
    (spec("fp8_e4m3", qt.PerChannel(0), dynamic=True), "input", "no"),
    (spec("fp8_e4m3", qt.PerGroup(32)), "weight", "no"),
    (spec("int4", qt.PerChannel(1)), "weight", "no"),
    (spec("int4", qt.PerTensor(), symmetric=False), "weight", "no"),
    (spec("int3", qt.PerGroup(64)), "weight", "no"),
    (qt.QuantSpec(format="nvfp4"), "weight", "no"),
    (qt.QuantSpec(format="mxint8"), "weight", "no"),
    (qt.QuantSpec(format="mx6"), "weight", "no"),
    (spec("nf4", qt.PerGroup(64)), "weight", "no"),
    (spec("fp8_e4m3fnuz", qt.PerTensor()), "weight", "no"),
])
def test_support(spec, role, kind):
    s = interop.EXPORTERS["quark"].support(spec, role)
    assert s.kind == kind and s.note, s


def test_an_offset_zero_point_is_the_nearest_float_one(tmp_path):
    """GGUF Q4_1's ``code * scale + m`` is exported as Quark's float zero point ``-m / scale``: accepted only
    with allow_nearest, and the weights then differ by float32 rounding only."""
    if "offset" not in getattr(qt.spec, "ZERO_POINT_DOMAINS", ()):
        pytest.fail("qtransform has no offset zero point: drop this test with the exporter's offset branch")
    offset = spec("uint4", qt.PerGroup(32), symmetric=False, zero_point_domain="offset", scale_dtype="float16")
    assert interop.EXPORTERS["quark"].support(offset).kind == "nearest"
    quantize_save("llama", offset, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="allow_nearest"):
        interop.export(tmp_path / "ckpt", to="quark", out=tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    interop.export(tmp_path / "ckpt", to="quark", out=tmp_path / "quark", allow_nearest=True)
    source, back = interop.read_source(tmp_path / "ckpt"), QuarkImporter().read(tmp_path / "quark")
    for path, q in source.meta.entries.items():
        a, b = qt.dequantize(source.tree[path]), qt.dequantize(back.tree[path])
        assert back.tree[path].spec.zero_point_domain == "float"
        torch.testing.assert_close(b, a, atol=1e-6 * a.abs().max().item(), rtol=0)


def test_refusals_name_the_tree_path_and_write_nothing(tmp_path):
    quantize_save("gpt2", "int4-g32", tmp_path / "gpt2")  # transformers' Conv1D, not nn.Linear
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn\.c_attn\.weight: a quantized Conv1D weight"):
        interop.export(tmp_path / "gpt2", to="quark", out=tmp_path / "out")
    quantize_save("llama", "nvfp4", tmp_path / "nvfp4")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight: nvfp4 .*two-level"):
        interop.export(tmp_path / "nvfp4", to="quark", out=tmp_path / "out")
    torch.manual_seed(0)
    model = tiny_causal_lm("llama").eval()
    int4 = spec("int4", qt.PerGroup(16))
    bridge.save(bridge.quantize(model, qt.Recipe(default=int4, exclude=["lm_head*"])), tmp_path / "embed")
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight: a quantized Embedding weight"):
        interop.export(tmp_path / "embed", to="quark", out=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary leftovers


def test_importer_refuses_what_it_cannot_map(tmp_path):
    quantize_save("llama", "int4-g32", tmp_path / "ckpt")
    interop.export(tmp_path / "ckpt", to="quark", out=tmp_path / "quark")
    cfg = json.loads((tmp_path / "quark" / "config.json").read_text())
    cfg["quantization_config"]["global_quant_config"]["weight"]["dtype"] = "int3"
    (tmp_path / "quark" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model\.layers\.\d\.\w+\.\w+_proj\.weight: Quark dtype 'int3'"):
        QuarkImporter().read(tmp_path / "quark")
    assert not QuarkImporter().detect(tmp_path / "ckpt")  # our own format is not Quark's
    cfg["quantization_config"]["global_quant_config"]["weight"]["dtype"] = "int4"
    cfg["quantization_config"]["export"]["weight_format"] = "fake_quantized"
    (tmp_path / "quark" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="weight_format 'fake_quantized'"):
        QuarkImporter().read(tmp_path / "quark")

"""The compressed-tensors importer: export then import gives back the very tree (specs, codes, scales, activation
and key/value quantizers, recipe, tied paths); checkpoints compressed-tensors itself compressed read bit for bit
against its own decompression; what our tree cannot hold (act-order permutations, uncompressed weights) is refused
by path."""

import json

import pytest
import torch
from bridge_util import same_bits
from interop.compressed_tensors.helpers import batches as _batches, needs_calibration, recipe as _recipe, tiny as _tiny
from safetensors.torch import load_file

import bridge
import qtransform as qt
from bridge import interop


TO = "compressed-tensors"


def _quantize(model, name, tmp_path):
    recipe = _recipe(name)
    calib = _batches() if needs_calibration(recipe) else None
    ckpt = tmp_path / f"{name}-ckpt"
    bridge.save(bridge.quantize(model, recipe, calibration=calib), ckpt)
    return ckpt


@pytest.mark.parametrize("name", ["int4-g32", "int4-g32-asym", "int8-channel", "fp8-static-kv", "fp8-dynamic",
                                  "nvfp4", "mxfp4", "mxfp6", "mxfp8", "w8a8-int8-dynamic", "gptq4-g64"])
def test_export_then_import_gives_the_same_tree(name, tmp_path):
    model = _tiny("qwen2")
    if name == "gptq4-g64":
        bridge.save(bridge.quantize(model, _recipe(name), calibration=_batches()), tmp_path / "ckpt")
        ckpt = tmp_path / "ckpt"
    else:
        ckpt = _quantize(model, name, tmp_path)
    out = interop.export(ckpt, to=TO, out=tmp_path / "ct")
    assert interop.detect_format(out) == TO and interop.detect_format(ckpt) != TO
    want, got = interop.read_source(ckpt), interop.IMPORTERS[TO].read(out)
    assert set(got.tree) == set(want.tree)
    for path, w in want.tree.items():
        g = got.tree[path]
        if isinstance(w, qt.QTensor):
            assert isinstance(g, qt.QTensor) and g.spec == w.spec and g.shape == w.shape and g.dtype == w.dtype, path
            assert same_bits(g.codes, w.codes), path
            assert w.qparams.tensors().keys() == g.qparams.tensors().keys(), path
            assert all(same_bits(g.qparams.tensors()[k], t) for k, t in w.qparams.tensors().items()), path
        else:
            assert same_bits(g, w), path
    assert got.meta.entries == want.meta.entries and dict(got.meta.activations) == dict(want.meta.activations)
    assert got.meta.recipe == want.meta.recipe and dict(got.meta.aliases) == dict(want.meta.aliases)


def test_import_without_our_metadata_reads_compressed_tensors_own_terms(tmp_path):
    """A checkpoint without qtransform's metadata (as llm-compressor writes it): the specs come from the
    compressed-tensors args alone; the same values, signed codes for symmetric integers."""
    import safetensors.torch

    ckpt = _quantize(_tiny("llama"), "int4-g32-asym", tmp_path)
    out = interop.export(ckpt, to=TO, out=tmp_path / "ct")
    tensors = load_file(out / "model.safetensors")
    safetensors.torch.save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    got, want = interop.IMPORTERS[TO].read(out), interop.read_source(ckpt)
    for path, w in want.meta.entries.items():
        assert got.meta.entries[path].spec == qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32),
                                                           symmetric=False)
        assert torch.equal(qt.dequantize(got.tree[path]), qt.dequantize(want.tree[path]))


def _ct_checkpoint(out, scheme_kw, inputs=None):
    """A tiny Llama quantized and compressed by compressed-tensors itself (as llm-compressor saves it: its
    ``ModelCompressor`` writes the config; min/max qparams by its own ``calculate_qparams``)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import save_file

    model = _tiny("llama")
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**scheme_kw),
                                input_activations=None if inputs is None else QuantizationArgs(**inputs))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for m in model.modules():
        args = getattr(getattr(m, "quantization_scheme", None), "weights", None)
        if args is not None:
            w = m.weight.detach()
            blocks = w.reshape(w.shape[0], -1, args.group_size) if args.group_size else w
            dim = -1 if args.group_size else 1
            scale, zp = calculate_qparams(blocks.amin(dim, keepdim=not args.group_size),
                                          blocks.amax(dim, keepdim=not args.group_size), args)
            m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.data.copy_(zp.reshape(m.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    out.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    model.config.save_pretrained(out)
    compressor.update_config(out)
    return scheme


@pytest.mark.parametrize("kind", ["w4a16-asym-g32", "w4a16-sym-channel", "fp8-dynamic"])
def test_import_of_a_checkpoint_compressed_tensors_wrote(kind, tmp_path):
    """Our importer on compressed-tensors' own output: every weight dequantizes to what compressed-tensors'
    compressor decompresses from the same file, bit for bit, and the activation quantizers come along."""
    from compressed_tensors.compressors import BaseCompressor

    w4 = {"num_bits": 4, "type": "int"}
    kw, inputs = {"w4a16-asym-g32": ({**w4, "symmetric": False, "strategy": "group", "group_size": 32}, None),
                  "w4a16-sym-channel": ({**w4, "symmetric": True, "strategy": "channel"}, None),
                  "fp8-dynamic": ({"num_bits": 8, "type": "float", "strategy": "channel"},
                                  {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True})}[kind]
    out = tmp_path / "ct"
    scheme = _ct_checkpoint(out, kw, inputs)
    assert interop.detect_format(out) == TO
    src = interop.IMPORTERS[TO].read(out)
    stored = load_file(out / "model.safetensors")
    fmt = json.loads((out / "config.json").read_text())["quantization_config"]["format"]
    scheme.format = fmt
    paths = sorted(src.meta.entries)
    assert len(paths) == 14 and "lm_head.weight" not in paths and not isinstance(src.tree["lm_head.weight"], qt.QTensor)
    for path in paths:
        name = path.removesuffix(".weight")
        local = {k[len(name) + 1:]: v for k, v in stored.items() if k.startswith(name + ".weight")}
        theirs = BaseCompressor.get_value_from_registry(fmt).decompress(local, scheme)["weight"]
        assert same_bits(qt.dequantize(src.tree[path]), theirs), path
    spec = src.meta.entries[paths[0]].spec
    if kind == "w4a16-asym-g32":
        assert spec == qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False)
    elif kind == "fp8-dynamic":
        assert set(src.meta.activations.values()) == {qt.QuantSpec(format="fp8_e4m3", granularity=qt.PerChannel(0),
                                                                   dynamic=True)}
    bridge.save(src.tree, tmp_path / "ours")  # our checkpoint of the imported tree reads back the same
    back = interop.read_source(tmp_path / "ours").tree
    assert all(same_bits(qt.dequantize(back[p]), qt.dequantize(src.tree[p])) for p in paths)


def test_import_refuses_what_our_tree_cannot_hold(tmp_path):
    """An act-order permutation (``weight_g_idx`` other than ``i // group_size``) and a checkpoint whose weights
    are not stored compressed are refused by path; a trivial ``g_idx`` is read past."""
    import safetensors.torch

    ckpt = _quantize(_tiny("llama"), "int4-g32", tmp_path)
    out = interop.export(ckpt, to=TO, out=tmp_path / "ct")
    tensors = load_file(out / "model.safetensors")
    name = "model.layers.1.mlp.down_proj"
    cols = int(tensors[f"{name}.weight_shape"][1])
    tensors[f"{name}.weight_g_idx"] = torch.arange(cols, dtype=torch.int32) // 32
    safetensors.torch.save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    got = interop.IMPORTERS[TO].read(out).tree[f"{name}.weight"]
    assert torch.equal(qt.dequantize(got), qt.dequantize(interop.read_source(ckpt).tree[f"{name}.weight"]))
    tensors[f"{name}.weight_g_idx"] = torch.randperm(cols, generator=torch.Generator().manual_seed(0)).int() // 32
    safetensors.torch.save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(bridge.CheckpointError, match=rf"{name}\.weight: an act-order permutation"):
        interop.IMPORTERS[TO].read(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["quantization_status"] = "frozen"
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(bridge.CheckpointError, match="not stored compressed"):
        interop.IMPORTERS[TO].read(out)
    assert not interop.IMPORTERS[TO].detect(ckpt) and not interop.IMPORTERS[TO].detect(tmp_path / "missing")

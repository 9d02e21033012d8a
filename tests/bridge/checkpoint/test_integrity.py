"""Corrupted and edited checkpoints, through both loaders (bridge.load and from_pretrained): every
edit is refused with a CheckpointError naming the file and tensor, before anything loads wrong."""

import json
import struct

import pytest
import torch

import qtransform as qt
import bridge
from bridge import CheckpointError
from bridge_util import tiny_causal_lm

RECIPE = qt.Recipe(default=qt.QuantSpec(format="fp8_e4m3", granularity=qt.PerChannel(0)),
                   rules={"*mlp.down_proj.weight": qt.QuantSpec(format="int4", granularity=qt.PerGroup(32),
                                                                symmetric=False)},
                   exclude=["lm_head*", "*embed*"])
UP, GATE = "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_proj.weight"


def from_pretrained(d, **kw):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(d, **kw)


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = tiny_causal_lm("llama").eval()
    qmodel = bridge.quantize(model, RECIPE)
    d = tmp_path / "ck"
    bridge.save(qmodel, d)
    return model, qmodel, d


def read(d):
    raw = (d / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write(d, header, data):
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + data)


def edit_header(fn):
    def edit(d):
        header, data = read(d)
        fn(header)
        write(d, header, data)
    return edit


def drop(name):
    """Remove a tensor the way a tool would: a valid file without it (offsets rewritten)."""
    def edit(d):
        header, data = read(d)
        meta = header.pop("__metadata__")
        entries = sorted(((k, v) for k, v in header.items() if k != name), key=lambda kv: kv[1]["data_offsets"][0])
        out, new = bytearray(), {"__metadata__": meta}
        for k, v in entries:
            a, b = v["data_offsets"]
            new[k] = {**v, "data_offsets": [len(out), len(out) + b - a]}
            out += data[a:b]
        write(d, new, bytes(out))
    return edit


def rename(old, new):
    return edit_header(lambda h: h.__setitem__(new, h.pop(old)))


def swap_names(a, b):
    def fn(h):
        h[a], h[b] = h[b], h[a]
    return edit_header(fn)


def swap_offsets(a, b):
    def fn(h):
        h[a]["data_offsets"], h[b]["data_offsets"] = h[b]["data_offsets"], h[a]["data_offsets"]
    return edit_header(fn)


def flip_byte(name):
    def edit(d):
        header, data = read(d)
        at = header[name]["data_offsets"][0]
        data = data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1:]
        write(d, header, data)
    return edit


def set_dtype(name, dtype):
    return edit_header(lambda h: h[name].update(dtype=dtype))


def edit_config(fn):
    def edit(d):
        cfg = json.loads((d / "config.json").read_text())
        fn(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    return edit


# case -> (edit, message, checked by bridge.load too)
CASES = {
    "deleted scale": (drop(UP + "_scale"), rf"missing tensor\(s\) \['{UP}_scale'\]", True),
    "deleted plain tensor": (drop("model.norm.weight"), r"missing tensor\(s\) \['model.norm.weight'\]", True),
    "garbled quantized name": (rename(UP + "_scale", UP + "_sca1e"), rf"missing tensor\(s\) \['{UP}_scale'\]", True),
    "garbled plain name": (rename("model.norm.weight", "model.nrm.weight"),
                           r"missing tensor\(s\) \['model.norm.weight'\]", True),
    "header dtype of a scale": (set_dtype(UP + "_scale", "I32"), rf"tensor '{UP}_scale' has shape \[128, 1\] and "
                                r"dtype I32, expected \[128, 1\] and F32", True),
    "header dtype of a float weight": (set_dtype("model.norm.weight", "I32"),
                                       r"tensor 'model.norm.weight' has shape \[64\] and dtype I32, expected \[64\] and", True),
    "header dtype of fp8 codes": (set_dtype(UP, "F8_E5M2"),
                                  rf"tensor '{UP}' has shape \[128, 64\] and dtype F8_E5M2, expected \[128, 64\] and F8_E4M3",
                                  True),
    "codes swapped by name": (swap_names(UP, GATE), rf"tensor '{GATE}' \(and \['{UP}'\]\) does not match the "
                              "checksum written with it", True),
    "codes swapped by offset": (swap_offsets(UP, GATE), "does not match the checksum written with it", True),
    "scales swapped by name": (swap_names(UP + "_scale", GATE + "_scale"), "does not match the checksum", True),
    "one byte of the codes": (flip_byte(UP), rf"tensor '{UP}' does not match the checksum written with it", True),
    "one byte of a float weight": (flip_byte("model.norm.weight"), "'model.norm.weight' does not match the checksum",
                                   True),
    "unlisted tensor": (edit_header(lambda h: h["__metadata__"].update(
                            checksums=json.dumps({k: v for k, v in json.loads(h["__metadata__"]["checksums"]).items()
                                                  if k != UP}))), rf"\['{UP}'\] have no checksum", True),
    "layer added to the config": (edit_config(lambda c: c.update(num_hidden_layers=c["num_hidden_layers"] + 1)),
                                  r"missing tensor\(s\) \['model.layers.2.", False),
    "quantization_config deleted": (edit_config(lambda c: c.pop("quantization_config")),
                                    r"model.safetensors: holds quantized tensors written by qtransform, but config.json "
                                    "has no quantization_config", False),
    "quantization_config null": (edit_config(lambda c: c.update(quantization_config=None)),
                                 "has no quantization_config with quant_method 'qtransform'", False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_edited_checkpoint_is_refused_by_both_loaders(saved, case):
    model, _, d = saved
    edit, message, by_load = CASES[case]
    edit(d)
    with pytest.raises(CheckpointError, match=message):
        from_pretrained(d)
    if by_load:
        with pytest.raises(CheckpointError, match=message):
            bridge.load(d, like=model)
    else:  # bridge.load takes the structure from `like`, and needs the quantization_config
        if "quantization_config" in case:
            with pytest.raises(CheckpointError, match="quantization_config"):
                bridge.load(d, like=model)


def test_verify_false_skips_the_checksums_in_both_loaders(saved):
    model, qmodel, d = saved
    swap_names(UP, GATE)(d)
    ids = torch.randint(3, 100, (1, 7))
    ref = logits(qmodel, ids)
    a = bridge.load(d, like=model, verify=False)
    b = from_pretrained(d, quantization_config=bridge.QTransformConfig(verify=False))
    for m in (a, b):  # loaded as the file says: the swap shows in the weights and the logits
        assert torch.equal(m.get_submodule("model.layers.0.mlp.up_proj").weight,
                           qmodel.get_submodule("model.layers.0.mlp.gate_proj").weight)
        assert not torch.allclose(logits(m, ids), ref)
    assert b.config.quantization_config.verify is False
    assert "verify" not in b.config.quantization_config.to_dict()  # a loading option, never saved


def test_checkpoints_without_checksums_still_load(saved):
    model, qmodel, d = saved
    from safetensors.torch import load_file, save_file  # what qtransform 0.2 wrote: no checksums
    save_file(load_file(d / "model.safetensors"), d / "model.safetensors", metadata={"format": "pt",
                                                                                    "quant_method": "qtransform"})
    ids = torch.randint(3, 100, (1, 7))
    ref = logits(qmodel, ids)
    assert torch.equal(logits(bridge.load(d, like=model), ids), ref)
    assert torch.equal(logits(from_pretrained(d), ids), ref)


def test_each_shard_is_verified(tmp_path):
    torch.manual_seed(0)
    model = tiny_causal_lm("llama").eval()
    bridge.save(bridge.quantize(model, RECIPE), tmp_path / "ck", max_shard_size=20_000)
    shards = sorted((tmp_path / "ck").glob("model-*.safetensors"))
    assert len(shards) >= 3
    raw = bytearray(shards[-1].read_bytes())
    raw[-1] ^= 0x01  # the last byte of the last shard
    shards[-1].write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"{shards[-1].name}: tensor .* does not match the checksum"):
        bridge.load(tmp_path / "ck", like=model)
    with pytest.raises(CheckpointError, match=rf"{shards[-1].name}: tensor .* does not match the checksum"):
        from_pretrained(tmp_path / "ck")


def test_verify_argument_checked():
    with pytest.raises(TypeError, match="verify must be True or False"):
        bridge.load("nowhere", like=torch.nn.Linear(2, 2), verify="no")
    with pytest.raises(TypeError, match="verify must be True or False"):
        bridge.QTransformConfig(verify=1)

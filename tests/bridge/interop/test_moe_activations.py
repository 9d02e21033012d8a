"""Input quantizers of mixture-of-experts layers in compressed-tensors and Quark exports, the way vLLM's fused-MoE
methods read them, and back.

Facts the expected names come from (vLLM read at the source): ``FusedMoE.make_expert_params_mapping`` maps every
per-expert ``experts.{e}.gate_proj/up_proj/down_proj.input_scale`` (Mixtral: ``w1/w3/w2``) onto the layer's
``w13_input_scale`` / ``w2_input_scale`` (one value per expert); the compressed-tensors MoE methods take the
scheme's ``input_activations`` (``dynamic: true``: no scale stored), Quark's its layer config's ``input_tensors``.
QExperts holds one input quantizer per projection, so every expert gets the same value and the import takes it back
(refusing per-expert values that differ, by path). Quark exports static scales only (dynamic activations are refused
for every layer there, dense ones included). Logits are compared with ``torch.equal``: the import holds the very
scales and codes, and the same modules compute.
"""

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import bridge
import qtransform as qt
from bridge import interop
from bridge.checkpoint.metadata import CheckpointError
from interop.test_moe_gguf import _model

IDS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
EXPERT = {"mixtral": "model.layers.1.block_sparse_moe.experts.3", "qwen3_moe": "model.layers.1.mlp.experts.3"}
PROJS = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}


def _export(arch, preset, to, tmp_path):
    """The preset's specs, with min/max weight ranges instead of its MSE search (the same stored layout, seconds
    instead of a minute on these experts)."""
    recipe = dataclasses.replace(qt.get_preset(preset).recipe, steps=())
    q = bridge.quantize(_model(arch), recipe, calibration=[IDS])
    bridge.save(q, tmp_path / "ckpt")
    return q, interop.export(tmp_path / "ckpt", to=to, out=tmp_path / to)


def _stored(out):
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _back(arch, q, out, to, tmp_path):
    got, want = interop.IMPORTERS[to].read(out), interop.read_source(tmp_path / "ckpt")
    assert got.meta.activations == want.meta.activations
    assert set(got.tree) == set(want.tree)
    for k in ("model.layers.0.mlp.experts.gate_up_proj_input_scale", "model.layers.1.mlp.experts.down_proj_input_scale"):
        assert (k in got.tree) == (k in want.tree) and (k not in want.tree or torch.equal(got.tree[k], want.tree[k]))
    loaded = bridge.load(out, like=_model(arch, seed=1))
    assert torch.equal(loaded(IDS).logits, q(IDS).logits)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_compressed_tensors_static_fp8_inputs_per_expert(arch, tmp_path):
    q, out = _export(arch, "fp8-w8a8", "compressed-tensors", tmp_path)
    stored, _ = _stored(out)
    tree = interop.read_source(tmp_path / "ckpt").tree
    gate, up, down = (f"{EXPERT[arch]}.{p}.input_scale" for p in PROJS[arch])
    for name in (gate, up, down):
        assert tuple(stored[name].shape) == (1,) and stored[name].dtype == torch.float32, name
    assert torch.equal(stored[gate], tree["model.layers.1.mlp.experts.gate_up_proj_input_scale"].reshape(1))
    assert torch.equal(stored[up], stored[gate])
    assert torch.equal(stored[down], tree["model.layers.1.mlp.experts.down_proj_input_scale"].reshape(1))
    assert len([n for n in stored if ".experts." in n and n.endswith(".input_scale")]) == 2 * 4 * 3
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["Linear"]
    assert group["input_activations"] == {"dynamic": False, "num_bits": 8, "strategy": "tensor", "symmetric": True,
                                          "type": "float"} | {k: v for k, v in group["input_activations"].items()
                                                              if k not in ("dynamic", "num_bits", "strategy",
                                                                           "symmetric", "type")}
    _back(arch, q, out, "compressed-tensors", tmp_path)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_compressed_tensors_dynamic_int8_inputs(arch, tmp_path):
    q, out = _export(arch, "w8a8-int8-dynamic", "compressed-tensors", tmp_path)
    stored, _ = _stored(out)
    assert not [n for n in stored if n.endswith(("input_scale", "input_zero_point"))]
    assert stored[f"{EXPERT[arch]}.{PROJS[arch][0]}.weight"].dtype == torch.int8
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert group["input_activations"]["dynamic"] is True and group["input_activations"]["type"] == "int"
    assert group["input_activations"]["num_bits"] == 8
    _back(arch, q, out, "compressed-tensors", tmp_path)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_quark_static_fp8_inputs_per_expert(arch, tmp_path):
    q, out = _export(arch, "fp8-w8a8", "quark", tmp_path)
    stored, _ = _stored(out)
    tree = interop.read_source(tmp_path / "ckpt").tree
    gate, up, down = (f"{EXPERT[arch]}.{p}.input_scale" for p in PROJS[arch])
    for name in (gate, up, down):
        assert tuple(stored[name].shape) == () and stored[name].dtype == torch.float32, name
    assert float(stored[gate]) == float(stored[up]) == float(tree["model.layers.1.mlp.experts.gate_up_proj_input_scale"])
    assert float(stored[down]) == float(tree["model.layers.1.mlp.experts.down_proj_input_scale"])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    inputs = qc["global_quant_config"]["input_tensors"]
    assert inputs["dtype"] == "fp8_e4m3" and inputs["qscheme"] == "per_tensor" and inputs["is_dynamic"] is False
    _back(arch, q, out, "quark", tmp_path)


@pytest.mark.parametrize("to", ["compressed-tensors", "quark"])
def test_per_expert_input_scales_that_differ_are_refused_by_path(to, tmp_path):
    _, out = _export("qwen3_moe", "fp8-w8a8", to, tmp_path)
    stored, meta = _stored(out)
    name = "model.layers.0.mlp.experts.2.up_proj.input_scale"
    stored[name] = stored[name] * 2
    save_file(stored, str(out / "model.safetensors"), metadata=meta)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.experts\.2\.up_proj\.input_scale .* differs"):
        interop.IMPORTERS[to].read(out, verify=False)

"""accelerate offloading of qtransform checkpoints (issue 16): ``from_pretrained`` with ``"cpu"``/``"disk"``
entries in an explicit ``device_map``, or ``device_map="auto"`` with a ``max_memory`` smaller than the
model, gives the logits of the same checkpoint loaded without a device map, and the quantized
weights of the ``"disk"`` modules are offloaded for real (on ``meta`` between forwards, no packed
copy kept). No accelerator here: ``"disk"`` is the offload target, ``"cpu"`` the execution device."""

import pytest
import torch
from bridge_util import tiny_causal_lm, tiny_with_outliers
from transformers import AutoModelForCausalLM

import bridge
import qtransform as qt

RECIPE = qt.Recipe(default=qt.QuantSpec(format="int4", granularity=qt.PerGroup(32), symmetric=False),
                   rules={"*mlp.down_proj.weight": qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))},
                   exclude=["lm_head*"])  # the embedding is quantized too (a QEmbedding on "cpu")
MAP = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
       "model.norm": "cpu", "lm_head": "disk"}
IDS = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def _checkpoint(path, recipe=RECIPE, model=None, calibration=None):
    torch.manual_seed(0)
    model = tiny_causal_lm("llama").eval() if model is None else model
    bridge.save(bridge.quantize(model, recipe, calibration=calibration), path)
    return path


def _disk_modules(model):
    return [m for name, m in model.named_modules()
            if name.startswith("model.layers.1.") and isinstance(m, bridge.QModule)]


def test_explicit_device_map_with_cpu_and_disk_entries(tmp_path):
    ck = _checkpoint(tmp_path / "ck")
    plain = AutoModelForCausalLM.from_pretrained(ck)
    ref = _logits(plain)
    model = AutoModelForCausalLM.from_pretrained(ck, device_map=MAP, offload_folder=tmp_path / "off")
    disk = _disk_modules(model)
    assert len(disk) == 7
    assert all(b.is_meta for m in disk for b in m.buffers())  # offloaded, read from the checkpoint's file
    assert not model.model.layers[0].self_attn.q_proj.weight.is_meta
    assert isinstance(model.model.embed_tokens, bridge.QEmbedding)
    assert torch.equal(_logits(model), ref)
    assert all(b.is_meta for m in disk for b in m.buffers())  # put back after the forward
    assert all(m._cache is None for m in disk)  # and no packed copy of them kept
    assert torch.equal(_logits(model), ref)  # swapped in again: the kernel state follows the tensors
    out = model.generate(IDS[:1], max_new_tokens=4, do_sample=False)
    assert torch.equal(out, plain.generate(IDS[:1], max_new_tokens=4, do_sample=False))


def test_auto_device_map_with_max_memory_smaller_than_the_model(tmp_path):
    ck = _checkpoint(tmp_path / "ck")
    plain = AutoModelForCausalLM.from_pretrained(ck)
    size = sum(t.numel() * t.element_size() for t in plain.state_dict().values())
    model = AutoModelForCausalLM.from_pretrained(ck, device_map="auto", max_memory={"cpu": int(0.9 * size)},
                                                 offload_folder=tmp_path / "off")
    assert set(model.hf_device_map.values()) == {"cpu", "disk"}, model.hf_device_map
    assert model.hf_device_map.get("model.layers.0") == "cpu"  # sized by its quantized tensors, all of them
    assert torch.equal(_logits(model), _logits(plain))
    everything = AutoModelForCausalLM.from_pretrained(ck, device_map="auto", max_memory={"cpu": size // 4},
                                                      offload_folder=tmp_path / "off2")
    assert "disk" in everything.hf_device_map.values()
    assert torch.equal(_logits(everything), _logits(plain))


def test_offloaded_activation_and_kv_quantizers_and_online_rotations(tmp_path):
    model = tiny_with_outliers("llama")
    cal = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(10 + i)) for i in range(2)]
    recipe = qt.Recipe(type_rules={"Linear": qt.QuantSpec(format="int4", granularity=qt.PerGroup(16))},
                       exclude=["lm_head*"], input=qt.QuantSpec(format="int8"),
                       kv_cache=qt.QuantSpec(format="fp8_e4m3"), steps=["rotate", "rtn"])
    ck = _checkpoint(tmp_path / "ck", recipe, model=model, calibration=cal)
    plain = AutoModelForCausalLM.from_pretrained(ck)
    attn = plain.model.layers[1].self_attn
    assert attn.k_scale.numel() == 1 and plain.model.layers[1].mlp.down_proj.input_scale.numel() == 1
    loaded = AutoModelForCausalLM.from_pretrained(ck, device_map=MAP, offload_folder=tmp_path / "off")
    assert loaded.model.layers[1].self_attn.k_scale.is_meta  # the cache quantizer's scale offloaded too
    assert loaded.model.layers[1].mlp.down_proj.input_scale.is_meta
    assert torch.equal(_logits(loaded), _logits(plain))


def test_quantize_on_load_with_disk_entries(tmp_path):
    torch.manual_seed(0)
    tiny_causal_lm("llama").eval().save_pretrained(tmp_path / "fp")
    cfg = lambda: bridge.QTransformConfig(recipe=RECIPE, skip_modules=[])  # noqa: E731
    ref = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "fp", quantization_config=cfg()))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp", quantization_config=cfg(), device_map=MAP,
                                                 offload_folder=tmp_path / "off")
    assert isinstance(model.model.layers[1].self_attn.q_proj, bridge.QLinear)
    assert torch.equal(_logits(model), ref)


@pytest.mark.parametrize("where", ["disk", "cpu"])
def test_save_pretrained_of_an_offloaded_model_reloads(tmp_path, where):
    ck = _checkpoint(tmp_path / "ck")
    ref = _logits(AutoModelForCausalLM.from_pretrained(ck))
    model = AutoModelForCausalLM.from_pretrained(ck, device_map={**MAP, "model.layers.1": where},
                                                 offload_folder=tmp_path / "off")
    model.save_pretrained(tmp_path / "sp")
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "sp")), ref)


def test_dequantize_of_an_offloaded_model_is_refused(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(_checkpoint(tmp_path / "ck"), device_map=MAP,
                                                 offload_folder=tmp_path / "off")
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.q_proj is offloaded by accelerate"):
        model.dequantize()
    assert isinstance(model.model.layers[0].self_attn.q_proj, bridge.QLinear) and model.is_quantized

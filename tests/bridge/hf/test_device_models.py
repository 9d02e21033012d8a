"""A bridge-quantized model moved between devices, and our checkpoint loaded with ``device_map``: the
kernels are chosen again per device and the logits stay within bf16 rounding of the float32 reference.

The budget is measured, not tuned: the same quantized model run entirely in bfloat16 on the CPU (every
activation rounded, not only the kernels' operands) is as far from the float32 reference as bf16
rounding takes it; the packed kernels, which round only their operands and output to bf16, stay
within that (or within 2^-8, bf16's unit roundoff, if the bf16 model happens to be closer). The
``cuda`` parameters run on a GPU machine (``make test-gpu``); the ``cpu`` ones check the same code here."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import bridge
import qtransform as qt

RECIPE = qt.Recipe(default=qt.QuantSpec(format="int4", granularity=qt.PerGroup(128)))  # int4 g128 RTN
KERNEL = {"cpu": "int4pack_cpu", "cuda": "int4pack_cuda"}
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")])]


def _model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def _logits(model, ids):
    dev = next(model.parameters()).device
    with torch.no_grad():
        return model(ids.to(dev)).logits.float().cpu()


def _kernels(model, name):
    for m in model.modules():
        if isinstance(m, bridge.QModule):
            m.kernel = name
    return model


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def quantized():
    """``(quantized model on CPU, ids, float32 dequant reference logits, bf16 budget)``; ids hold a prefill
    (2 x 40 tokens) and a one-token decode shape."""
    q = bridge.quantize(_model(), RECIPE)
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    ids = {"prefill": ids, "decode": ids[:1, :1]}
    ref = {k: _logits(_kernels(q, "dequant"), v) for k, v in ids.items()}
    bf16 = copy.deepcopy(q).to(torch.bfloat16)
    budget = max(max(_rel(_logits(bf16, v), ref[k]) for k, v in ids.items()), 2.0 ** -8)
    _kernels(q, "auto")
    return q, ids, ref, budget


def _linears(model):
    return [m for m in model.modules() if isinstance(m, bridge.QLinear)]


@pytest.mark.parametrize("device", DEVICES)
def test_model_to_device_and_back(quantized, device):
    q, ids, ref, budget = quantized
    on_cpu = _logits(q, ids["prefill"])
    assert {m.kernel for m in _linears(q)} == {"int4pack_cpu"}
    assert _rel(on_cpu, ref["prefill"]) <= budget
    try:
        q.to(device)
        assert {m.kernel for m in _linears(q)} == {KERNEL[device]}
        assert all(b.device.type == device for b in q.buffers())
        for k, v in ids.items():
            assert _rel(_logits(q, v), ref[k]) <= budget, (device, k)
    finally:
        q.to("cpu")
    assert {m.kernel for m in _linears(q)} == {"int4pack_cpu"}
    assert torch.equal(_logits(q, ids["prefill"]), on_cpu)  # back on the CPU: the same kernels, the same numbers


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_loads_with_device_map(quantized, device, tmp_path):
    q, ids, ref, budget = quantized
    bridge.save(q, tmp_path / "ck")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ck", device_map=device)
    assert all(p.device.type == device for p in loaded.parameters())
    assert {m.kernel for m in _linears(loaded)} == {KERNEL[device]}
    for k, v in ids.items():
        assert _rel(_logits(loaded, v), ref[k]) <= budget, (device, k)

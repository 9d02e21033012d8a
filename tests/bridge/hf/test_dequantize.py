"""``model.dequantize()`` of qtransform models (issue 16): the float model that computes what the quantized
weights compute (the quantized model's logits with the ``"dequant"`` kernel and no activation or
key/value quantizers, kept online input rotations folded into the weights), with no quantization
config left, whose ``save_pretrained`` checkpoint loads in a process that never imports the bridge."""

import json
import subprocess
import sys

import pytest
import torch
from bridge_util import tiny_causal_lm, tiny_with_outliers
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

import bridge
import qtransform as qt
from bridge.hf.dequantize import dequantize_model
from bridge.modules import actquant, online

IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
W4 = qt.QuantSpec(format="int4", granularity=qt.PerGroup(16))
W8 = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))

# run in a fresh interpreter: transformers alone loads the saved float checkpoint
_PLAIN_LOAD = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
with torch.no_grad():
    logits = model(torch.load(sys.argv[2])).logits
assert not [m for m in sys.modules if m.split(".")[0] in ("bridge", "qtransform")], "bridge was imported"
torch.save(logits, sys.argv[3])
"""


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def _plain_logits(path, tmp_path):
    torch.save(IDS, tmp_path / "ids.pt")
    subprocess.run([sys.executable, "-c", _PLAIN_LOAD, str(path), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
                   check=True, cwd=tmp_path, timeout=300)
    return torch.load(tmp_path / "out.pt")


def _weights_only(model):
    """``model`` computing with the dequantized weights: the "dequant" kernel, no activation or cache quantizers."""
    for m in model.modules():
        if isinstance(m, bridge.QModule):
            m.kernel = "dequant"
            for role in qt.spec.ROLES:
                m.set_activation(role, None)
        for role in qt.spec.KV_ROLES:
            if getattr(m, f"{role}_spec", None) is not None:
                actquant.attach(m, role, None)
    return model


def _assert_float(model):
    assert not [n for n, m in model.named_modules() if isinstance(m, bridge.QModule)]
    assert not online.online_rotations(model)
    assert not [n for n, m in model.named_modules() if m._forward_pre_hooks]
    assert not [k for k in model.state_dict() if k.endswith(("_scale", "_zero_point"))]
    assert not getattr(model, "is_quantized", False) and not hasattr(model, "hf_quantizer")
    assert getattr(model.config, "quantization_config", None) is None


def test_dequantize_of_a_loaded_llama_checkpoint(tmp_path):
    """Rotated (R1 offline, R4 and R3 online), W4 with an int4 embedding, dynamic int8 inputs, fp8 cache."""
    model = tiny_with_outliers("llama")
    cal = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(10 + i)) for i in range(2)]
    recipe = qt.Recipe(default=W4, exclude=["lm_head*"], input=qt.QuantSpec(format="int8", dynamic=True),
                       kv_cache=qt.QuantSpec(format="fp8_e4m3"), steps=["rotate", "rtn"])
    bridge.save(bridge.quantize(model, recipe, calibration=cal), tmp_path / "ck")
    ref = _logits(_weights_only(AutoModelForCausalLM.from_pretrained(tmp_path / "ck")))
    q = AutoModelForCausalLM.from_pretrained(tmp_path / "ck")
    assert q.config._attn_implementation == "qtransform|sdpa" and q.model.layers[0].self_attn.k_scale.numel() == 1
    down = q.model.layers[1].mlp.down_proj
    assert online.online_rotations(q)[qt.Site("model.layers.1.mlp.down_proj", "input")] == qt.OnlineRotation(128)
    w_down = qt.dequantize(down.qweight, dtype=torch.float64)
    w_embed = qt.dequantize(q.model.embed_tokens.qweight)
    assert (_logits(q) - ref).abs().max() > 1e-3  # the activation and cache quantizers do change the function

    d = q.dequantize()
    assert d is q
    _assert_float(d)
    assert type(d.model.layers[1].mlp.down_proj) is nn.Linear and type(d.model.embed_tokens) is nn.Embedding
    assert d.config._attn_implementation == "sdpa"
    assert not hasattr(d.model.layers[0].self_attn, "k_scale")
    H = qt.hadamard(128, normalized=False, dtype=torch.float64) / 128 ** 0.5  # x -> x H before the down weight
    assert torch.allclose(d.model.layers[1].mlp.down_proj.weight.double(), w_down @ H.T, atol=1e-6)
    assert torch.equal(d.model.embed_tokens.weight, w_embed)
    got = _logits(d)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (got - ref).abs().max()

    d.save_pretrained(tmp_path / "float")
    cfg = json.loads((tmp_path / "float" / "config.json").read_text())
    assert "quantization_config" not in cfg and "qtransform" not in json.dumps(cfg)
    assert torch.equal(_plain_logits(tmp_path / "float", tmp_path), got)


def test_dequantize_of_a_gpt2_model_conv1d(tmp_path):
    torch.manual_seed(0)
    model = tiny_causal_lm("gpt2").eval()
    recipe = qt.Recipe(type_rules={"Conv1D": W8}, exclude=["lm_head*", "*wte*", "*wpe*"])
    ref = _logits(bridge.quantize(model, recipe, kernel="dequant"))
    q = bridge.quantize(model, recipe)
    attn = q.transformer.h[0].attn.c_attn
    assert isinstance(attn, bridge.QLinear) and attn.transposed
    w = qt.dequantize(attn.qweight)
    d = q.dequantize()
    _assert_float(d)
    c_attn = d.transformer.h[0].attn.c_attn
    assert type(c_attn) is Conv1D and c_attn.weight.shape == (64, 192) and torch.equal(c_attn.weight, w)
    assert c_attn.bias is attn.bias  # the bias kept
    got = _logits(d)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (got - ref).abs().max()
    d.save_pretrained(tmp_path / "float")
    assert torch.equal(_plain_logits(tmp_path / "float", tmp_path), got)


def test_dequantize_in_the_loaded_dtype(tmp_path):
    torch.manual_seed(0)
    bridge.save(bridge.quantize(tiny_causal_lm("llama").eval(), qt.Recipe(default=W8, exclude=["lm_head*"])),
                tmp_path / "ck")
    q = AutoModelForCausalLM.from_pretrained(tmp_path / "ck", dtype=torch.bfloat16)
    w = qt.dequantize(q.model.layers[0].self_attn.q_proj.qweight, dtype=torch.bfloat16)
    d = q.dequantize()
    assert {p.dtype for p in d.parameters()} == {torch.bfloat16}
    assert torch.equal(d.model.layers[0].self_attn.q_proj.weight, w)


def test_conv_and_embedding_modules(convnet, embednet):
    spec = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
    x = torch.randn(2, 3, 8, 8)
    ref = bridge.quantize(convnet, spec, kernel="dequant")(x)
    d = dequantize_model(bridge.quantize(convnet, spec))
    assert [type(m) for m in (d.conv, d.conv2, d.up, d.head)] == [nn.Conv2d, nn.Conv2d, nn.ConvTranspose2d, nn.Linear]
    assert (d.conv2.padding_mode, d.conv2.groups, d.conv2.bias, d.up.stride) == ("reflect", 2, None, (2, 2))
    assert torch.allclose(d(x), ref, atol=1e-5)
    tokens, bag, offsets = torch.tensor([[0, 3, 5], [7, 0, 9]]), torch.tensor([1, 2, 4, 5, 6]), torch.tensor([0, 2])
    ref = bridge.quantize(embednet, spec, kernel="dequant")(tokens, bag, offsets)
    d = dequantize_model(bridge.quantize(embednet, spec))
    assert type(d.emb) is nn.Embedding and d.emb.padding_idx == 0
    assert type(d.bag) is nn.EmbeddingBag and d.bag.mode == "sum"
    assert torch.allclose(d(tokens, bag, offsets), ref, atol=1e-5)


def test_online_rotations_fold_into_linear_and_conv1d_weights():
    """A Hadamard of order 12 is not symmetric: the fold is W H^T ((out, in) weights), H W ((in, out))."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 24), Conv1D(24, 24), nn.Linear(24, 8)).eval()
    q = bridge.quantize(model, qt.Recipe(rules=[("0.weight", W8), ("1.weight", W8)]), kernel="dequant")
    assert isinstance(q[1], bridge.QLinear) and q[1].transposed and type(q[2]) is nn.Linear
    rot = qt.OnlineRotation(12)
    B = qt.rotation.apply_online(torch.eye(12), rot)
    assert not torch.allclose(B, B.T)
    online.install_online_rotations(q, {qt.Site(str(i), "input"): rot for i in range(3)})
    x = torch.randn(5, 24)
    with torch.no_grad():
        ref = q(x)
        d = dequantize_model(q)
        got = d(x)
    assert [type(m) for m in d] == [nn.Linear, Conv1D, nn.Linear] and not online.online_rotations(d)
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()


def test_bad_dtype_is_refused_before_anything_changes(convnet):
    q = bridge.quantize(convnet, qt.QuantSpec(format="int8"))
    with pytest.raises(TypeError, match="dtype must be None or a floating torch.dtype, got torch.int8"):
        dequantize_model(q, torch.int8)
    assert isinstance(q.conv, bridge.QConv2d)

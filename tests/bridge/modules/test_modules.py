"""Quantized modules against the dequantize reference, state handling and errors."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qtransform as qt
import bridge
from bridge import QConv2d, QConvTranspose2d, QEmbedding, QEmbeddingBag, QLinear

from bridge_util import same_bits


def qweight(w, spec):
    w = w.detach()
    return qt.quantize(w, qt.choose_qparams(w, spec))


SPEC4 = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32), symmetric=False)
SPEC8 = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))


@pytest.mark.parametrize("spec", [SPEC4, SPEC8, qt.QuantSpec(format="nf4"),
                                  qt.QuantSpec(format="uint3", granularity=qt.PerGroup(16), symmetric=False,
                                               zero_point_domain="float")], ids=str)
def test_linear_dequant_matches_reference(spec):
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    q = qweight(lin.weight, spec)
    m = QLinear.from_float(lin, q, kernel="dequant")
    x = torch.randn(2, 5, 64)
    assert torch.allclose(m(x), F.linear(x, qt.dequantize(q), lin.bias), atol=1e-6)


def test_conv1d_transposed_layout():
    from transformers.pytorch_utils import Conv1D
    torch.manual_seed(0)
    c = Conv1D(32, 64)  # weight (in=64, out=32)
    q = qweight(c.weight, SPEC4)
    m = QLinear.from_float(c, q)
    assert m.transposed and (m.in_features, m.out_features) == (64, 32) and m.kernel == "dequant"
    x = torch.randn(3, 64)
    assert torch.allclose(m(x), x @ qt.dequantize(q) + c.bias, atol=1e-5)


def test_conv_modules_match_reference(convnet):
    x = torch.randn(2, 3, 8, 8)
    for name in ("conv", "conv2", "up"):
        mod = getattr(convnet, name)
        q = qweight(mod.weight, qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)))
        qm = (QConvTranspose2d if name == "up" else QConv2d).from_float(mod, q)
        inp = torch.randn(2, mod.in_channels, 8, 8)
        ref_mod = type(mod)(**{k: getattr(mod, k) for k in ("in_channels", "out_channels", "kernel_size", "stride",
                                                              "padding", "dilation", "groups")},
                            bias=mod.bias is not None,
                            **({"padding_mode": mod.padding_mode} if name != "up" else {}))
        with torch.no_grad():
            ref_mod.weight.copy_(qt.dequantize(q))
            if mod.bias is not None:
                ref_mod.bias.copy_(mod.bias)
        assert torch.allclose(qm(inp), ref_mod(inp), atol=1e-5), name
    up = QConvTranspose2d.from_float(convnet.up, qweight(convnet.up.weight, SPEC8))
    assert up(torch.randn(1, 16, 4, 4), (9, 9)).shape[-2:] == (9, 9)


@pytest.mark.parametrize("kernel", ["gather", "dequant"])
def test_embeddings_match_reference(embednet, kernel):
    spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(16), symmetric=False)
    qe = qweight(embednet.emb.weight, spec)
    qb = qweight(embednet.bag.weight, qt.QuantSpec(format="int8", granularity=qt.PerTensor()))
    e = QEmbedding.from_float(embednet.emb, qe, kernel=kernel)
    b = QEmbeddingBag.from_float(embednet.bag, qb, kernel=kernel)
    tokens = torch.tensor([[0, 5, 7, 5], [99, 1, 0, 3]])
    assert torch.equal(e(tokens), F.embedding(tokens, qt.dequantize(qe)))
    ids, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4])
    w = torch.rand(8)
    for mode in ("sum", "mean", "max"):
        b.mode = mode
        psw = w if mode == "sum" else None
        ref = F.embedding_bag(ids, qt.dequantize(qb), offsets, mode=mode, per_sample_weights=psw)
        assert torch.allclose(b(ids, offsets, psw), ref, atol=1e-6), mode
    bag_pad = nn.EmbeddingBag(100, 32, mode="mean", padding_idx=2)
    qp = qweight(bag_pad.weight, SPEC8)
    bp = QEmbeddingBag.from_float(bag_pad, qp, kernel=kernel)
    ref = F.embedding_bag(ids, qt.dequantize(qp), offsets, mode="mean", padding_idx=2)
    assert torch.allclose(bp(ids, offsets), ref, atol=1e-6)


def test_embedding_per_block_rows_fall_back_to_dequant():
    emb = nn.Embedding(64, 32)
    q = qweight(emb.weight, qt.QuantSpec(format="int8", granularity=qt.PerBlock((16, 16))))
    m = QEmbedding.from_float(emb, q)
    assert m.kernel == "dequant" and m.available_kernels() == ("dequant",)
    with pytest.raises(ValueError, match="cannot be gathered"):
        m.kernel = "gather"
    idx = torch.tensor([3, 40])
    assert torch.equal(m(idx), qt.dequantize(q)[idx])


def test_buffers_state_dict_and_dtype_moves():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    q = qweight(lin.weight, SPEC4)
    m = QLinear.from_float(lin, q)
    sd = m.state_dict()
    assert set(sd) == {"weight", "weight_scale", "weight_zero_point", "bias"}
    assert same_bits(sd["weight"], q.codes) and same_bits(sd["weight_scale"], q.qparams.scale)
    m.to(torch.bfloat16)
    assert m.bias.dtype == torch.bfloat16 and m.compute_dtype == torch.bfloat16
    assert same_bits(m.weight_scale, q.qparams.scale) and same_bits(m.weight, q.codes)  # never cast
    m.float()
    assert m.bias.dtype == torch.float32 and m.weight_scale.dtype == torch.float32
    m2 = QLinear.from_float(nn.Linear(64, 32), qweight(torch.randn(32, 64), SPEC4))
    m2.load_state_dict(m.state_dict())
    assert same_bits(m2.weight, m.weight)
    bad = dict(m.state_dict(), weight_scale=m.weight_scale.half())
    with pytest.raises(RuntimeError, match="weight_scale: quantized buffer has shape"):
        m2.load_state_dict(bad)
    with pytest.raises(ValueError, match="needs \\(32, 64\\)"):
        QLinear.from_float(nn.Linear(64, 32), qweight(torch.randn(16, 64), SPEC4))
    with pytest.raises(ValueError, match="kernel must be 'auto' or one of"):
        m.kernel = "fast"
    with pytest.raises(ValueError, match="int8pack_cpu.*8-bit"):
        m.kernel = "int8pack_cpu"


def test_activation_quantizers():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    q = qweight(lin.weight, SPEC8)
    dyn = qt.QuantSpec(format="int8", dynamic=True)
    m = QLinear.from_float(lin, q, kernel="dequant", input_quant=dyn)
    x = torch.randn(4, 64)
    xq = qt.fake_quantize(x, qt.choose_qparams(x, dyn))
    assert torch.allclose(m(x), F.linear(xq, qt.dequantize(q), lin.bias), atol=1e-6)
    static = qt.choose_qparams(torch.linspace(-3, 3, 10).reshape(2, 5), qt.QuantSpec(format="uint8", symmetric=False))
    m2 = QLinear.from_float(lin, q, kernel="dequant", output_quant=static)
    assert "output_scale" in m2.state_dict() and "output=uint8" in repr(m2)
    y = F.linear(x, qt.dequantize(q), lin.bias)
    assert torch.allclose(m2(x), qt.fake_quantize(y, static), atol=1e-6)
    with pytest.raises(ValueError, match="must be dynamic"):
        QLinear.from_float(lin, q, input_quant=qt.QuantSpec(format="int8"))


def test_forward_does_not_modify_inputs_or_buffers():
    lin = nn.Linear(64, 32)
    m = QLinear.from_float(lin, qweight(lin.weight, SPEC4))
    x = torch.randn(3, 64)
    x0, before = x.clone(), {k: v.clone() for k, v in m.state_dict().items()}
    m(x)
    assert torch.equal(x, x0) and all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())


def test_bridge_import_does_not_leak_into_core():
    import subprocess, sys
    code = "import qtransform, sys; print(any(m.split('.')[0] in ('bridge','transformers','safetensors') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"

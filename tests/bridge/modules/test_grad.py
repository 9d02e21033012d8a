"""Backward through every forward path: the gradient with respect to the input is the float op's
on the dequantized weight (frozen), whatever kernel computed the forward (the packed CPU kernels
have no autograd of their own: on the wave-1 main ``backward`` raised there)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qtransform as qt
from bridge import QConv2d, QConvTranspose2d, QEmbedding, QLinear
from bridge_util import same_bits

INT4 = qt.QuantSpec(format="int4", granularity=qt.PerGroup(64))
UINT4 = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False)
INT8 = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
PADDED = qt.QuantSpec(format="int4", granularity=qt.PerGroup(128), pad=True)  # 192 inputs: last group padded
LINEAR = [(INT4, 256, "int4pack_cpu"), (UINT4, 256, "int4pack_cpu"), (INT8, 256, "int8pack_cpu"),
          (PADDED, 192, "int4pack_cpu"), (INT4, 256, "dequant")]


def _quantized(module: nn.Module, spec):
    w = module.weight.detach()
    return qt.quantize(w, qt.choose_qparams(w, spec))


def _input_grad(fn, x, g):
    x = x.detach().requires_grad_()
    return torch.autograd.grad(fn(x), x, g)[0]


@pytest.mark.parametrize("spec,k,kernel", LINEAR, ids=lambda v: str(v))
@pytest.mark.parametrize("shape", [(5,), (2, 40)], ids=["2d", "3d"])
def test_linear_input_gradient_is_the_dequantized_weights(spec, k, kernel, shape):
    torch.manual_seed(0)
    lin = nn.Linear(k, 64)
    q = _quantized(lin, spec)
    m = QLinear.from_float(lin, q, kernel=kernel)
    assert m.kernel == kernel
    before = {n: b.clone() for n, b in m.named_buffers()}
    x = torch.randn(*shape, k)
    g = torch.randn(*shape, 64)
    got = _input_grad(m, x, g)
    want = g @ qt.dequantize(q)  # d(x W^T + b)/dx applied to g, from the codes alone
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert all(same_bits(b, before[n]) for n, b in m.named_buffers())  # frozen, untouched


def test_gpt2_conv1d_layout_gradient():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    c = Conv1D(64, 256)  # weight (in, out)
    q = _quantized(c, qt.QuantSpec(format="int8", granularity=qt.PerChannel(1)))
    m = QLinear.from_float(c, q)
    x, g = torch.randn(3, 256), torch.randn(3, 64)
    torch.testing.assert_close(_input_grad(m, x, g), g @ qt.dequantize(q).t(), rtol=1e-5, atol=1e-5)


def test_w8a8_int_mm_gradient_is_straight_through_the_input_quantizer():
    torch.manual_seed(0)
    lin = nn.Linear(256, 64)
    q = _quantized(lin, INT8)
    act = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0), dynamic=True)  # per token
    m = QLinear.from_float(lin, q, input_quant=act, kernel="int8_int_mm_cpu")
    x, g = torch.randn(4, 256), torch.randn(4, 64)
    torch.testing.assert_close(_input_grad(m, x, g), g @ qt.dequantize(q), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls,module", [
    (QConv2d, lambda: nn.Conv2d(3, 8, 3, stride=2, padding=1, padding_mode="reflect")),
    (QConv2d, lambda: nn.Conv2d(4, 8, 3, groups=2, dilation=2)),
    (QConvTranspose2d, lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1)),
])
def test_conv_input_gradient(cls, module):
    torch.manual_seed(0)
    conv = module()
    q = _quantized(conv, qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)))
    m = cls.from_float(conv, q)
    ref = type(conv)(**{k: getattr(conv, k) for k in ("in_channels", "out_channels", "kernel_size", "stride",
                                                       "padding", "dilation", "groups", "padding_mode")},
                     **({"output_padding": conv.output_padding} if cls is QConvTranspose2d else {}))
    with torch.no_grad():  # the float module on the dequantized weight: torch's own backward
        ref.weight.copy_(qt.dequantize(q))
        ref.bias.copy_(conv.bias)
    x = torch.randn(2, conv.in_channels, 9, 9)
    g = torch.randn_like(ref(x))
    torch.testing.assert_close(_input_grad(m, x, g), _input_grad(ref, x, g), rtol=1e-5, atol=1e-5)


def test_gradient_flows_to_earlier_layers_and_twice():
    """A trainable layer before a quantized one gets its float gradient; backward runs twice
    (nothing freed that a second graph needs)."""
    torch.manual_seed(0)
    pre, lin = nn.Linear(32, 256), nn.Linear(256, 64)
    q = _quantized(lin, INT4)
    m = QLinear.from_float(lin, q)
    x = torch.randn(3, 32)
    for _ in range(2):
        pre.zero_grad()
        m(pre(x)).square().sum().backward()
        ref = nn.Linear(256, 64)
        with torch.no_grad():
            ref.weight.copy_(qt.dequantize(q))
            ref.bias.copy_(lin.bias)
        want = torch.autograd.grad(ref(pre(x)).square().sum(), pre.weight)[0]
        torch.testing.assert_close(pre.weight.grad, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_embedding_indices_need_no_gradient_and_outputs_carry_none():
    torch.manual_seed(0)
    emb = nn.Embedding(50, 16)
    m = QEmbedding.from_float(emb, _quantized(emb, INT8))
    with torch.enable_grad():
        y = m(torch.tensor([[1, 2, 3]]))
    assert not y.requires_grad
    torch.testing.assert_close(y, F.embedding(torch.tensor([[1, 2, 3]]), m.dequantized_weight()))

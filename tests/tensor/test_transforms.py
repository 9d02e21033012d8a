"""torch.func and torch.compile compatibility, learned-scale gradients."""

import pytest
import torch

import qtransform as qt

SPEC = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False, zero_point_domain="float")


def test_grad_with_respect_to_scale_is_lsq():
    x = torch.tensor([[0.30, -0.70, 0.10, 1.30]])
    spec = qt.QuantSpec(format="int8", granularity=qt.PerTensor(), symmetric_range="restricted")
    s = torch.tensor([[0.01]])

    def loss(scale):
        return qt.fake_quantize(x, qt.QParams(scale=scale, spec=spec)).sum()

    g = torch.func.grad(loss)(s)
    v = x / s  # 30, -70, 10, 130 -> the last clips at 127
    inside = v.abs() <= 127
    expected = torch.where(inside, torch.round(v) - v, torch.sign(v) * 127).sum()
    torch.testing.assert_close(g, expected.reshape(1, 1))


def test_vmap_over_layers_of_equal_shape():
    layers = torch.randn(4, 16, 64)
    qps = torch.func.vmap(lambda w: qt.choose_qparams(w, SPEC))(layers)
    assert qps.scale.shape == (4, 16, 2)
    out = torch.func.vmap(lambda w, qp: qt.dequantize(qt.quantize(w, qp)))(layers, qps)
    ref = torch.stack([qt.dequantize(qt.quantize(w, qt.choose_qparams(w, SPEC))) for w in layers])
    assert torch.equal(out, ref)


def test_torch_compile_matches_eager():
    w = torch.randn(32, 64)

    def roundtrip(t):
        return qt.fake_quantize(t, qt.choose_qparams(t, SPEC))

    torch.testing.assert_close(torch.compile(roundtrip)(w), roundtrip(w), rtol=0, atol=1e-6)


def test_grad_through_fake_quantize_in_a_loss():
    w = torch.randn(8, 32, requires_grad=True)
    qp = qt.choose_qparams(w.detach(), SPEC)
    loss = (qt.fake_quantize(w, qp) @ torch.randn(32, 4)).pow(2).mean()
    loss.backward()
    assert w.grad is not None and w.grad.abs().sum() > 0


def test_torch_compile_quantize_dequantize():
    w = torch.randn(16, 64)

    def roundtrip(t):
        return qt.dequantize(qt.quantize(t, qt.choose_qparams(t, SPEC)))

    assert torch.equal(torch.compile(roundtrip)(w), roundtrip(w))


@pytest.mark.parametrize("shape", [(3, 8), (5, 16)])
def test_range_grad_differentiates_the_fitted_scale(shape):
    """int4 per row, scale = max|x| / 7.5 (the observer's symmetric int4 step): with range_grad the
    gradient is the clipped straight-through one plus (q - v·in range)·∂s/∂x, where ∂s/∂x is
    sign(x)/7.5 at each row's largest |x| (derived by hand); the values are those without it."""
    spec = qt.QuantSpec(format="int4", granularity=qt.PerChannel(0), dynamic=True)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0), requires_grad=True)
    qp = qt.choose_qparams(x.detach(), spec)
    y = qt.fake_quantize(x, qp, range_grad=True)
    assert torch.equal(y, qt.fake_quantize(x.detach(), qp))
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    (g,) = torch.autograd.grad((y * w).sum(), x)
    xd, rows = x.detach(), torch.arange(shape[0])
    s = xd.abs().amax(1, keepdim=True) / 7.5
    v = xd / s
    q, inside = v.round().clamp(-8, 7), (v >= -8) & (v <= 7)
    ds = torch.zeros_like(xd)
    top = xd.abs().argmax(1)
    ds[rows, top] = xd[rows, top].sign() / 7.5
    expected = w * inside + (w * (q - torch.where(inside, v, 0))).sum(1, keepdim=True) * ds
    torch.testing.assert_close(g, expected, atol=1e-5, rtol=0)
    (plain,) = torch.autograd.grad((qt.fake_quantize(x, qp) * w).sum(), x)
    assert not torch.allclose(g, plain)


def test_range_grad_leaves_an_all_zero_block_finite():
    spec = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0), dynamic=True)
    x = torch.cat([torch.zeros(1, 4), torch.ones(1, 4)]).requires_grad_()
    qp = qt.choose_qparams(x.detach(), spec)
    y = qt.fake_quantize(x, qp, range_grad=True)
    y.sum().backward()
    assert torch.equal(y.detach(), qt.fake_quantize(x.detach(), qp)) and torch.equal(y[0].detach(), torch.zeros(4))
    assert torch.isfinite(x.grad).all()

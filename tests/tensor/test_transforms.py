"""torch.func and torch.compile compatibility, learned-scale gradients."""

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

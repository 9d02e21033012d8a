"""``zero_point_domain="offset"``: values ``code * scale + zero_point`` (GGUF Q4_1's ``d * q + m``),
reproduced bit for bit with 16-bit parameters; the expected values are computed here with numpy
(float32 ``d * q + m``, as the ``gguf`` package dequantizes Q4_1), not by qtransform."""

import json

import numpy as np
import pytest
import torch

import qtransform as qt
from qtransform.spec import ZERO_POINT_DOMAINS

Q4_1 = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False, zero_point_domain="offset",
                    scale_dtype="float16")


def _random_q4_1(rows: int, groups: int, seed: int = 0, *, zero_block: bool = False):
    """fp16 scales ``d`` > 0 (one zero with ``zero_block``), fp16 offsets ``m`` of either sign, uint4 codes;
    the float32 values ``d * q + m`` computed in numpy."""
    rng = np.random.default_rng(seed)
    d = (rng.random((rows, groups)) * 0.02 + 1e-4).astype(np.float16)
    if zero_block:
        d[0, 0] = 0.0  # a constant block: GGUF writes d = 0
    m = (rng.standard_normal((rows, groups)) * 0.05).astype(np.float16)
    q = rng.integers(0, 16, size=(rows, groups * 32)).astype(np.uint8)
    x = (d.astype(np.float32).repeat(32, axis=1) * q.astype(np.float32)) + m.astype(np.float32).repeat(32, axis=1)
    return d, m, q, x.astype(np.float32)


def test_defaults_unchanged_and_offset_resolves():
    assert qt.QuantSpec(format="uint4", symmetric=False).zero_point_domain == "int"
    assert Q4_1.zero_point_domain == "offset" and str(Q4_1) == "uint4 g32 asym(offset zp)"
    assert qt.QuantSpec.from_dict(json.loads(json.dumps(Q4_1.to_dict()))) == Q4_1
    assert ZERO_POINT_DOMAINS == ("int", "float", "offset")


@pytest.mark.parametrize("kwargs, match", [
    ({"format": "uint4", "zero_point_domain": "offset"}, "contradicts symmetric=True"),
    ({"format": "uint4", "symmetric": False, "zero_point_domain": "offset", "power_of_two": True},
     "offset zero point"),
    ({"format": "uint4", "symmetric": False, "zero_point_domain": "offset", "scale_dtype": "e8m0"}, "offset zero point"),
    ({"format": "uint4", "symmetric": False, "zero_point_domain": "shift"}, "'offset'"),
])
def test_offset_contradictions_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        qt.QuantSpec(**kwargs)


def test_given_parameters_reproduce_d_q_plus_m_bit_for_bit():
    d, m, q, x = _random_q4_1(64, 8)
    qp = qt.QParams(scale=torch.from_numpy(d), zero_point=torch.from_numpy(m), spec=Q4_1)
    qt_ = qt.quantize(torch.from_numpy(x), qp)
    assert np.array_equal(qt.unpacked_codes(qt_).numpy(), q)
    y = qt.dequantize(qt_)
    assert torch.equal(y.view(torch.int32), torch.from_numpy(x).view(torch.int32))


def test_gguf_package_dequantizes_the_same_bits():
    quants = pytest.importorskip("gguf.quants")
    gguf = pytest.importorskip("gguf")
    d, m, q, x = _random_q4_1(16, 4, seed=1, zero_block=True)
    # Q4_1 blocks: fp16 d, fp16 m, 16 bytes (element j in the low nibble of byte j, j + 16 in the high one)
    qb = q.reshape(-1, 32)
    nib = (qb[:, :16] | (qb[:, 16:] << 4)).astype(np.uint8)
    raw = np.concatenate([d.reshape(-1, 1).view(np.uint8), m.reshape(-1, 1).view(np.uint8), nib], axis=1)
    ref = quants.dequantize(raw.reshape(16, -1), gguf.GGMLQuantizationType.Q4_1)
    qp = qt.QParams(scale=torch.from_numpy(d), zero_point=torch.from_numpy(m), spec=Q4_1)
    y = qt.dequantize(qt.QTensor(codes=qt.pack(torch.from_numpy(q), 4), qparams=qp, width=128, dtype=torch.float32))
    assert np.array_equal(y.numpy().view(np.int32), ref.astype(np.float32).view(np.int32))
    assert np.array_equal(y.numpy().view(np.int32), x.view(np.int32))


def test_the_float_zero_point_cannot_store_d_q_plus_m():
    """Why the offset exists: the same blocks as ``(q - z) * d`` with an fp16 ``z = -m / d`` are mostly off."""
    d, m, q, x = _random_q4_1(64, 8, seed=2)
    spec = Q4_1.replace(zero_point_domain="float")
    ok = d != 0
    z = np.where(ok, -m.astype(np.float32) / np.where(ok, d.astype(np.float32), 1), 0).astype(np.float16)
    qp = qt.QParams(scale=torch.from_numpy(d), zero_point=torch.from_numpy(z), spec=spec)
    y = qt.dequantize(qt.QTensor(codes=qt.pack(torch.from_numpy(q), 4), qparams=qp, width=q.shape[1],
                                 dtype=torch.float32)).numpy()
    exact = (y == x)[np.repeat(ok, 32, axis=1)]
    assert exact.mean() < 0.5


@pytest.mark.parametrize("fmt", ["uint4", "uint8", "int4", "uint3"])
@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16", "float32"])
def test_chosen_parameters_never_clip_and_stay_within_the_bound(fmt, scale_dtype):
    from qtransform.testing import assert_within_bound
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 96, generator=g) * 0.1 + 0.03
    x[0, :32] = 0.1  # a constant block (0.1 is not an fp16 number)
    spec = qt.QuantSpec(format=fmt, granularity=qt.PerGroup(32), symmetric=False, zero_point_domain="offset",
                        scale_dtype=scale_dtype)
    qp = qt.choose_qparams(x, spec)
    assert qp.scale.dtype == qp.zero_point.dtype == {"float16": torch.float16, "bfloat16": torch.bfloat16,
                                                       "float32": torch.float32}[scale_dtype]
    lo, hi = spec.fmt.codec.qrange(symmetric=False, restricted=False)
    s, m = qp.scale.float().repeat_interleave(32, 1), qp.zero_point.float().repeat_interleave(32, 1)
    s, m = s.double(), m.double()
    ulp = (m.abs() + 16 * s) * 2.0 ** -22  # a float32 scale and offset are kept as computed: an ulp off
    assert bool((x >= lo * s + m - ulp).all()) and bool((x <= hi * s + m + ulp).all())  # the range holds every value
    assert_within_bound(x, qp)
    y = qt.dequantize(qt.quantize(x, qp))
    assert float((y - x).abs().max()) <= float(s.max()) / 2 * (1 + 2 ** -10) + float(ulp.max())


def test_offset_beyond_the_scale_dtype_is_refused():
    x = torch.full((1, 32), 1e6)
    x[0, 0] = 1e6 + 1
    with pytest.raises(ValueError, match="offset .* scale_dtype='float16'"):
        qt.choose_qparams(x, Q4_1)


def test_fake_quantize_gradients_and_vmap():
    x = torch.randn(4, 64, requires_grad=True)
    qp = qt.choose_qparams(x.detach(), Q4_1)
    m = qp.zero_point.float().requires_grad_(True)
    s = qp.scale.float().requires_grad_(True)
    y = qt.fake_quantize(x, qt.QParams(scale=s, zero_point=m, spec=Q4_1.replace(scale_dtype="float32")))
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))  # nothing clips
    # straight through: d(round(v) * s + m)/dm = -1 + 1 = 0 inside the range; d/ds = round(v) - v (LSQ)
    assert torch.equal(m.grad, torch.zeros_like(m))
    v = (x.detach() - m.detach().repeat_interleave(32, 1)) / s.detach().repeat_interleave(32, 1)
    expected = (v.round() - v).reshape(4, 2, 32).sum(-1)
    assert torch.allclose(s.grad, expected, atol=1e-4)
    ref = qt.dequantize(qt.quantize(x.detach(), qp))
    assert torch.equal(qt.fake_quantize(x.detach(), qp), ref)
    batched = torch.func.vmap(lambda t: qt.dequantize(qt.quantize(t, qt.choose_qparams(t, Q4_1))))(
        x.detach().reshape(2, 2, 64))
    assert torch.equal(batched.reshape(4, 64), ref)


def test_mse_observer_fits_offset_parameters():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(4))
    x[0, 3] = 8.0  # an outlier the search may clip
    from qtransform.testing import assert_within_bound
    qp = qt.choose_qparams(x, Q4_1, observer="mse")
    assert qp.zero_point.dtype == torch.float16
    assert_within_bound(x, qp)
    plain = qt.choose_qparams(x, Q4_1)
    err = lambda p: float((qt.dequantize(qt.quantize(x, p)) - x).pow(2).sum())  # noqa: E731
    assert err(qp) <= err(plain) * (1 + 1e-6)

"""Hand-checked integer and NF4 quantization examples (expected values computed by hand)."""

import torch

import qtransform as qt


def _q(x, **kw):
    spec = qt.QuantSpec(**kw)
    qp = qt.choose_qparams(x, spec)
    q = qt.quantize(x, qp)
    return qp, qt.unpacked_codes(q), qt.dequantize(q)


def test_int8_symmetric_full_range_divides_by_127_5():
    x = torch.tensor([-2.55, 0.0, 1.0, 2.55])
    qp, codes, _ = _q(x, format="int8")
    assert qp.scale.item() == torch.tensor(2.55 / 127.5).item()
    # 2.55 / 0.02 = 127.5 -> rounds to 128 (half to even) -> saturates to 127; -127.5 -> -128
    assert codes.tolist() == [-128, 0, 50, 127]


def test_int8_symmetric_restricted_divides_by_127_and_never_uses_minus_128():
    x = torch.tensor([-1.27, 0.5, 1.27])
    qp, codes, y = _q(x, format="int8", symmetric_range="restricted")
    assert abs(qp.scale.item() - 0.01) < 1e-9
    assert codes.tolist() == [-127, 50, 127]
    torch.testing.assert_close(y, x)


def test_uint8_asymmetric_integer_zero_point():
    x = torch.tensor([-1.0, 0.0, 3.0])
    qp, codes, y = _q(x, format="uint8", symmetric=False)
    # scale = 4 / 255; zero_point = 0 - round(-1 / scale) = round(63.75) = 64
    assert abs(qp.scale.item() - 4 / 255) < 1e-8 and qp.zero_point.item() == 64
    assert codes.tolist() == [0, 64, 255]
    assert y[1].item() == 0.0  # zero is exactly representable with an integer zero point


def test_integer_zero_point_range_always_contains_zero():
    x = torch.tensor([2.0, 3.0, 4.0])
    qp, codes, _ = _q(x, format="uint8", symmetric=False)
    assert qp.zero_point.item() == 0 and abs(qp.scale.item() - 4 / 255) < 1e-8


def test_float_zero_point_fits_min_max_exactly():
    x = torch.tensor([2.0, 3.1, 4.0])
    qp, codes, y = _q(x, format="uint4", symmetric=False, zero_point_domain="float")
    # scale = 2 / 15; zero_point = -2 / scale = -15 (not rounded, range need not hold 0)
    assert abs(qp.scale.item() - 2 / 15) < 1e-7 and abs(qp.zero_point.item() + 15) < 1e-5
    assert codes.tolist() == [0, 8, 15]  # 3.1 / scale - 15 = 8.25
    torch.testing.assert_close(y[[0, 2]], x[[0, 2]])


def test_unsigned_symmetric_uses_the_mid_range_zero_point():
    x = torch.tensor([-1.5, 0.0, 1.5])
    qp, codes, _ = _q(x, format="uint4")
    assert qp.zero_point.item() == 8 and abs(qp.scale.item() - 0.2) < 1e-7
    assert codes.tolist() == [0, 8, 15]


def test_int2_restricted_is_ternary():
    x = torch.tensor([-1.0, -0.4, 0.2, 0.6, 1.0])
    _, codes, y = _q(x, format="int2", symmetric_range="restricted")
    assert codes.tolist() == [-1, 0, 0, 1, 1]
    assert y.tolist() == [-1.0, 0.0, 0.0, 1.0, 1.0]


def test_per_group_scales_have_the_grid_shape():
    x = torch.arange(16.0).reshape(2, 8) - 7
    qp, _, _ = _q(x, format="int4", granularity=qt.PerGroup(4))
    assert qp.scale.shape == (2, 2)
    # group amaxes: |-7..-4| = 7, |-3..0| = 3, |1..4| = 4, |5..8| = 8
    torch.testing.assert_close(qp.scale.flatten(), torch.tensor([7, 3, 4, 8]) / 7.5)


def test_per_block_and_per_channel_axis():
    x = torch.arange(32.0).reshape(4, 8)
    qp, _, _ = _q(x, format="int8", granularity=qt.PerBlock((2, 4)))
    assert qp.scale.shape == (2, 2)
    torch.testing.assert_close(qp.scale.flatten(), torch.tensor([11, 15, 27, 31]) / 127.5)
    qp, _, _ = _q(x, format="int8", granularity=qt.PerChannel(1))
    assert qp.scale.shape == (1, 8)
    torch.testing.assert_close(qp.scale.flatten(), torch.arange(24.0, 32.0) / 127.5)


def test_group_along_axis_0():
    x = torch.tensor([[1.0, -8.0], [2.0, 4.0], [-3.0, 0.5], [0.0, 1.0]])
    qp, _, _ = _q(x, format="int4", granularity=qt.PerGroup(2, axis=0))
    assert qp.scale.shape == (2, 2)
    torch.testing.assert_close(qp.scale, torch.tensor([[2.0, 8.0], [3.0, 1.0]]) / 7.5)


def test_nf4_rounds_to_the_nearest_codebook_entry():
    table = torch.tensor(qt.formats.NF4_VALUES)
    x = torch.cat([table, torch.tensor([0.95, 0.03, -0.61])]).reshape(1, -1)
    spec = qt.QuantSpec(format="nf4", granularity=qt.PerChannel(0))
    qp = qt.choose_qparams(x, spec)
    assert qp.scale.item() == 1.0 and qp.zero_point is None
    codes = qt.unpacked_codes(qt.quantize(x, qp)).flatten().tolist()
    assert codes[:16] == list(range(16))
    # 0.95 is nearest to 1.0 (15); 0.03 nearest to 0.0 (7) rather than 0.0796;
    # -0.61: |-0.61 + 0.6962| = 0.0862 > |-0.61 + 0.5251| = 0.0849, so code 2
    assert codes[16:] == [15, 7, 2]


def test_scale_dtypes_round_up_so_nothing_extra_clips():
    x = torch.tensor([[0.1, -0.3, 1.0 / 3.0]])
    for dtype in ("float16", "bfloat16"):
        qp = qt.choose_qparams(x, qt.QuantSpec(format="int8", scale_dtype=dtype))
        assert qp.scale.dtype == getattr(torch, dtype)
        assert qp.scale.float().item() >= (1.0 / 3.0) / 127.5


def test_power_of_two_scales():
    x = torch.tensor([[3.0, -1.0]])
    ceil = qt.choose_qparams(x, qt.QuantSpec(format="int8", power_of_two=True))
    assert ceil.scale.item() == 2.0 ** -5  # smallest 2^k >= 3 / 127.5
    floor = qt.choose_qparams(x, qt.QuantSpec(format="int8", power_of_two=True, scale_rule="floor"))
    assert floor.scale.item() == 2.0 ** (1 - 6)  # floor(log2 3) - emax(int8) = 1 - 6
    e8m0 = qt.choose_qparams(x, qt.QuantSpec(format="int8", scale_dtype="e8m0"))
    assert e8m0.scale.dtype == torch.uint8 and e8m0.scale.item() == 127 - 5

"""Minifloat element formats (fp8, fp6, fp4, fp16, bf16, a user e3m4): exact against references.

References: torch's own casts (float8 dtypes, float16, bfloat16, float4_e2m1fn_x2 where the
build can cast to it, else torchao's fp4 encoder), and a brute-force textbook model
(tests/minifloat_reference.py) that shares no code with qtransform.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import qtransform as qt
from qtransform.formats import MinifloatCodec

import minifloat_reference as ref

# the user-defined format, defined as a user would (registered below for this module only)
E3M4 = qt.minifloat("fp8_e3m4", exponent_bits=3, mantissa_bits=4)


@pytest.fixture(scope="module", autouse=True)
def _user_format():
    with ref.registered(E3M4):
        yield

SMALL = ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1", "fp8_e3m4"]
TORCH_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
             "fp8_e4m3fnuz": torch.float8_e4m3fnuz, "fp8_e5m2fnuz": torch.float8_e5m2fnuz}


def _codec(name) -> MinifloatCodec:
    return qt.FORMATS[name].codec


def _model(c: MinifloatCodec):
    return c.exponent_bits, c.mantissa_bits, c.bias, c.special


def _bits(codes: torch.Tensor) -> np.ndarray:
    if codes.is_floating_point():
        codes = codes.view(torch.int16 if codes.element_size() == 2 else torch.uint8)
    return codes.to(torch.int64).numpy() & 0xFFFF


def _same(a, b) -> bool:
    """Equal values, NaN equal to NaN."""
    with np.errstate(invalid="ignore"):
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        return bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


# ---------------------------------------------------------------- the format table
@pytest.mark.parametrize("name, max_value, emax, bits", [
    ("fp8_e4m3", 448.0, 8, 8), ("fp8_e5m2", 57344.0, 15, 8), ("fp8_e4m3fnuz", 240.0, 7, 8),
    ("fp8_e5m2fnuz", 57344.0, 15, 8), ("fp6_e3m2", 28.0, 4, 6), ("fp6_e2m3", 7.5, 2, 6),
    ("fp4_e2m1", 6.0, 2, 4), ("bf16", 3.3895313892515355e38, 127, 16), ("fp16", 65504.0, 15, 16),
])
def test_format_constants(name, max_value, emax, bits):
    c = _codec(name)
    assert (c.max_value, c.emax, c.bits) == (max_value, emax, bits)
    assert qt.FORMATS[name].codec.qrange(symmetric=True, restricted=False) == (-max_value, max_value)


def test_fp8_max_matches_torch_finfo():
    for name, dtype in TORCH_FP8.items():
        assert _codec(name).max_value == torch.finfo(dtype).max


# ---------------------------------------------------------------- decode
@pytest.mark.parametrize("name", SMALL + ["fp16", "bf16"])
def test_every_code_decodes_to_its_value(name):
    c = _codec(name)
    expected = ref.values(*_model(c))
    codes = torch.arange(1 << c.bits, dtype=torch.int32)
    assert _same(c.decode_bits(codes).numpy(), expected)
    stored = codes.to(torch.int16 if c.bits == 16 else torch.uint8)
    if c.storage is not None:
        stored = stored.view(c.storage)
    assert _same(c.decode(stored).numpy(), expected)


@pytest.mark.parametrize("name", list(TORCH_FP8))
def test_fp8_decode_table_is_torchs(name):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(TORCH_FP8[name])
    assert _same(_codec(name).decode_bits(codes).numpy(), codes.to(torch.float32).numpy())


# ---------------------------------------------------------------- encode: exhaustive
@pytest.mark.parametrize("name", SMALL)
def test_encode_matches_bruteforce_model(name):
    c = _codec(name)
    pts = ref.test_points(*_model(c))
    expected = ref.round_codes(pts.astype(np.float64), *_model(c))
    x = torch.from_numpy(pts)
    hi = c.max_value
    assert np.array_equal(_bits(c.encode_bits(x.clone(), rounding="half_even", hi=hi)), expected)
    assert np.array_equal(_bits(c.encode(x.clone(), rounding="half_even", hi=hi)), expected)
    rounded = c.round(x, rounding="half_even", lo=-hi, hi=hi).numpy()
    assert _same(rounded, ref.values(*_model(c))[expected])


@pytest.mark.parametrize("name", list(TORCH_FP8))
def test_fp8_bit_exact_with_torch_casts(name):
    """Every representable value, every midpoint and the floats next to them, within range."""
    c, dtype = _codec(name), TORCH_FP8[name]
    pts = torch.from_numpy(ref.test_points(*_model(c)))
    pts = pts[pts.abs() <= c.max_value]
    torch_codes = pts.to(dtype).view(torch.uint8)
    ours = c.encode_bits(pts.clone(), rounding="half_even", hi=c.max_value)
    assert torch.equal(ours.view(torch.uint8), torch_codes)
    assert torch.equal(c.round(pts, rounding="half_even", hi=c.max_value), pts.to(dtype).to(torch.float32))


def _torch_fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """fp4 codes from torch's float4_e2m1fn_x2 cast where this build has one, else torchao's encoder."""
    try:
        packed = x.reshape(-1, 2).to(torch.float4_e2m1fn_x2).view(torch.uint8)
        return qt.unpack(packed.reshape(1, -1), 4, x.numel()).reshape(-1)
    except (RuntimeError, NotImplementedError, TypeError):
        from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked
        return f32_to_f4_unpacked(x)


def test_fp4_bit_exact_with_torch_reference():
    c = _codec("fp4_e2m1")
    pts = torch.from_numpy(ref.test_points(*_model(c)))
    pts = pts[pts.abs() <= 6.0]
    pts = torch.cat([pts, pts[:1]]) if pts.numel() % 2 else pts
    ours = c.encode_bits(pts.clone(), rounding="half_even", hi=6.0)
    assert torch.equal(ours, _torch_fp4_codes(pts).to(torch.uint8))


@pytest.mark.parametrize("name, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_casts_bit_exact_with_torch(name, dtype):
    c = _codec(name)
    allv = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype).to(torch.float32)
    v = allv[torch.isfinite(allv)].unique()
    mids = (v[1:].double() + v[:-1].double()) / 2
    mids = mids[(mids.float().double() == mids)].float()  # exactly representable midpoints
    x = torch.cat([v, mids, mids.nextafter(torch.tensor(math.inf)), mids.nextafter(torch.tensor(-math.inf)),
                   torch.randn(10000) * 100])
    x = x[x.abs() <= c.max_value]
    torch_bits = x.to(dtype).view(torch.int16)
    assert torch.equal(c.encode_bits(x.clone(), rounding="half_even", hi=c.max_value).view(torch.int16), torch_bits)
    assert torch.equal(c.encode(x.clone(), rounding="half_even", hi=c.max_value).view(torch.int16), torch_bits)


def test_subnormals_kept():
    c = _codec("fp8_e4m3")
    assert c.round(torch.tensor([2.0 ** -9, 3 * 2.0 ** -9, 2.0 ** -10]), rounding="half_even").tolist() == \
        [2.0 ** -9, 3 * 2.0 ** -9, 0.0]  # the smallest subnormal, one more, and a tie to zero
    f4 = _codec("fp4_e2m1")
    assert f4.round(torch.tensor([0.3, 0.25, 0.75]), rounding="half_even").tolist() == [0.5, 0.0, 1.0]


# ---------------------------------------------------------------- rounding options
def test_half_away_rounds_ties_away_from_zero():
    c = _codec("fp4_e2m1")
    x = torch.tensor([0.25, 1.25, 2.5, 5.0, -0.25, -2.5, 0.74])
    assert c.round(x, rounding="half_away", hi=6.0).tolist() == [0.5, 1.5, 3.0, 6.0, -0.5, -3.0, 0.5]
    codes = c.encode_bits(x.clone(), rounding="half_away", hi=6.0)
    assert c.decode(codes).tolist() == [0.5, 1.5, 3.0, 6.0, -0.5, -3.0, 0.5]


def test_stochastic_rounding_picks_a_neighbour_with_the_right_odds():
    c = _codec("fp8_e4m3")
    x = torch.full((4,), 1.0 + 0.3 * 2 ** -3)  # 30% of the way from 1.0 to 1.125
    noise = torch.tensor([0.0, 0.69, 0.71, 0.999])
    assert c.round(x, rounding="stochastic", noise=noise).tolist() == [1.0, 1.0, 1.125, 1.125]
    gen = torch.Generator().manual_seed(0)
    many = c.round(torch.full((20000,), 1.0 + 0.3 * 2 ** -3), rounding="stochastic",
                   noise=torch.rand(20000, generator=gen))
    assert set(many.unique().tolist()) == {1.0, 1.125}
    assert abs((many == 1.125).float().mean().item() - 0.3) < 0.02


# ---------------------------------------------------------------- saturation and overflow
def test_saturating_by_default():
    x = torch.tensor([1000.0, -1e30, 464.0])
    codec = _codec("fp8_e4m3")
    assert codec.round(x, rounding="half_even", lo=-448.0, hi=448.0).tolist() == [448.0, -448.0, 448.0]


def test_non_saturating_overflow_ieee_style():
    e5m2, e4m3, fnuz, e3m2 = (_codec(n) for n in ("fp8_e5m2", "fp8_e4m3", "fp8_e4m3fnuz", "fp6_e3m2"))
    x = torch.tensor([61439.0, 61440.0, 1e6, -1e6])
    assert e5m2.round(x, rounding="half_even").tolist() == [57344.0, math.inf, math.inf, -math.inf]
    assert _bits(e5m2.encode_bits(x.clone(), rounding="half_even")).tolist() == [0x7B, 0x7C, 0x7C, 0xFC]
    y = torch.tensor([464.0, 465.0, -1e6])  # 464 ties down to 448; beyond it, NaN (no Inf in e4m3fn)
    assert _bits(e4m3.encode_bits(y.clone(), rounding="half_even")).tolist() == [0x7E, 0x7F, 0xFF]
    assert _bits(fnuz.encode_bits(torch.tensor([1e6, -1e6, -1e-9]), rounding="half_even")).tolist() == [0x80, 0x80, 0]
    assert e3m2.overflow is None  # fp6/fp4 encode neither Inf nor NaN
    with pytest.raises(ValueError, match="always saturates"):
        qt.QuantSpec(format="fp4_e2m1", saturate=False)


def test_non_saturating_spec_end_to_end():
    spec = qt.QuantSpec(format="fp8_e5m2", saturate=False)
    qp = qt.choose_qparams(torch.tensor([1.0, -2.0]), spec)
    y = qt.dequantize(qt.quantize(torch.tensor([1.0, 1e9]), qp))
    assert y[0].item() == 1.0 and y[1].item() == math.inf


# ---------------------------------------------------------------- scaled use
@pytest.mark.parametrize("granularity", [qt.PerTensor(), qt.PerChannel(0), qt.PerGroup(32),
                                         qt.PerBlock((128, 128))])
def test_fp8_scaled_granularities(granularity):
    torch.manual_seed(0)
    w = torch.randn(256, 384) * torch.rand(256, 1) * 10
    spec = qt.QuantSpec(format="fp8_e4m3", granularity=granularity)
    qp = qt.choose_qparams(w, spec)
    q = qt.quantize(w, qp)
    assert q.codes.dtype == torch.float8_e4m3fn and q.codes.shape == w.shape
    block = granularity.block_size(w.shape)
    amax = w.abs().reshape(w.shape[0] // block[0], block[0], w.shape[1] // block[1], block[1]).amax((1, 3))
    assert torch.allclose(qp.scale, amax / 448.0, rtol=0, atol=0)
    y = qt.dequantize(q)
    assert bool(((y - w).abs() <= qt.error_bound(w, qp) * (1 + 1e-6)).all())
    assert bool(((y - w).abs() <= w.abs() * 2.0 ** -4 + qp.scale.amax() * 2.0 ** -10).all())


def test_zero_amax_gives_a_positive_scale():
    for name in ("fp8_e4m3", "fp4_e2m1", "fp6_e2m3"):
        z = torch.zeros(4, 64)
        qp = qt.choose_qparams(z, qt.QuantSpec(format=name, granularity=qt.PerGroup(32)))
        assert bool((qp.scale > 0).all()) and bool(torch.isfinite(qp.scale).all())
        assert torch.equal(qt.dequantize(qt.quantize(z, qp)), z)


def test_storage_containers():
    x = torch.randn(4, 24)
    for name, dtype, width in (("fp8_e4m3", torch.float8_e4m3fn, 24), ("fp8_e5m2fnuz", torch.float8_e5m2fnuz, 24),
                               ("fp6_e2m3", torch.uint8, 18), ("fp4_e2m1", torch.uint8, 12),
                               ("bf16", torch.bfloat16, 24), ("fp8_e3m4", torch.uint8, 24)):
        q = qt.quantize(x, qt.choose_qparams(x, qt.QuantSpec(format=name)))
        assert q.codes.dtype == dtype and q.codes.shape == (4, width), name


def test_fp4_packing_low_nibble_first():
    c = _codec("fp4_e2m1")
    x = torch.tensor([[0.5, -6.0, 1.0, 3.0]])
    q = qt.quantize(x, qt.QParams(scale=torch.ones(1, 1), spec=qt.QuantSpec(format="fp4_e2m1")))
    # codes 0x1, 0xF, 0x2, 0x5 -> bytes 0xF1, 0x52
    assert q.codes.tolist() == [[0xF1, 0x52]]
    assert c.decode(qt.unpacked_codes(q)).tolist() == [[0.5, -6.0, 1.0, 3.0]]


def test_fp6_packs_four_codes_in_three_bytes():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    q = qt.quantize(x, qt.QParams(scale=torch.ones(1, 1), spec=qt.QuantSpec(format="fp6_e3m2")))
    codes = [0x0C, 0x10, 0x12, 0x14]  # e3m2, bias 3: 1.0 = 011.00, 2 = 100.00, 3 = 100.10, 4 = 101.00
    stream = sum(c << (6 * i) for i, c in enumerate(codes))
    assert q.codes.tolist() == [[stream & 0xFF, (stream >> 8) & 0xFF, stream >> 16]]


# ---------------------------------------------------------------- user formats and bad input
def test_user_format_behaves_like_builtins():
    c = E3M4.codec
    assert (c.bits, c.max_value, c.emin, c.mantissa_bits) == (8, 31.0, -2, 4)
    x = torch.randn(8, 64) * 5
    qp = qt.choose_qparams(x, qt.QuantSpec(format="fp8_e3m4"))
    y = qt.dequantize(qt.quantize(x, qp))
    assert bool(((y - x).abs() <= qt.error_bound(x, qp) * (1 + 1e-6)).all())


@pytest.mark.parametrize("kwargs, error", [
    (dict(exponent_bits=0, mantissa_bits=3), ValueError),
    (dict(exponent_bits=4, mantissa_bits=11), ValueError),
    (dict(exponent_bits=3, mantissa_bits=2, special="weird"), ValueError),
    (dict(exponent_bits=3, mantissa_bits=0, special="fn"), ValueError),
    (dict(exponent_bits=8, mantissa_bits=7, bias=100, special="ieee"), ValueError),
    (dict(exponent_bits=3.0, mantissa_bits=2), TypeError),
    (dict(exponent_bits=4, mantissa_bits=3, storage=torch.float16), ValueError),
    (dict(exponent_bits=4, mantissa_bits=3, bias=7, special="fn", storage=torch.float8_e4m3fnuz), ValueError),
])
def test_bad_minifloat_definitions(kwargs, error):
    with pytest.raises(error, match="MinifloatCodec"):
        qt.minifloat("bad_format", **kwargs)


def test_bad_inputs_are_named():
    spec = qt.QuantSpec(format="fp8_e4m3")
    with pytest.raises(ValueError, match="unknown format 'fp8_e9m9'"):
        qt.QuantSpec(format="fp8_e9m9")
    with pytest.raises(TypeError, match="floating-point"):
        qt.choose_qparams(torch.arange(8), spec)
    x = torch.randn(2, 8)
    qp = qt.choose_qparams(x, spec)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[1, 3] = bad
        with pytest.raises(ValueError, match=r"non-finite .*index \(1, 3\)"):
            qt.quantize(y, qp)
    with pytest.raises(ValueError, match="symmetric only"):
        qt.QuantSpec(format="fp8_e4m3", symmetric=False)

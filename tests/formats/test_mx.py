"""OCP MX formats: shared exponents by the spec's formula and Quark's rule, storage, padding,
bad input, and agreement with torchao's MX implementation (Quark's in test_peers_quark.py)."""

from __future__ import annotations

import math
import struct

import pytest
import torch

import qtransform as qt
from qtransform.formats import to_e8m0

MX = {  # name: (emax, mantissa bits, max element) from the OCP MX v1.0 spec, table 1 / 6.3
    "mxfp8_e4m3": (8, 3, 448.0), "mxfp8_e5m2": (15, 2, 57344.0), "mxfp6_e3m2": (4, 2, 28.0),
    "mxfp6_e2m3": (2, 3, 7.5), "mxfp4": (2, 1, 6.0), "mxint8": (0, 6, 127 / 64),
}


def _floor_log2(a: float) -> int:
    return math.frexp(a)[1] - 1


def _spec_floor_exponent(amax: float, emax: int) -> int:
    """OCP MX v1.0 section 6.3: X = 2^(floor(log2(amax)) - emax_elem), clamped to E8M0."""
    return -127 if amax == 0 else max(-127, min(127, _floor_log2(amax) - emax))


def _quark_even_exponent(amax: float, emax: int, mbits: int) -> int:
    """Quark's even rule, from its description: add half an ulp at the element's mantissa width to
    the float32 bit pattern of amax, drop the mantissa, then floor(log2) - emax."""
    if amax == 0:
        return -127
    bits = struct.unpack("<I", struct.pack("<f", amax))[0]
    bits = (bits + (1 << (23 - mbits - 1))) & 0xFF800000
    rounded = struct.unpack("<f", struct.pack("<I", bits))[0]  # 0 for small subnormals: log2 -> -inf
    return -127 if rounded == 0 else max(-127, min(127, _floor_log2(rounded) - emax))


def _blocks_with_amax(amaxes: list[float]) -> torch.Tensor:
    """One 32-element block per amax: the amax first, then smaller values."""
    rows = []
    for a in amaxes:
        rows.append(torch.cat([torch.tensor([a]), torch.linspace(-a, a, 33)[1:32] * 0.5]))
    return torch.stack(rows)


@pytest.mark.parametrize("name", list(MX))
@pytest.mark.parametrize("rule", ["floor", "even"])
def test_shared_exponent_matches_spec_and_quark(name, rule):
    emax, mbits, _ = MX[name]
    gen = torch.Generator().manual_seed(1)
    amax = torch.exp2(torch.empty(300).uniform_(-140, 120, generator=gen)) * (1 + torch.rand(300, generator=gen))
    amax = torch.cat([amax, torch.tensor([0.0, 1.0, 1.5, 1.75, 1.875, 1.9375, 1.9921875, 2 ** -130])])
    x = _blocks_with_amax(amax.tolist())
    qp = qt.choose_qparams(x, qt.QuantSpec(format=name, scale_rule=rule))
    got = (qp.scale.to(torch.int32) - 127).flatten().tolist()
    a32 = x.abs().amax(1).tolist()
    if rule == "floor":
        expected = [_spec_floor_exponent(a, emax) for a in a32]
    else:
        expected = [_quark_even_exponent(a, emax, mbits) for a in a32]
    assert got == expected


@pytest.mark.parametrize("name, threshold", [
    ("mxfp4", 1.75), ("mxfp6_e3m2", 1.875), ("mxfp8_e5m2", 1.875), ("mxfp6_e2m3", 1.9375),
    ("mxfp8_e4m3", 1.9375), ("mxint8", 1.9921875),
])
@pytest.mark.parametrize("k", [-3, 0, 5])
def test_even_rule_thresholds_by_hand(name, threshold, k):
    """Under 'even' the exponent goes up exactly when amax's significand reaches 2 - 2^-(m+1)."""
    emax = MX[name][0]
    at = threshold * 2.0 ** k
    below = torch.nextafter(torch.tensor(at), torch.tensor(0.0)).item()  # the float32 just below
    x = _blocks_with_amax([at, below])
    even = qt.choose_qparams(x, qt.QuantSpec(format=name, scale_rule="even")).scale.flatten().tolist()
    floor = qt.choose_qparams(x, qt.QuantSpec(format=name, scale_rule="floor")).scale.flatten().tolist()
    assert [e - 127 for e in even] == [k + 1 - emax, k - emax]
    assert [e - 127 for e in floor] == [k - emax, k - emax]


@pytest.mark.parametrize("name", list(MX))
def test_even_rule_never_saturates_floor_may(name):
    emax, _, top = MX[name]
    amax = 1.999 * 2.0 ** 3  # significand above every threshold
    x = _blocks_with_amax([amax])
    even = qt.choose_qparams(x, qt.QuantSpec(format=name, scale_rule="even"))
    scale = 2.0 ** (even.scale.item() - 127)
    assert amax / scale <= top
    floor = qt.choose_qparams(x, qt.QuantSpec(format=name))
    assert floor.scale.item() - 127 == 3 - emax


def test_ceil_rule_is_the_smallest_power_of_two_that_does_not_clip():
    x = _blocks_with_amax([6.0, 6.0001, 3.0, 0.0])
    qp = qt.choose_qparams(x, qt.QuantSpec(format="mxfp4", scale_rule="ceil"))
    assert [e - 127 for e in qp.scale.flatten().tolist()] == [0, 1, -1, -127]
    y = qt.dequantize(qt.quantize(x, qp))
    assert y[0, 0].item() == 6.0 and y[1, 0].item() == 6.0  # 6.0001 / 2 rounds to 3, times 2: no clipping


def test_default_spec_is_blocks_of_32_on_the_last_axis():
    spec = qt.QuantSpec(format="mxfp4")
    assert spec.granularity == qt.PerGroup(32, axis=-1)
    assert spec.scale_dtype == "e8m0" and spec.scale_rule == "floor" and spec.power_of_two and spec.pad


@pytest.mark.parametrize("name, codes_dtype, codes_width", [
    ("mxfp8_e4m3", torch.float8_e4m3fn, 64), ("mxfp8_e5m2", torch.float8_e5m2, 64),
    ("mxfp6_e3m2", torch.uint8, 48), ("mxfp6_e2m3", torch.uint8, 48), ("mxfp4", torch.uint8, 32),
    ("mxint8", torch.int8, 64),
])
def test_storage(name, codes_dtype, codes_width):
    x = torch.randn(5, 64)
    q = qt.quantize(x, qt.choose_qparams(x, qt.QuantSpec(format=name)))
    assert q.codes.dtype == codes_dtype and tuple(q.codes.shape) == (5, codes_width)
    assert q.qparams.scale.dtype == torch.uint8 and tuple(q.qparams.scale.shape) == (5, 2)
    assert q.qparams.zero_point is None and q.qparams.global_scale is None
    assert q.bits_per_element() == qt.bits_per_element(q.spec, x.shape) == qt.bits_per_element(q.spec)


def test_padding_never_leaks():
    torch.manual_seed(0)
    x = torch.randn(3, 45)
    x[:, 40] = 50.0  # a large value in the partial block
    spec = qt.QuantSpec(format="mxfp4")
    qp = qt.choose_qparams(x, spec)
    assert tuple(qp.scale.shape) == (3, 2)
    expected = [[_spec_floor_exponent(x[r, :32].abs().max().item(), 2),
                 _spec_floor_exponent(x[r, 32:].abs().max().item(), 2)] for r in range(3)]
    assert (qp.scale.to(torch.int32) - 127).tolist() == expected
    q = qt.quantize(x, qp)
    y = qt.dequantize(q)
    assert y.shape == x.shape and q.width == 45 and q.codes.shape == (3, 23)
    # the same blocks quantized without padding agree elementwise
    full = torch.cat([x, x[:, -1:].expand(3, 19)], 1)
    y_full = qt.dequantize(qt.quantize(full, qt.choose_qparams(full, spec)))
    assert torch.equal(y, y_full[:, :45])


def test_blocks_along_axis_0():
    torch.manual_seed(0)
    x = torch.randn(64, 10)
    spec0 = qt.QuantSpec(format="mxfp6_e2m3", granularity=qt.PerGroup(32, axis=0))
    y0 = qt.dequantize(qt.quantize(x, qt.choose_qparams(x, spec0)))
    yt = qt.dequantize(qt.quantize(x.T.contiguous(), qt.choose_qparams(x.T.contiguous(), qt.QuantSpec(format="mxfp6_e2m3"))))
    assert torch.equal(y0, yt.T)


def test_zero_block_gets_the_smallest_scale():
    x = torch.zeros(2, 32)
    x[1, 5] = 1.0
    qp = qt.choose_qparams(x, qt.QuantSpec(format="mxfp8_e4m3"))
    assert qp.scale.flatten().tolist() == [0, 127 - 8]
    assert torch.equal(qt.dequantize(qt.quantize(x, qp)), x)


def test_scales_are_powers_of_two_in_e8m0_range():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(16, 256, generator=gen) * torch.exp2(torch.empty(16, 1).uniform_(-150, 130, generator=gen))
    for name in MX:
        for rule in ("floor", "even", "ceil"):
            qp = qt.choose_qparams(x, qt.QuantSpec(format=name, scale_rule=rule))
            assert qp.scale.dtype == torch.uint8 and int(qp.scale.max()) <= 254
            s, _ = qp.effective()
            assert bool(((s >= 2.0 ** -127) & (s <= 2.0 ** 127) & (torch.frexp(s)[0] == 0.5)).all())


# ---------------------------------------------------------------- bad input
def test_bad_block_size_and_granularity():
    with pytest.raises(ValueError, match="intrinsic block of 32"):
        qt.QuantSpec(format="mxfp4", granularity=qt.PerGroup(16))
    with pytest.raises(ValueError, match="intrinsic block of 32"):
        qt.QuantSpec(format="mxfp8_e4m3", granularity=qt.PerTensor())
    with pytest.raises(ValueError, match="scale_rule must be one of"):
        qt.QuantSpec(format="mxfp4", scale_rule="nearest")
    with pytest.raises(ValueError, match="does not allow scale_dtype='float32'"):
        qt.QuantSpec(format="mxfp4", scale_dtype="float32")
    with pytest.raises(ValueError, match="symmetric only"):
        qt.QuantSpec(format="mxint8", symmetric=False)


def test_bad_element_format():
    with pytest.raises(ValueError, match="unknown format 'fp5_e9'"):
        qt.mx_format("mxfp5", "fp5_e9")
    with pytest.raises(TypeError, match="element must be a format name or a Codec"):
        qt.mx_format("mxfp5", 5)
    with pytest.raises(ValueError, match="block must be a positive int, got 0"):
        qt.mx_format("mxfp5", "fp4_e2m1", block=0)


def test_bad_input_tensors():
    spec = qt.QuantSpec(format="mxfp4")
    with pytest.raises(TypeError, match="must be a real floating-point tensor, got dtype torch.int32"):
        qt.choose_qparams(torch.ones(2, 32, dtype=torch.int32), spec)
    x = torch.randn(2, 32)
    x[0, 7] = float("inf")
    with pytest.raises(ValueError, match=r"1 non-finite value\(s\) \(first inf at index \(0, 7\)\)"):
        qt.choose_qparams(x, spec)


def test_scales_outside_e8m0_are_refused():
    spec = qt.QuantSpec(format="mxfp4")
    x = torch.randn(2, 32)
    with pytest.raises(TypeError, match="uint8 biased exponents"):
        qt.quantize(x, qt.QParams(scale=torch.ones(2, 1), spec=spec))
    with pytest.raises(ValueError, match="NaN code 255"):
        qt.quantize(x, qt.QParams(scale=torch.tensor([[127], [255]], dtype=torch.uint8), spec=spec))
    assert to_e8m0(torch.tensor([[1.0], [2.0 ** -127]])).tolist() == [[127], [0]]
    for bad in (3.0, 2.0 ** -128, 2.0 ** 128, 0.0, -1.0):
        with pytest.raises(ValueError, match="not a power of two in E8M0's range"):
            to_e8m0(torch.tensor([1.0, bad], dtype=torch.float64))


# ---------------------------------------------------------------- torchao agreement
def _torchao():
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    elems = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2, "mxfp6_e3m2": DTYPE_FP6_E3M2,
             "mxfp6_e2m3": DTYPE_FP6_E2M3, "mxfp4": torch.float4_e2m1fn_x2}
    modes = {"floor": ScaleCalculationMode.FLOOR, "even": ScaleCalculationMode.EVEN,
             "ceil": ScaleCalculationMode.RCEIL}
    return to_mx, to_dtype, elems, modes


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4"])
@pytest.mark.parametrize("rule", ["floor", "even", "ceil"])
def test_agrees_with_torchao_bit_for_bit(name, rule):
    """torchao's FLOOR, EVEN and RCEIL are our floor, even and ceil: same E8M0 scales, same codes."""
    to_mx, to_dtype, elems, modes = _torchao()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=gen) * torch.exp2(torch.empty(64, 1).uniform_(-20, 20, generator=gen))
    x[0, :32] = torch.linspace(-1.75, 1.75, 32)  # an 'even' threshold block
    scale_ao, data_ao = to_mx(x, elems[name], 32, modes[rule])
    q = qt.quantize(x, qt.choose_qparams(x, qt.QuantSpec(format=name, scale_rule=rule)))
    assert torch.equal(q.qparams.scale, scale_ao.view(torch.uint8))
    if name.startswith("mxfp8"):
        assert torch.equal(q.codes.view(torch.uint8), data_ao.view(torch.uint8))
    elif name == "mxfp4":
        assert torch.equal(q.codes, data_ao.view(torch.uint8))  # both pack element 2k in the low nibble
    else:
        assert torch.equal(qt.unpacked_codes(q), data_ao)  # torchao keeps fp6 codes one per byte
    assert torch.equal(qt.dequantize(q), to_dtype(data_ao, scale_ao, elems[name], 32, torch.float32))

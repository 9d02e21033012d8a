"""MX4/MX6/MX9 (shared micro-exponents) and BFP16, checked against a plain-Python model of
Quark's definitions (REFERENCE.md) and by hand."""

from __future__ import annotations

import math

import pytest
import torch

import qtransform as qt

CODE_BITS = {"mx9": 8, "mx6": 5, "mx4": 3}


def _exp(a: float) -> int:
    """float32 exponent field minus 127 (floor(log2 a); -127 for 0 and subnormals), as Quark reads it."""
    return -127 if a < 2.0 ** -126 else math.frexp(a)[1] - 1


def _round_half_even(v: float) -> int:
    return int(round(v))  # Python rounds half to even


def _model_microexp(row: list[float], bits: int) -> list[float]:
    """Quark's MX4/6/9 on one row (length a multiple of 16), element by element."""
    out, qmax = [], 2 ** (bits - 1) - 1
    for b in range(0, len(row), 16):
        block = row[b:b + 16]
        e = _exp(max(abs(v) for v in block))
        for p in range(0, 16, 2):
            pair = block[p:p + 2]
            shift = 1 if all(_exp(abs(v)) <= e - 1 for v in pair) else 0
            step = 2.0 ** (e - shift - bits + 2)
            out += [max(-qmax, min(qmax, _round_half_even(v / step))) * step for v in pair]
    return out


def _model_bfp16(row: list[float]) -> list[float]:
    out = []
    for b in range(0, len(row), 8):
        block = row[b:b + 8]
        amax = max(abs(v) for v in block)
        if amax == 0:
            out += [0.0] * 8
            continue
        k = math.frexp(amax)[1] - 1 - 6
        if any(_round_half_even(v / 2.0 ** k) >= 128 for v in block):
            k += 1
        out += [max(-128, min(127, _round_half_even(v / 2.0 ** k))) * 2.0 ** k for v in block]
    return out


def _data(rows=6, cols=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.exp2(torch.empty(rows, cols // 8).uniform_(-6, 6, generator=gen)
                                                           ).repeat_interleave(8, 1)
    if cols >= 16:
        x[0, :16] = torch.tensor([3.0, 2.9, 0.2, 0.1] + [0.0] * 12)
        x[1, :16] = 0.0
    return x


@pytest.mark.parametrize("name", list(CODE_BITS))
def test_microexp_matches_model(name):
    x = _data()
    y = qt.dequantize(qt.quantize(x, qt.choose_qparams(x, qt.QuantSpec(format=name))))
    expected = torch.tensor([_model_microexp(r, CODE_BITS[name]) for r in x.tolist()])
    assert torch.equal(y, expected)


def test_mx6_block_by_hand():
    x = torch.tensor([[3.0, 2.9, 0.2, 0.1, 2.5, -0.4, 1.9, 0.0] + [0.0] * 8])
    qp = qt.choose_qparams(x, qt.QuantSpec(format="mx6"))
    assert qp.scale.item() == 127 + 1  # amax 3 -> E = 1
    # a pair shifts when both of its exponents are below E: (0.2, 0.1) and (1.9, 0) do, (2.5, -0.4) does not
    assert qt.unpack(qp.micro_exponent, 1, 8).tolist() == [[0, 1, 0, 1, 1, 1, 1, 1]]
    y = qt.dequantize(qt.quantize(x, qp))
    # steps 2^(1-0-3) = 0.25 and 2^(1-1-3) = 0.125: 2.9 -> 12 * 0.25, -0.4 -> -2 * 0.25, 1.9 -> 15 * 0.125
    assert y[0, :7].tolist() == [3.0, 3.0, 0.25, 0.125, 2.5, -0.5, 1.875]


def test_mx9_saturates_at_127():
    x = torch.tensor([[1.999] + [0.5] * 15])  # 1.999 / 2^(0-6) = 127.9 -> 127
    y = qt.dequantize(qt.quantize(x, qt.choose_qparams(x, qt.QuantSpec(format="mx9"))))
    assert y[0, 0].item() == 127 / 64


@pytest.mark.parametrize("name, width, bits", [("mx9", 64, 9.0), ("mx6", 40, 6.0), ("mx4", 24, 4.0)])
def test_microexp_storage(name, width, bits):
    x = _data(rows=4, cols=64)
    q = qt.quantize(x, qt.choose_qparams(x, qt.QuantSpec(format=name)))
    assert tuple(q.codes.shape) == (4, width) and q.codes.dtype == (torch.int8 if name == "mx9" else torch.uint8)
    assert q.qparams.scale.dtype == torch.uint8 and tuple(q.qparams.scale.shape) == (4, 4)
    assert q.qparams.micro_exponent.dtype == torch.uint8 and tuple(q.qparams.micro_exponent.shape) == (4, 4)
    assert q.bits_per_element() == bits == qt.bits_per_element(q.spec)


def test_microexp_along_axis_0_and_padding():
    x = _data(rows=40, cols=8, seed=3)
    spec = qt.QuantSpec(format="mx6", granularity=qt.PerGroup(16, axis=0))
    y = qt.dequantize(qt.quantize(x, qt.choose_qparams(x, spec)))
    xt = x.T.contiguous()
    yt = qt.dequantize(qt.quantize(xt, qt.choose_qparams(xt, qt.QuantSpec(format="mx6"))))
    assert torch.equal(y, yt.T)
    padded = torch.cat([xt, xt[:, -1:].expand(8, 8)], 1)  # 40 -> 48: the pad repeats the last element
    assert torch.equal(yt, torch.tensor([_model_microexp(r, 5) for r in padded.tolist()])[:, :40])


def test_microexp_bad_input():
    x = _data(rows=2, cols=32)
    qp = qt.choose_qparams(x, qt.QuantSpec(format="mx9"))
    with pytest.raises(ValueError, match="micro_exponent is missing"):
        qt.quantize(x, qt.QParams(scale=qp.scale, spec=qp.spec))
    with pytest.raises(ValueError, match="scale_rule must be 'floor'"):
        qt.choose_qparams(x, qt.QuantSpec(format="mx9", scale_rule="even"))
    with pytest.raises(ValueError, match="intrinsic block of 16"):
        qt.QuantSpec(format="mx6", granularity=qt.PerGroup(32))
    with pytest.raises(ValueError, match="always saturates"):
        qt.QuantSpec(format="mx4", saturate=False)


def test_bfp16_matches_model():
    x = _data(cols=64, seed=5)
    x[2, :8] = torch.tensor([127.5 / 64, 0.1, -0.3, 0, 0, 0, 0, 0])    # rounds to +128: doubled
    x[3, :8] = torch.tensor([-127.5 / 64, 0.1, -0.3, 0, 0, 0, 0, 0])   # rounds to -128: fits
    qp = qt.choose_qparams(x, qt.QuantSpec(format="bfp16"))
    assert qp.scale[2, 0].item() - 127 == -5 and qp.scale[3, 0].item() - 127 == -6
    y = qt.dequantize(qt.quantize(x, qp))
    assert torch.equal(y, torch.tensor([_model_bfp16(r) for r in x.tolist()]))
    assert y[3, 0].item() == -2.0 and y[2, 0].item() == 2.0


def test_bfp16_storage_and_bits():
    x = _data(rows=3, cols=24)
    q = qt.quantize(x, qt.choose_qparams(x, qt.QuantSpec(format="bfp16")))
    assert q.codes.dtype == torch.int8 and q.qparams.scale.dtype == torch.uint8
    assert tuple(q.qparams.scale.shape) == (3, 3) and q.bits_per_element() == 9.0

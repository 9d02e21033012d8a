"""Float zero points (``x / scale + zero_point``, stored like the scale) on (near-)constant blocks.

A constant block's ideal scale is 0; the floor on the scale must keep the zero point finite in its
dtype (fp16 overflowed to -inf before, with an error of 3.4e38 on a block of 1000s) and small
enough that quantizing the dequantized values gives the same codes (float32 lost the code of a
block of 3.2e-31 when the scale was clamped to float32's smallest normal).
"""

import pytest
import torch

import qtransform as qt

# precision (mantissa bits + 1) of each zero-point dtype
PRECISION = {"float32": 24, "float16": 11, "bfloat16": 8}
VALUES = [1e30, 1000.0, 3.0, -0.7, 1e-3, 3.1554e-31, -1e-40]
WIDTHS = [0.0, 2.0 ** -23, 2.0 ** -20, 2.0 ** -10]


@pytest.mark.parametrize("fmt", ["int1", "int4", "int8", "uint8"])
@pytest.mark.parametrize("scale_dtype", sorted(PRECISION))
def test_near_constant_blocks_keep_a_finite_zero_point_and_stable_codes(fmt, scale_dtype):
    spec = qt.QuantSpec(format=fmt, granularity=qt.PerGroup(4), symmetric=False,
                        zero_point_domain="float", scale_dtype=scale_dtype)
    dtype_max = torch.finfo(getattr(torch, scale_dtype)).max
    for v in VALUES:
        if abs(v) * 2.0 ** -14 > dtype_max / 16:  # a scale that fp16 cannot hold: refused elsewhere
            continue
        for rel in WIDTHS:
            x = torch.full((2, 4), v)
            x[0, 1] = v * (1 + rel)
            x[1, 2] = v * (1 - rel)
            qp = qt.choose_qparams(x, spec)
            s = qp.scale.to(torch.float32)
            z = qp.zero_point.to(torch.float32)
            assert torch.isfinite(z).all(), (v, rel, z)
            q = qt.quantize(x, qp)
            y = qt.dequantize(q)
            assert torch.equal(qt.quantize(y, qp).codes, q.codes), (v, rel)
            # independent bound: half a step, plus the zero point's own rounding in its dtype
            # (half an ulp of |z|, i.e. |z| * 2^-p code steps), plus float32 rounding of the result
            s_e = s.repeat_interleave(4, dim=-1)
            z_e = z.repeat_interleave(4, dim=-1)
            bound = s_e * (0.5 + z_e.abs() * 2.0 ** -PRECISION[scale_dtype]) + x.abs() * 2.0 ** -22
            assert bool(((y - x).abs() <= bound).all()), (v, rel, (y - x).abs().max(), bound.min())


def test_the_floor_keeps_the_zero_point_within_two_to_the_twenty():
    spec = qt.QuantSpec(format="int8", granularity=qt.PerChannel(axis=0), symmetric=False,
                        zero_point_domain="float")
    x = torch.tensor([[3.1554e-31], [1.0], [-5e20], [1e-44]])
    qp = qt.choose_qparams(x, spec)
    assert float(qp.zero_point.abs().max()) <= 2.0 ** 20 + 128
    y = qt.dequantize(qt.quantize(x, qp))
    assert torch.equal(y[:3], x[:3])  # constant blocks of normal floats come back exactly
    assert float((y[3] - x[3]).abs()) <= 2.0 ** -127  # a subnormal: within half the smallest normal scale

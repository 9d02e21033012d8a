"""Bit packing round-trips exactly for every width, container, order and row length."""

import torch
from hypothesis import given
from hypothesis import strategies as st

import qtransform as qt


@st.composite
def codes(draw):
    bits = draw(st.integers(1, 8))
    rows, n = draw(st.integers(1, 4)), draw(st.integers(1, 70))
    values = draw(st.lists(st.integers(0, 2 ** bits - 1), min_size=rows * n, max_size=rows * n))
    return bits, torch.tensor(values, dtype=torch.uint8).reshape(rows, n)


@given(codes())
def test_uint8_bitstream_round_trip(case):
    bits, c = case
    packed = qt.pack(c, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == -(-c.shape[-1] * bits // 8)
    assert torch.equal(qt.unpack(packed, bits, c.shape[-1]), c)


@given(codes().filter(lambda case: 32 % case[0] == 0), st.booleans())
def test_int32_words_round_trip(case, awq):
    bits, c = case
    order = "awq" if (awq and bits == 4) else "sequential"
    packed = qt.pack(c, bits, container=torch.int32, order=order)
    assert packed.dtype == torch.int32 and packed.shape[-1] == -(-c.shape[-1] * bits // 32)
    assert torch.equal(qt.unpack(packed, bits, c.shape[-1], order=order), c)


@given(codes())
def test_signed_codes_sign_extend(case):
    bits, c = case
    signed = (c.to(torch.int16) - (1 << (bits - 1))).to(torch.int8) if bits > 1 else -c.to(torch.int8)
    out = qt.unpack(qt.pack(signed, bits), bits, c.shape[-1], signed=True)
    assert out.dtype == torch.int8 and torch.equal(out, signed)

"""Registry-driven properties of the floating-point and block-scaled formats (Hypothesis), beyond
the generic ones of property_tests/ (which cover purity, vmap, grad and idempotence for every format).

Every format of these families (and a user-registered minifloat) is checked on data spanning up
to 2^40 within a tensor and 2^±60 overall, with zeros: the round-trip error is within the stated
bound in closed form (relative 2^-(m+1) in the normal range, half the subnormal step below it,
exact saturation beyond; half a code step for integer elements), independently of the codec's own
``half_spacing``; fake quantization equals the storage round trip; codes re-quantize to the same
bytes; and the reported bits per element are the bytes held.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import qtransform as qt
from qtransform.tensor import blocks
from qtransform.formats import MinifloatCodec

import minifloat_reference as ref

USER = qt.minifloat("fp8_e3m4", exponent_bits=3, mantissa_bits=4)
FAMILIES = ("float", "cast", "mx", "microexp", "bfp", "nvfp4")
NAMES = sorted(n for n, f in qt.FORMATS.items() if f.family in FAMILIES) + [USER.name]
SETTINGS = settings(max_examples=20, deadline=None, derandomize=True)


@st.composite
def tensors(draw, min_cols=1):
    rows = draw(st.integers(1, 4))
    cols = draw(st.integers(min_cols, 70))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    octaves = draw(st.integers(0, 40))
    center = draw(st.integers(-60, 60))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    x = x * torch.exp2(torch.empty(rows, cols).uniform_(center - octaves / 2, center + octaves / 2, generator=gen))
    zero = torch.rand(rows, cols, generator=gen) < draw(st.sampled_from([0.0, 0.1, 0.9]))
    return torch.where(zero, 0.0, x)


@pytest.fixture(scope="module", autouse=True)
def _user_format():
    with ref.registered(USER):
        yield


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns of float8 tensors (compared as bytes), other tensors as they are."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


def _spec(name):
    fmt = qt.FORMATS[name]
    return qt.QuantSpec(format=name) if fmt.block is not None else qt.QuantSpec(format=name, pad=True)


def _closed_form_bound(x, qp):
    """The stated bound, independently of the codec: inside the range, a relative 2^-(m+1) above the
    smallest normal and an absolute half subnormal step below (minifloats) or half a code step
    (integer-coded formats), times the scale; beyond the range, the distance to it."""
    spec = qp.spec
    codec = spec.fmt.codec
    p = blocks.tiling(x.shape, spec, sub_block=True)
    s, _ = qp.effective()
    s = blocks.unview(blocks.expand(s, p).expand(blocks.view(x, p).shape).contiguous(), p)
    lo, hi = codec.qrange(symmetric=True, restricted=False)
    v = x / s
    over = (x.abs() - hi * s).abs()  # what dequantize computes for a saturated value
    if isinstance(codec, MinifloatCodec):
        inside = torch.maximum(v.abs().clamp(max=hi) * 2.0 ** -(codec.mantissa_bits + 1),
                               torch.tensor(2.0 ** (codec.emin - codec.mantissa_bits - 1)))
    else:
        inside = torch.full_like(v, codec.half_spacing(v[:1, :1]).max().item())
    return torch.where(v.abs() > hi, over, inside * s)


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(x=tensors())
def test_round_trip_bound_storage_and_idempotence(name, x):
    spec = _spec(name)
    qp = qt.choose_qparams(x, spec)
    q = qt.quantize(x, qp)
    y = qt.dequantize(q)
    err = (y - x).abs()
    assert bool((err <= qt.error_bound(x, qp) * (1 + 2 ** -20)).all())
    assert bool((err <= _closed_form_bound(x, qp) * (1 + 2 ** -20)).all())
    assert torch.equal(qt.fake_quantize(x, qp), y)
    q2 = qt.quantize(y, qp)
    assert torch.equal(_raw(q2.codes), _raw(q.codes))
    codec = spec.fmt.codec
    if codec.packed:
        assert torch.equal(qt.pack(qt.unpacked_codes(q), codec.bits), q.codes)
    assert q.bits_per_element() == qt.bits_per_element(spec, x.shape)

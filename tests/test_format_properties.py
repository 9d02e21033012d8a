"""Registry-driven properties of the floating-point and block-scaled formats (Hypothesis).

Every format of these families (and a user-registered minifloat) gets each property with its
own test id: round-trip error within the stated bound (checked against the bound's closed form,
not only the codec's own ``half_spacing``), idempotence, inputs unchanged, ``vmap`` and
straight-through ``grad``, and exact storage (unpacked codes re-pack to the same bytes).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import qtransform as qt
from qtransform import blocks, scales
from qtransform.formats import MinifloatCodec
from qtransform.quantize import element_range

qt.register_format(qt.minifloat("fp8_e3m4", exponent_bits=3, mantissa_bits=4), replace=True)

FAMILIES = ("float", "cast", "mx", "microexp", "bfp", "nvfp4")
NAMES = sorted(n for n, f in qt.FORMATS.items() if f.family in FAMILIES)
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
    p = blocks.plan(x.shape, spec, sub_block=True)
    s, _ = scales.effective(qp)
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
def test_round_trip_within_bound(name, x):
    spec = _spec(name)
    qp = qt.choose_qparams(x, spec)
    y = qt.dequantize(qt.quantize(x, qp))
    err = (y - x).abs()
    assert bool((err <= qt.error_bound(x, qp) * (1 + 2 ** -20)).all())
    assert bool((err <= _closed_form_bound(x, qp) * (1 + 2 ** -20)).all())
    assert torch.equal(qt.fake_quantize(x, qp), y)


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(x=tensors())
def test_idempotent_and_exact_storage(name, x):
    spec = _spec(name)
    qp = qt.choose_qparams(x, spec)
    q = qt.quantize(x, qp)
    y = qt.dequantize(q)
    q2 = qt.quantize(y, qp)
    assert torch.equal(_raw(q2.codes), _raw(q.codes))
    assert torch.equal(qt.dequantize(q2), y)
    codec = spec.fmt.codec
    if codec.packed:
        assert torch.equal(qt.pack(qt.unpacked_codes(q), codec.bits), q.codes)
    assert q.bits_per_element() == qt.bits_per_element(spec, x.shape)


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(x=tensors())
def test_inputs_unchanged(name, x):
    spec = _spec(name)
    x0 = x.clone()
    qp = qt.choose_qparams(x, spec)
    before = {k: v.clone() for k, v in qp.tensors().items()}
    q = qt.quantize(x, qp)
    codes0 = q.codes.clone()
    qt.dequantize(q)
    qt.fake_quantize(x, qp)
    qt.error_bound(x, qp)
    assert torch.equal(x, x0)
    assert all(torch.equal(_raw(qp.tensors()[k]), _raw(v)) for k, v in before.items())
    assert torch.equal(_raw(q.codes), _raw(codes0))


@pytest.mark.parametrize("name", NAMES)
def test_vmap_and_grad(name):
    spec = _spec(name)
    gen = torch.Generator().manual_seed(0)
    xs = torch.randn(3, 4, 48, generator=gen) * 3

    def fq(x):
        return qt.fake_quantize(x, qt.choose_qparams(x, spec))

    def qdq(x):
        return qt.dequantize(qt.quantize(x, qt.choose_qparams(x, spec)))

    loop = torch.stack([fq(x) for x in xs])
    assert torch.equal(torch.func.vmap(fq)(xs), loop)
    assert torch.equal(torch.func.vmap(qdq)(xs), loop)
    qp = qt.choose_qparams(xs[0], spec)
    g = torch.func.grad(lambda x: qt.fake_quantize(x, qp).sum())(xs[0])
    lo, hi = element_range(spec)
    p = blocks.plan(xs[0].shape, spec, sub_block=True)
    s, _ = scales.effective(qp)
    v = blocks.unview(blocks.view(xs[0], p) / blocks.expand(s, p), p)
    inside = (v >= lo) & (v <= hi)
    assert torch.equal(g, inside.to(torch.float32))

"""Learnable quantization parameters (:mod:`qtransform.learn`) for every registered format, granularity and
symmetry (registry-driven): the learned fake quantizer is, forward, the format's own round trip bit for bit
(``dequantize(quantize(x, to_qparams(r)))``) wherever the ranges stand, while it is being differentiated as
well as not; the min-max start stores exactly RTN's parameters; the stored parameters are in the form the spec
stores (``conform_qparams`` returns them unchanged); and the ranges get a gradient wherever the scale follows them."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import qtransform as qt
from qtransform import learn
from qtransform.testing import tensors_for

from registry_specs import IDS, SPECS, covering_params

STATIC = [(i, s) for i, s in zip(IDS, SPECS) if not s.dynamic]


CASES = covering_params(STATIC)  # every format, zero-point form and granularity; the rest: make test-long


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe, fp8 compared through their bytes)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point and a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


@pytest.mark.parametrize("spec", CASES)
@given(data=st.data())
def test_learned_fake_quantizer_is_the_round_trip_bit_for_bit(spec, data):
    x = data.draw(tensors_for(spec, max_magnitude_exp=20))
    r = learn.learnable(x, spec)
    rtn = qt.choose_qparams(x, spec)
    stored = learn.to_qparams(r)
    assert all(_same(getattr(stored, f), getattr(rtn, f)) if getattr(rtn, f) is not None
               else getattr(stored, f) is None for f in qt.QParams.FIELDS)
    assert qt.conform_qparams(stored, x.shape) is stored
    # ranges moved by factors drawn per block (some shrink: values clip; some grow)
    shrink = data.draw(st.floats(0.3, 1.0))
    grow = data.draw(st.floats(1.0, 1.5))
    moved = learn.LearnedRange(lo=r.lo * shrink, hi=r.hi * grow, spec=spec)
    try:
        stored = learn.to_qparams(moved)
    except ValueError:  # a range the format cannot scale (near float32's limit): refused alike by both
        with pytest.raises(ValueError):
            learn.fake_quantize(x, moved)
        return
    expect = qt.dequantize(qt.quantize(x, stored))
    assert _same(learn.fake_quantize(x, moved), expect)
    lo, hi = moved.lo.clone().requires_grad_(), moved.hi.clone().requires_grad_()
    xg = x.clone().requires_grad_()
    y = learn.fake_quantize(xg, learn.LearnedRange(lo=lo, hi=hi, spec=spec))
    assert _same(y.detach(), expect)
    (y.double() * torch.sign(torch.cos(torch.arange(x.numel()).reshape(x.shape).double()))).sum().backward()
    mags = x.abs()[x != 0]
    if mags.numel() == 0 or (float(mags.min()) >= 2.0 ** -60 and float(mags.max()) <= 2.0 ** 60):
        # finite gradients (at float32's extremes a range's gradient, ~1/scale^2, may overflow: values stay exact)
        assert torch.isfinite(xg.grad).all()
        if learn.ranged(spec):  # a cast's values do not depend on the range at all (no gradient reaches it)
            assert torch.isfinite(lo.grad).all() and torch.isfinite(hi.grad).all()


def _generic(spec):
    """A tensor off every grid: normal values on a shape every granularity tiles (blocks of 2 to 64)."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 128, generator=g) * 0.7 + 0.05


@pytest.mark.parametrize("spec", CASES)
def test_gradients_reach_the_ranges_and_forward_mode_agrees(spec):
    """Reverse mode: nonzero on the ranges wherever the scale follows them (a range learned through a straight-through
    store is never silently constant); forward mode (jvp) gives the tangent <gradient, direction> of reverse mode."""
    x = _generic(spec)
    try:
        r = learn.learnable(x, spec)
    except ValueError:
        pytest.skip(f"{spec} does not tile a 64x128 tensor")  # checked by the Hypothesis test on its own shapes
    r = learn.LearnedRange(lo=r.lo * 0.8, hi=r.hi * 0.9, spec=spec)  # some values clip
    target = torch.sin(x)

    def loss(lo, hi):
        return (learn.fake_quantize(x, learn.LearnedRange(lo=lo, hi=hi, spec=spec)) - target).square().sum()

    glo, ghi = torch.func.grad(loss, argnums=(0, 1))(r.lo, r.hi)
    if learn.ranged(spec):
        assert float(glo.abs().sum() + ghi.abs().sum()) > 0
    else:  # a cast: the scale is 1 whatever the range
        assert float(glo.abs().sum() + ghi.abs().sum()) == 0
    d = torch.Generator().manual_seed(1)
    vlo, vhi = torch.randn(r.lo.shape, generator=d), torch.randn(r.hi.shape, generator=d)
    _, tangent = torch.func.jvp(loss, (r.lo, r.hi), (vlo, vhi))
    expect = (glo.double() * vlo.double()).sum() + (ghi.double() * vhi.double()).sum()
    assert abs(float(tangent) - float(expect)) <= 1e-3 * (abs(float(expect)) + float(glo.abs().sum() + ghi.abs().sum()) * 1e-3 + 1e-6)

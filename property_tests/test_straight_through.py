"""The straight-through gradient of ``fake_quantize`` for every registered format, granularity and symmetry
(registry-driven): one inside the representable range, zero where the value clips; ``fake_quantize`` is the
round trip. `make test` runs the covering set of registry_specs.PARAMS, `make test-long` the rest."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import qtransform as qt
from qtransform.testing import FLOAT32_MAX, tensors_for

from registry_specs import PARAMS


@pytest.mark.parametrize("spec", PARAMS)
@given(data=st.data())
def test_straight_through_gradient_is_one_inside_and_zero_where_clipped(spec, data):
    x = data.draw(tensors_for(spec))
    qp = qt.choose_qparams(x * 0.5, spec)  # a narrower range: some values clip
    grad = torch.func.grad(lambda t: qt.fake_quantize(t, qp).sum())(x)
    # the representable range of each element: what +-huge values saturate to
    hi = qt.dequantize(qt.quantize(torch.full_like(x, FLOAT32_MAX), qp)).double()
    lo = qt.dequantize(qt.quantize(torch.full_like(x, -FLOAT32_MAX), qp)).double()
    margin = 1e-5 * (hi - lo).abs() + 1e-30
    xd = x.double()
    inside = (xd > lo + margin) & (xd < hi - margin)
    outside = (xd < lo - margin) | (xd > hi + margin)
    assert bool((grad[inside] == 1).all()) and bool((grad[outside] == 0).all())
    assert torch.equal(qt.fake_quantize(x, qp), qt.dequantize(qt.quantize(x, qp)))

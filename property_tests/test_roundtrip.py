"""Round-trip properties of every registered format, granularity and symmetry (registry-driven),
on data spanning the whole float32 range (subnormals and the largest values included).

The round trip is checked twice: against the format's own ``qt.error_bound``, and against a grid
computed here from the format's definition (``element_grid``): inside the calibrated range the
error is at most half the distance between the two grid points around ``x / scale + zero_point``,
times the scale decoded here from the stored parameters, and the values the scale rule clips are
exactly those the observer and the rule allow (minmax with float or ceil scales: none).
"""

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import qtransform as qt
from qtransform.testing import FLOAT32_MAX, assert_within_bound, spec_cases, tensors_for

from independent_grid import assert_on_grid

CASES = spec_cases()
IDS = [case_id for case_id, _ in CASES]
SPECS = [spec for _, spec in CASES]


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@given(data=st.data())
def test_roundtrip_error_within_format_bound(spec, data):
    x = data.draw(tensors_for(spec))
    qp = qt.choose_qparams(x, spec)
    y = assert_within_bound(x, qp)
    assert_on_grid(x, qp, y)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@given(data=st.data())
def test_codes_decode_inside_the_element_range(spec, data):
    x = data.draw(tensors_for(spec))
    q = qt.quantize(x, qt.choose_qparams(x, spec))
    vals = spec.fmt.codec.decode(qt.unpacked_codes(q))
    lo, hi = spec.fmt.codec.qrange(symmetric=spec.symmetric, restricted=spec.restricted)
    assert bool(torch.isfinite(vals).all())
    assert float(vals.min()) >= lo and float(vals.max()) <= hi


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@given(data=st.data())
def test_quantizing_the_dequantized_tensor_gives_the_same_codes(spec, data):
    x = data.draw(tensors_for(spec))
    qp = qt.choose_qparams(x, spec)
    q = qt.quantize(x, qp)
    q2 = qt.quantize(qt.dequantize(q), qp)
    assert torch.equal(q2.codes.view(torch.uint8) if q2.codes.dtype.is_floating_point else q2.codes,
                       q.codes.view(torch.uint8) if q.codes.dtype.is_floating_point else q.codes)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@given(data=st.data())
def test_inputs_are_never_modified(spec, data):
    x = data.draw(tensors_for(spec))
    x0 = x.clone()
    stats = qt.observe(qt.init_stats(spec), x)
    qp = qt.compute_qparams(stats, spec)
    leaves0 = [t.clone() for t in qp.tensors().values()]
    q = qt.quantize(x, qp)
    codes0 = q.codes.clone()
    qt.dequantize(q)
    qt.fake_quantize(x, qp)
    qt.error_bound(x, qp)
    assert torch.equal(x, x0)
    assert all(torch.equal(a, b) for a, b in zip(qp.tensors().values(), leaves0))
    assert torch.equal(q.codes.view(torch.uint8), codes0.view(torch.uint8))


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@given(data=st.data())
def test_vmap_over_a_batch_equals_a_loop(spec, data):
    x = data.draw(tensors_for(spec))
    batch = torch.stack([x, x * 0.5 - 1.0, -x])

    def roundtrip(t):
        return qt.dequantize(qt.quantize(t, qt.choose_qparams(t, spec)))

    looped = torch.stack([roundtrip(t) for t in batch])
    assert torch.equal(torch.func.vmap(roundtrip)(batch), looped)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
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


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_spec_json_round_trip(spec):
    assert qt.QuantSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert hash(qt.QuantSpec.from_dict(spec.to_dict())) == hash(spec)

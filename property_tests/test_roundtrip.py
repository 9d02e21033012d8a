"""Round-trip properties of every registered format, granularity and symmetry (registry-driven;
`make test` runs the covering set of registry_specs.PARAMS, `make test-long` the rest),
on data spanning the whole float32 range (subnormals and the largest values included).

The round trip is checked twice: against the format's own ``qt.error_bound``, and against a grid
computed here from the format's definition (``element_grid``): inside the calibrated range the
error is at most half the distance between the two grid points around ``x / scale + zero_point``,
times the scale decoded here from the stored parameters, and the values the scale rule clips are
exactly those the observer and the rule allow (minmax with float or ceil scales: none).

The same specs as pure functions (inputs unchanged, vmap): test_pure_functions.py; their straight-through
gradient: test_straight_through.py (files of their own, so that pytest-xdist's workers share them).
"""

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import qtransform as qt
from qtransform.testing import assert_within_bound, tensors_for

from independent_grid import assert_on_grid
from registry_specs import IDS, PARAMS, SPECS


@pytest.mark.parametrize("spec", PARAMS)
@given(data=st.data())
def test_roundtrip_error_within_format_bound(spec, data):
    x = data.draw(tensors_for(spec))
    qp = qt.choose_qparams(x, spec)
    y = assert_within_bound(x, qp)
    assert_on_grid(x, qp, y)


@pytest.mark.parametrize("spec", PARAMS)
@given(data=st.data())
def test_codes_decode_inside_the_element_range(spec, data):
    x = data.draw(tensors_for(spec))
    q = qt.quantize(x, qt.choose_qparams(x, spec))
    vals = spec.fmt.codec.decode(qt.unpacked_codes(q))
    lo, hi = spec.fmt.codec.qrange(symmetric=spec.symmetric, restricted=spec.restricted)
    assert bool(torch.isfinite(vals).all())
    assert float(vals.min()) >= lo and float(vals.max()) <= hi


@pytest.mark.parametrize("spec", PARAMS)
@given(data=st.data())
def test_quantizing_the_dequantized_tensor_gives_the_same_codes(spec, data):
    x = data.draw(tensors_for(spec))
    qp = qt.choose_qparams(x, spec)
    q = qt.quantize(x, qp)
    q2 = qt.quantize(qt.dequantize(q), qp)
    assert torch.equal(q2.codes.view(torch.uint8) if q2.codes.dtype.is_floating_point else q2.codes,
                       q.codes.view(torch.uint8) if q.codes.dtype.is_floating_point else q.codes)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_spec_json_round_trip(spec):
    assert qt.QuantSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert hash(qt.QuantSpec.from_dict(spec.to_dict())) == hash(spec)

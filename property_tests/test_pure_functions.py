"""The round trip of every registered format, granularity and symmetry (registry-driven;
`make test` runs the covering set of registry_specs.PARAMS, `make test-long` the rest) as a pure
function: its inputs (the tensor, the parameters, the codes) are never modified, and ``vmap`` over a batch
equals a loop over it."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import qtransform as qt
from qtransform.testing import tensors_for

from registry_specs import PARAMS


@pytest.mark.parametrize("spec", PARAMS)
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


@pytest.mark.parametrize("spec", PARAMS)
@given(data=st.data())
def test_vmap_over_a_batch_equals_a_loop(spec, data):
    x = data.draw(tensors_for(spec))
    batch = torch.stack([x, x * 0.5 - 1.0, -x])

    def roundtrip(t):
        return qt.dequantize(qt.quantize(t, qt.choose_qparams(t, spec)))

    looped = torch.stack([roundtrip(t) for t in batch])
    assert torch.equal(torch.func.vmap(roundtrip)(batch), looped)

"""Observer folds: merging is associative and commutative, and splitting the data changes nothing."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
import numpy as np

import qtransform as qt

OBSERVERS = ["minmax", "percentile", "mse"]
FORMATS = ["int8", "uint4", "int4", "nf4"]
GRANS = [qt.PerTensor(), qt.PerChannel(-1)]  # grids independent of the batch length


def _specs():
    out = []
    for obs in OBSERVERS:
        for fmt in FORMATS:
            for g in GRANS:
                for sym in (True, False):
                    try:
                        out.append(qt.QuantSpec(format=fmt, granularity=g, symmetric=sym, observer=obs))
                    except ValueError:
                        pass
    return out


SPECS = _specs()
IDS = [f"{s.observer}-{s.format}-{type(s.granularity).__name__}-{'sym' if s.symmetric else 'asym'}"
       for s in SPECS]


def batches(n=3):
    rows = st.integers(1, 6)
    cols = st.sampled_from([1, 3, 8])

    @st.composite
    def draw(d):
        c = d(cols)
        scale = d(st.sampled_from([1e-3, 1.0, 1e3]))
        return [torch.from_numpy(d(hnp.arrays(np.float32, (d(rows), c), elements=st.floats(-1, 1, width=32))))
                * scale for _ in range(n)]

    return draw()


def _same(a, b):
    for name in ("min", "max", "counts", "exponent"):
        x, y = getattr(a, name, None), getattr(b, name, None)
        if x is not None or y is not None:
            assert torch.equal(x, y), name
    if getattr(a, "sums", None) is not None:
        torch.testing.assert_close(a.sums, b.sums, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@given(xs=batches())
def test_merge_is_associative_and_commutative(spec, xs):
    a, b, c = (qt.observe(qt.init_stats(spec), x) for x in xs)
    left = qt.merge_stats(qt.merge_stats(a, b), c)
    right = qt.merge_stats(a, qt.merge_stats(b, c))
    swapped = qt.merge_stats(c, qt.merge_stats(b, a))
    _same(left, right)
    _same(left, swapped)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@given(xs=batches())
def test_observing_batches_equals_observing_all_the_data(spec, xs):
    seq = qt.init_stats(spec)
    for x in xs:
        seq = qt.observe(seq, x)
    whole = qt.observe(qt.init_stats(spec), torch.cat(xs))
    _same(seq, whole)
    qa, qb = qt.compute_qparams(seq), qt.compute_qparams(whole)
    for name, t in qa.tensors().items():
        torch.testing.assert_close(t.float(), qb.tensors()[name].float(), rtol=1e-5, atol=0)

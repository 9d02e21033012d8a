"""Observer folds, for every registered observer (registry-driven, like the formats):

* observing batches one by one equals observing all the data at once (split equals whole);
* ``merge_stats`` is associative and commutative, with the empty statistics as identity;
* each field's declared cross-process reduction (sum, max, min) is what ``merge`` does to it;
* range observers give the same quantization parameters either way.

Range observers run over several formats, granularities whose grid does not depend on the batch
length, and both symmetries; the others over plain 2-D batches.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
import numpy as np

import qtransform as qt

FORMATS = ["int8", "uint4", "int4", "nf4"]
GRANS = [qt.PerTensor(), qt.PerChannel(-1)]  # grids independent of the batch length
# what bridge.distributed does with each declared reduction: float sums add in float64 (exact for float32 parts)
_REDUCE = {"sum": lambda a, b: a.double() + b.double() if a.is_floating_point() else a + b, "max": torch.maximum, "min": torch.minimum}


def _cases():
    out = []
    for name, cls in qt.OBSERVERS.items():
        if not cls.needs_spec:
            out.append((name, None))
            continue
        for fmt in FORMATS:
            for g in GRANS:
                for sym in (True, False):
                    try:
                        spec = qt.QuantSpec(format=fmt, granularity=g, symmetric=sym)
                    except ValueError:
                        continue
                    out.append((name, spec))
    return out


CASES = _cases()
IDS = [name if spec is None else f"{name}-{spec.format}-{type(spec.granularity).__name__}-"
       f"{'sym' if spec.symmetric else 'asym'}" for name, spec in CASES]


def test_every_registered_observer_is_covered():
    assert {name for name, _ in CASES} == set(qt.OBSERVERS)


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


def _fields(s):
    return {k: v for k, v in vars(s).items() if k not in ("spec", "observer")}


def _same(a, b):
    """Equal statistics: integer fields and min/max folds exactly (no rounding can differ), float
    sums up to float32 summation order (compared as float64: sums are held in float64 once merged)."""
    fa, fb = _fields(a), _fields(b)
    assert fa.keys() == fb.keys()
    exact = {k for k, how in a.observer.reduction.items() if how in ("max", "min")}
    for k, x in fa.items():
        y = fb[k]
        if x is None or y is None:
            assert x is None and y is None, k
        elif x.is_floating_point() and k not in exact:
            torch.testing.assert_close(x.double(), y.double(), rtol=1e-5, atol=1e-5 * float(x.abs().max().clamp(min=1)), msg=k)
        else:
            assert torch.equal(x, y), k


def _observe(name, spec, x):
    return qt.observe(qt.init_stats(spec, observer=name), x)


@pytest.mark.parametrize("name, spec", CASES, ids=IDS)
@given(xs=batches())
def test_merge_is_associative_and_commutative(name, spec, xs):
    a, b, c = (_observe(name, spec, x) for x in xs)
    left = qt.merge_stats(qt.merge_stats(a, b), c)
    _same(left, qt.merge_stats(a, qt.merge_stats(b, c)))
    _same(left, qt.merge_stats(c, qt.merge_stats(b, a)))
    empty = qt.init_stats(spec, observer=name)
    _same(qt.merge_stats(empty, a), a)
    _same(qt.merge_stats(a, empty), a)


@pytest.mark.parametrize("name, spec", CASES, ids=IDS)
@given(xs=batches())
def test_observing_batches_equals_observing_all_the_data(name, spec, xs):
    seq = qt.init_stats(spec, observer=name)
    for x in xs:
        seq = qt.observe(seq, x)
    whole = _observe(name, spec, torch.cat(xs))
    _same(seq, whole)
    if qt.OBSERVERS[name].gives_range:
        qa, qb = qt.compute_qparams(seq), qt.compute_qparams(whole)
        for field, t in qa.tensors().items():
            torch.testing.assert_close(t.float(), qb.tensors()[field].float(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("name, spec", CASES, ids=IDS)
@given(xs=batches(2))
def test_declared_reductions_are_what_merge_does(name, spec, xs):
    a, b = (_observe(name, spec, x) for x in xs)
    merged = _fields(qt.merge_stats(a, b))
    for field, how in qt.OBSERVERS[name].reduction.items():
        if how in _REDUCE:  # "merge" fields are gathered and merged by the observer itself
            expected = _REDUCE[how](getattr(a, field), getattr(b, field))
            torch.testing.assert_close(merged[field].to(expected.dtype), expected, rtol=0, atol=0, msg=field)


@pytest.mark.parametrize("name, spec", CASES, ids=IDS)
@given(xs=batches(2))
def test_folds_are_pure(name, spec, xs):
    """Neither the batch nor the statistics folded into are changed (statistics can be reused)."""
    x_before = [x.clone() for x in xs]
    a = _observe(name, spec, xs[0])
    a_before = {k: None if v is None else v.clone() for k, v in _fields(a).items()}
    b = qt.observe(a, xs[1])
    qt.merge_stats(a, b)
    for x, before in zip(xs, x_before):
        assert torch.equal(x, before)
    for k, v in _fields(a).items():
        assert (v is None and a_before[k] is None) or torch.equal(v, a_before[k]), k

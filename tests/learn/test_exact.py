"""Ranges that stand exactly for given parameters (:mod:`qtransform.learn.exact`), and the symmetric range
:func:`qtransform.learn.from_qparams` reads (the half-width of the code range, int8's 127.5, not its lowest code)."""

import pytest
import torch

import qtransform as qt
from qtransform import learn


def test_exact_range_recovers_step_parameters():
    """Parameters fitted elsewhere (int8's full-range symmetric scale, an asymmetric float32 scale) are given back
    exactly by the range training starts from, where learn.from_qparams alone is off."""
    g = torch.Generator().manual_seed(0)
    for spec in (qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)),
                 qt.QuantSpec(format="uint4", granularity=qt.PerGroup(16), symmetric=False)):
        w = torch.randn(64, 64, generator=g)
        qp = qt.choose_qparams(w * 0.9, spec)  # parameters of another range than w's
        r = learn.exact_range(qp)
        back = learn.to_qparams(r)
        assert all(torch.equal(a, b) for a, b in zip(back.tensors().values(), qp.tensors().values()))


@pytest.mark.parametrize("fmt", ["int8", "int4", "uint8"])
def test_symmetric_range_is_the_half_width_of_the_codes(fmt):
    spec = qt.QuantSpec(format=fmt, granularity=qt.PerChannel(0))
    qp = qt.choose_qparams(torch.tensor([[-1.0, 0.25], [0.5, 2.0]]), spec)
    r = learn.from_qparams(qp)
    lo, hi = spec.fmt.codec.qrange(symmetric=True, restricted=spec.restricted)
    expect = qp.effective()[0] * (hi - lo) / 2  # amax = scale * half-width, by hand
    assert torch.equal(r.hi, expect) and torch.equal(r.lo, -expect)


def test_parameters_no_range_reaches_are_refused_by_path():
    spec = qt.QuantSpec(format="uint4", granularity=qt.PerChannel(0), symmetric=False)
    qp = qt.QParams(scale=torch.tensor([[0.5]]), zero_point=torch.tensor([[15]], dtype=torch.uint8), spec=spec)
    # a zero point at the top code with a positive range below it: from_range never makes it (0 is in every range)
    qp2 = qt.QParams(scale=torch.tensor([[0.5]]), zero_point=torch.tensor([[3]], dtype=torch.uint8), spec=spec)
    assert learn.same_qparams(learn.to_qparams(learn.exact_range(qp2)), qp2)
    with pytest.raises(ValueError, match="fc.weight: no learnable range"):
        learn.exact_range(qt.QParams(scale=torch.tensor([[0.0]]), zero_point=qp.zero_point, spec=spec),
                          path="fc.weight")

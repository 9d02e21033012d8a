"""Rounding modes: half to even, half away from zero, stochastic (explicit randomness)."""

import pytest
import torch

import qtransform as qt


def _codes(x, rounding, **kw):
    spec = qt.QuantSpec(format="int8", symmetric_range="restricted", rounding=rounding)
    qp = qt.QParams(scale=torch.ones(1), spec=spec)
    return qt.unpacked_codes(qt.quantize(x, qp, **kw))


X = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 2.4, -2.6])


def test_half_even():
    assert _codes(X, "half_even").tolist() == [0, 2, 2, 0, -2, -2, 2, -3]


def test_half_away():
    assert _codes(X, "half_away").tolist() == [1, 2, 3, -1, -2, -3, 2, -3]


def test_stochastic_is_unbiased_and_reproducible():
    x = torch.full((20000,), 0.25)
    codes = _codes(x, "stochastic", generator=123).float()
    assert set(codes.unique().tolist()) == {0.0, 1.0}
    assert abs(codes.mean().item() - 0.25) < 0.02
    assert torch.equal(_codes(x, "stochastic", generator=123), _codes(x, "stochastic", generator=123))
    g = torch.Generator().manual_seed(5)
    assert not torch.equal(_codes(x, "stochastic", generator=g), _codes(x, "stochastic", generator=g))


def test_stochastic_rounding_needs_explicit_randomness():
    with pytest.raises(ValueError, match="generator"):
        _codes(X, "stochastic")
    with pytest.raises(TypeError, match="generator"):
        _codes(X, "stochastic", generator="seed")


def test_codebook_ties_follow_the_rounding_mode():
    codec = qt.formats.CodebookCodec((-1.0, -0.5, 0.0, 0.5, 1.0))  # dyadic: midpoints are exact
    v = torch.tensor([0.25, -0.25, 0.74, -0.76])
    assert codec.encode(v.clone(), rounding="half_even").tolist() == [2, 2, 3, 0]
    assert codec.encode(v.clone(), rounding="half_away").tolist() == [3, 1, 3, 0]
    noise = torch.tensor([0.49, 0.51, 0.0, 0.0])
    assert codec.encode(v.clone(), rounding="stochastic", noise=noise).tolist() == [3, 1, 4, 1]

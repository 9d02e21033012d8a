"""``observe(..., donate=True)``: the same statistics as the pure fold, built in the donated buffers (the
hessian observer adds in place), while ``donate=False`` (the default) leaves its input untouched."""

import torch

import qtransform as qt


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(9, 12, generator=g) for _ in range(4)]


def test_a_donated_hessian_fold_equals_the_pure_fold_and_reuses_its_buffer():
    pure = qt.init_stats(observer="hessian")
    donated = qt.init_stats(observer="hessian")
    for i, x in enumerate(_batches()):
        pure = qt.observe(pure, x)
        before = donated.xtx
        donated = qt.observe(donated, x, donate=i > 0)
        if i > 0:  # a fold's sum is float64 from its first batch: later batches are added in the donated matrix
            assert donated.xtx is before
    assert torch.equal(donated.xtx, pure.xtx) and int(donated.count) == int(pure.count) == 36
    expected = sum(x.double().T @ x.double() for x in _batches()) / 36
    torch.testing.assert_close(qt.finalize_stats(donated).double(), expected, rtol=1e-6, atol=1e-6)


def test_without_donation_the_statistics_folded_into_are_unchanged_and_finalize_copies():
    s = qt.observe(qt.observe(qt.init_stats(observer="hessian"), _batches()[0]), _batches()[1])
    kept = s.xtx.clone()
    qt.observe(s, _batches()[2])
    one = qt.observe(qt.init_stats(observer="hessian", dtype="float64"), _batches()[0])
    kept_one = one.xtx.clone()
    qt.finalize_stats(one)  # a sum already in the result's dtype: finalize must not divide it in place
    assert torch.equal(s.xtx, kept) and torch.equal(one.xtx, kept_one)


def test_observers_without_a_donating_update_fold_the_same_when_donated():
    spec = qt.QuantSpec(format="int8", granularity=qt.PerChannel(-1))
    for name in ("minmax", "percentile", "channel"):
        a = b = qt.init_stats(spec if name != "channel" else None, observer=name)
        for i, x in enumerate(_batches()):
            a, b = qt.observe(a, x), qt.observe(b, x, donate=i > 0)
        for f in a.observer.reduction:
            assert torch.equal(getattr(a, f), getattr(b, f)), (name, f)

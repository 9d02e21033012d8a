"""Observers on hand-analysable data: minmax, percentile (both tails), MSE search."""

import torch

import qtransform as qt


def _range(spec, *xs):
    s = qt.init_stats(spec)
    for x in xs:
        s = qt.observe(s, x)
    return s, qt.compute_qparams(s, spec)


def test_minmax_folds_over_batches():
    spec = qt.QuantSpec(format="uint8", symmetric=False)
    s, qp = _range(spec, torch.tensor([[0.5, 2.0]]), torch.tensor([[-1.0, 0.0]]), torch.tensor([[3.0, 1.0]]))
    assert s.min.item() == -1.0 and s.max.item() == 3.0
    assert abs(qp.scale.item() - 4 / 255) < 1e-8


def test_percentile_symmetric_clips_the_magnitude_tail():
    # |x| uniform on 0..9999 (in units of 1e-3): the 99th percentile of |x| is ~9.9
    x = (torch.arange(10000.0) * 1e-3).reshape(100, 100)
    x[::2] *= -1
    spec = qt.QuantSpec(format="int8", observer="percentile", percentile=99.0)
    _, qp = _range(spec, x)
    amax = qp.scale.item() * 127.5
    assert 9.88 < amax < 9.92


def test_percentile_asymmetric_clips_each_tail():
    x = torch.linspace(-2.0, 6.0, 80001).reshape(1, -1)  # uniform: 0.5% tails at -1.96 and 5.96
    spec = qt.QuantSpec(format="uint8", symmetric=False, zero_point_domain="float",
                        observer="percentile", percentile=99.0)
    s, qp = _range(spec, x)
    lo, hi = qt.search.percentile_range(s, spec)
    assert abs(lo.item() + 1.96) < 0.01 and abs(hi.item() - 5.96) < 0.01


def test_percentile_100_is_minmax():
    x = torch.randn(64, 64)
    a = qt.choose_qparams(x, qt.QuantSpec(format="int8", observer="percentile", percentile=100.0))
    b = qt.choose_qparams(x, qt.QuantSpec(format="int8"))
    assert a.scale.item() == b.scale.item()


def test_mse_clips_a_lone_outlier_and_beats_minmax():
    torch.manual_seed(0)
    x = torch.randn(1, 4096)
    x[0, 0] = 40.0  # one outlier: minmax wastes the int4 grid on it
    mse_spec = qt.QuantSpec(format="int4", granularity=qt.PerChannel(0), observer="mse")
    mm_spec = qt.QuantSpec(format="int4", granularity=qt.PerChannel(0))
    mse_qp, mm_qp = qt.choose_qparams(x, mse_spec), qt.choose_qparams(x, mm_spec)
    err = lambda qp: (qt.fake_quantize(x, qp) - x).pow(2).sum().item()  # noqa: E731
    assert mse_qp.scale.item() < 0.5 * mm_qp.scale.item()
    assert err(mse_qp) < 0.5 * err(mm_qp)


def test_mse_keeps_the_full_range_for_uniform_data():
    # uniform data on a grid that int8 represents exactly: clipping can only add error
    x = (torch.arange(-127.0, 128.0) / 127.0).reshape(1, -1)
    qp = qt.choose_qparams(x, qt.QuantSpec(format="int8", symmetric_range="restricted", observer="mse"))
    assert abs(qp.scale.item() - 1 / 127) < 1e-7


def test_mse_search_is_exact_on_the_observed_data():
    # brute force over the same candidate grid, quantizing the data itself
    torch.manual_seed(1)
    x = torch.randn(8, 128) * torch.rand(8, 1) * 3
    spec = qt.QuantSpec(format="int4", granularity=qt.PerChannel(0), observer="mse")
    got = qt.choose_qparams(x, spec)
    amax = x.abs().amax(1, keepdim=True)
    best = None
    for r in torch.linspace(1.0, qt.search.MSE_MIN_RATIO, qt.search.MSE_CANDIDATES).tolist():
        s = amax * r / 7.5
        err = ((torch.round(x / s).clamp(-8, 7) * s - x) ** 2).sum(1, keepdim=True)
        best = (err, s) if best is None else (torch.minimum(best[0], err), torch.where(err < best[0], s, best[1]))
    got_err = ((qt.fake_quantize(x, got) - x) ** 2).sum(1, keepdim=True)
    assert bool((got_err <= best[0] * 1.02 + 1e-9).all())  # within 2% of brute force, per row

"""Observers on hand-analysable data: minmax, percentile (both tails), MSE search, Hessian, channel
statistics; the registry, observer options and their errors."""

import pytest
import torch

import qtransform as qt


def _range(spec, *xs, **observer):
    s = qt.init_stats(spec, **observer)
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
    spec = qt.QuantSpec(format="int8")
    _, qp = _range(spec, x, observer="percentile", percentile=99.0)
    amax = qp.scale.item() * 127.5
    assert 9.88 < amax < 9.92


def test_percentile_asymmetric_clips_each_tail():
    x = torch.linspace(-2.0, 6.0, 80001).reshape(1, -1)  # uniform: 0.5% tails at -1.96 and 5.96
    spec = qt.QuantSpec(format="uint8", symmetric=False, zero_point_domain="float")
    s, qp = _range(spec, x, observer="percentile", percentile=99.0)
    lo, hi = qt.finalize_stats(s)
    assert abs(lo.item() + 1.96) < 0.01 and abs(hi.item() - 5.96) < 0.01


def test_percentile_100_is_minmax():
    x = torch.randn(64, 64)
    a = qt.choose_qparams(x, qt.QuantSpec(format="int8"), observer="percentile", percentile=100.0)
    b = qt.choose_qparams(x, qt.QuantSpec(format="int8"))
    assert a.scale.item() == b.scale.item()


def test_mse_clips_a_lone_outlier_and_beats_minmax():
    torch.manual_seed(0)
    x = torch.randn(1, 4096)
    x[0, 0] = 40.0  # one outlier: minmax wastes the int4 grid on it
    spec = qt.QuantSpec(format="int4", granularity=qt.PerChannel(0))
    mse_qp, mm_qp = qt.choose_qparams(x, spec, observer="mse"), qt.choose_qparams(x, spec)
    err = lambda qp: (qt.fake_quantize(x, qp) - x).pow(2).sum().item()  # noqa: E731
    assert mse_qp.scale.item() < 0.5 * mm_qp.scale.item()
    assert err(mse_qp) < 0.5 * err(mm_qp)


def test_mse_keeps_the_full_range_for_uniform_data():
    # uniform data on a grid that int8 represents exactly: clipping can only add error
    x = (torch.arange(-127.0, 128.0) / 127.0).reshape(1, -1)
    qp = qt.choose_qparams(x, qt.QuantSpec(format="int8", symmetric_range="restricted"), observer="mse")
    assert abs(qp.scale.item() - 1 / 127) < 1e-7


def test_mse_search_is_exact_on_the_observed_data():
    # brute force over the same candidate grid, quantizing the data itself
    torch.manual_seed(1)
    x = torch.randn(8, 128) * torch.rand(8, 1) * 3
    spec = qt.QuantSpec(format="int4", granularity=qt.PerChannel(0))
    got = qt.choose_qparams(x, spec, observer="mse")
    amax = x.abs().amax(1, keepdim=True)
    best = None
    mse = qt.make_observer("mse")
    for r in torch.linspace(1.0, mse.min_ratio, mse.candidates).tolist():
        s = amax * r / 7.5
        err = ((torch.round(x / s).clamp(-8, 7) * s - x) ** 2).sum(1, keepdim=True)
        best = (err, s) if best is None else (torch.minimum(best[0], err), torch.where(err < best[0], s, best[1]))
    got_err = ((qt.fake_quantize(x, got) - x) ** 2).sum(1, keepdim=True)
    assert bool((got_err <= best[0] * 1.02 + 1e-9).all())  # within 2% of brute force, per row


def test_mse_scores_candidates_with_the_spec_it_quantizes_with():
    # statistics gathered for int8 give a tighter int2 range when compute_qparams is asked for int2
    torch.manual_seed(3)
    x = torch.randn(1, 2048)
    s = qt.observe(qt.init_stats(qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)), observer="mse"), x)
    int2 = qt.QuantSpec(format="int2", granularity=qt.PerChannel(0))
    amax2 = qt.compute_qparams(s, int2).scale.item() * 2.0  # int2 full range: amax / 2
    amax8 = qt.compute_qparams(s).scale.item() * 127.5
    assert amax2 < 0.8 * amax8


def test_hessian_is_the_mean_outer_product_over_all_rows():
    torch.manual_seed(4)
    xs = [torch.randn(2, 5, 6), torch.randn(3, 6), torch.randn(1, 1, 6)]
    s = qt.init_stats(observer="hessian")
    for x in xs:
        s = qt.observe(s, x)
    rows = torch.cat([x.reshape(-1, 6) for x in xs]).double()
    expected = rows.T @ rows / rows.shape[0]  # float64, independently of the fold
    assert int(s.count) == 14
    torch.testing.assert_close(qt.finalize_stats(s).double(), expected, rtol=1e-5, atol=1e-6)
    s64 = qt.observe(qt.init_stats(observer="hessian", dtype="float64"), xs[0])
    assert s64.xtx.dtype == torch.float64


def test_channel_statistics_along_any_axis():
    x = torch.tensor([[[1.0, -2.0, 0.0]], [[-3.0, 4.0, 0.5]]])  # (2, 1, 3)
    r = qt.finalize_stats(qt.observe(qt.init_stats(observer="channel"), x))
    assert r.absmax.tolist() == [3.0, 4.0, 0.5]
    assert r.mean_abs.tolist() == [2.0, 3.0, 0.25]
    assert r.mean_square.tolist() == [5.0, 10.0, 0.125]
    r0 = qt.finalize_stats(qt.observe(qt.init_stats(observer="channel", axis=0), x))
    assert r0.absmax.tolist() == [2.0, 4.0]


def test_registry_names_every_observer_with_a_reduction_per_field():
    assert {"minmax", "percentile", "mse", "hessian", "channel"} <= set(qt.OBSERVERS)
    for name, cls in qt.OBSERVERS.items():
        stats = qt.init_stats(qt.QuantSpec(format="int8", granularity=qt.PerTensor()) if cls.needs_spec else None,
                              observer=name)
        fields = [f for f in type(stats).__dataclass_fields__ if f not in ("spec", "observer")]
        assert sorted(cls.reduction) == sorted(fields), name


def test_observer_options_and_errors():
    assert qt.make_observer({"name": "percentile", "percentile": 99}) == qt.make_observer("percentile", percentile=99.0)
    assert qt.make_observer(None) == qt.make_observer("minmax")
    with pytest.raises(ValueError, match="unknown observer 'nope'"):
        qt.init_stats(qt.QuantSpec(format="int8"), observer="nope")
    with pytest.raises(ValueError, match=r"observer 'percentile': unknown option\(s\) \['bins_'\]"):
        qt.make_observer("percentile", bins_=3)
    with pytest.raises(ValueError, match=r"percentile must be in \(50, 100\]"):
        qt.make_observer("percentile", percentile=20.0)
    with pytest.raises(ValueError, match="power of two"):
        qt.make_observer("mse", bins=1000)
    with pytest.raises(ValueError, match="pass spec="):
        qt.init_stats(observer="minmax")
    with pytest.raises(TypeError, match="gives no quantization range"):
        qt.compute_qparams(qt.observe(qt.init_stats(observer="hessian"), torch.ones(2, 2)))
    with pytest.raises(ValueError, match="no data observed"):
        qt.finalize_stats(qt.init_stats(observer="channel"))
    with pytest.raises(TypeError, match="cannot merge"):
        qt.merge_stats(qt.init_stats(observer="channel"), qt.init_stats(observer="hessian"))


def test_calibration_choices_are_not_part_of_a_spec():
    with pytest.raises(TypeError):
        qt.QuantSpec(format="int8", observer="mse")
    with pytest.raises(ValueError, match="calibration choices"):
        qt.QuantSpec.from_dict({"format": "int8", "observer": "mse", "percentile": 99.0})

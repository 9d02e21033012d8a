"""SmoothQuant's pure core: the scales formula (checked in float64 numpy), the fold (function preserved
for norms with bias, fused and grouped-query linears, transposed storage), the quantized error it
lowers on an outlier channel (computed here with qt.fake_quantize), the auto search, bad options."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import qtransform as qt
from qtransform.algorithms import smoothing, smoothquant
from qtransform.algorithms.smoothquant_math import layer_errors, sample_stats
from qtransform.algorithms.smoothing import SmoothGroup

W8 = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
A8 = qt.QuantSpec(format="int8")  # per tensor, static


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _np_scales(a, w, alpha, eps=1e-5):
    s = np.maximum(a.astype(np.float64), eps) ** alpha / np.maximum(w.astype(np.float64), eps) ** (1 - alpha)
    return s / np.prod(s) ** (1.0 / s.size)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 0.85, 1.0])
def test_scales_match_an_independent_float64_computation(alpha):
    g = _gen(0)
    a, w = torch.rand(48, generator=g) * 20 + 0.01, torch.rand(48, generator=g) + 0.01
    got = smoothquant.scales(a, w, alpha)
    np.testing.assert_allclose(got.numpy(), _np_scales(a.numpy(), w.numpy(), alpha), rtol=2e-5)
    grid = smoothquant.scales(a, w, torch.tensor([[alpha], [0.5]]))  # vectorised over alphas
    torch.testing.assert_close(grid[0], got)


def test_alpha_edges_equalise_the_weights_or_the_activations():
    g = _gen(1)
    x = torch.randn(200, 16, generator=g) * torch.linspace(0.1, 30, 16)
    params = {"ln.weight": torch.ones(16), "a.weight": torch.randn(8, 16, generator=g),
              "b.weight": torch.randn(4, 16, generator=g) * 3}
    group = [{"prev": "ln", "linears": ["a", "b"]}]
    amax_x = x.abs().amax(0)
    new0 = smoothquant.smooth(params, group, [amax_x], alpha=0.0)
    w_cols = torch.cat([new0["a.weight"], new0["b.weight"]]).abs().amax(0)  # over both linears
    torch.testing.assert_close(w_cols, w_cols.mean().expand(16), rtol=1e-5, atol=0)
    new1 = smoothquant.smooth(params, group, [amax_x], alpha=1.0)
    x_cols = (x * new1["ln.weight"]).abs().amax(0)  # what the linears now read
    torch.testing.assert_close(x_cols, x_cols.mean().expand(16), rtol=1e-5, atol=0)
    # the weight maxima are taken over all the group's linears: b alone would give other scales
    alone = smoothquant.smooth(params, [{"prev": "ln", "linears": ["b"]}], [amax_x], alpha=0.0)
    assert not torch.allclose(alone["ln.weight"], new0["ln.weight"])


def test_a_layernorm_with_bias_folds_and_the_function_is_unchanged():
    g = _gen(2)
    x = torch.randn(32, 24, generator=g)
    params = {"ln.weight": torch.randn(24, generator=g), "ln.bias": torch.randn(24, generator=g),
              "q.weight": torch.randn(12, 24, generator=g), "q.bias": torch.randn(12, generator=g),
              "k.weight": torch.randn(6, 24, generator=g)}
    before = {k: v.clone() for k, v in params.items()}
    s = torch.rand(24, generator=g) * 10 + 0.1

    def out(p):
        h = F.layer_norm(x, (24,), p["ln.weight"], p["ln.bias"])
        return F.linear(h, p["q.weight"], p["q.bias"]), F.linear(h, p["k.weight"])

    new = smoothing.fold(params, SmoothGroup("ln", ("q", "k")), s)
    assert sorted(new) == ["k.weight", "ln.bias", "ln.weight", "q.weight"]  # q's bias reads no input
    torch.testing.assert_close(new["ln.bias"], params["ln.bias"] / s)
    for a, b in zip(out(params), out({**params, **new})):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(params[k], before[k]) for k in params)  # pure


def _attention(p, x, rows, n_kv, n_rep, d, probs, transposed):
    """A fused projection's value slice (with bias), mixed per query head by row-stochastic ``probs``
    (grouped-query: query head h reads value head h // n_rep), then the output projection."""
    w = p["qkv.weight"].T if transposed else p["qkv.weight"]
    v = (F.linear(x, w, p["qkv.bias"]))[:, rows[0]:rows[1]].reshape(-1, n_kv, d)
    heads = [probs[h] @ v[:, h // n_rep] for h in range(n_kv * n_rep)]
    o = p["o.weight"].T if transposed else p["o.weight"]
    return F.linear(torch.cat(heads, -1), o)


@pytest.mark.parametrize("transposed", [False, True])
def test_a_fused_grouped_query_value_slice_folds_into_the_output_projection(transposed):
    g = _gen(3)
    n, hidden, n_kv, n_rep, d = 10, 16, 2, 3, 4
    q_out, kv = n_kv * n_rep * d, n_kv * d
    qkv = torch.randn(q_out + 2 * kv, hidden, generator=g)
    o = torch.randn(hidden, q_out, generator=g)
    params = {"qkv.weight": qkv.T.contiguous() if transposed else qkv, "qkv.bias": torch.randn(q_out + 2 * kv, generator=g),
              "o.weight": o.T.contiguous() if transposed else o}
    rows = (q_out + kv, q_out + 2 * kv)
    group = SmoothGroup("qkv", ("o",), rows=rows, head_dim=d, transposed=transposed)
    assert smoothing.group_shape(params, group) == (q_out, kv, n_rep)
    x = torch.randn(n, hidden, generator=g)
    probs = torch.softmax(torch.randn(n_kv * n_rep, n, n, generator=g), -1)
    s = torch.rand(kv, generator=g) * 5 + 0.2
    new = smoothing.fold(params, group, s)
    ref = _attention(params, x, rows, n_kv, n_rep, d, probs, transposed)
    torch.testing.assert_close(_attention({**params, **new}, x, rows, n_kv, n_rep, d, probs, transposed), ref,
                               rtol=1e-4, atol=1e-4)
    # rows outside the value slice are untouched (q and k)
    w_new = new["qkv.weight"].T if transposed else new["qkv.weight"]
    assert torch.equal(w_new[:rows[0]], qkv[:rows[0]])


def _outlier_layer(seed=4, n=256, c=64, outlier=7):
    g = _gen(seed)
    xhat = torch.randn(n, c, generator=g)
    xhat[:, outlier] *= 40  # a consistent outlier channel, as in LLM activations
    params = {"norm.weight": torch.rand(c, generator=g) + 0.5, "fc.weight": torch.randn(96, c, generator=g) * 0.05,
              "fc2.weight": torch.randn(32, c, generator=g) * 0.05}
    return xhat, params


def _w8a8_error(xhat, p, linears=("fc", "fc2")):
    """Output error of int8 per-tensor activations x int8 per-channel weights, computed here."""
    x = xhat * p["norm.weight"]
    xq = qt.fake_quantize(x, qt.choose_qparams(x, A8))
    err = 0.0
    for lin in linears:
        w = p[f"{lin}.weight"]
        wq = qt.fake_quantize(w, qt.choose_qparams(w, W8))
        err += float((xq @ wq.T - x @ w.T).double().pow(2).sum())
    return err


def test_smoothing_an_outlier_channel_lowers_the_w8a8_output_error():
    xhat, params = _outlier_layer()
    absmax = (xhat * params["norm.weight"]).abs().amax(0)
    before = _w8a8_error(xhat, params)
    new = smoothquant.smooth(params, [{"prev": "norm", "linears": ["fc", "fc2"]}], [absmax], alpha=0.5)
    after = _w8a8_error(xhat, {**params, **new})
    assert after < 0.25 * before, (before, after)


def test_the_search_measures_errors_as_computed_independently_and_picks_the_smallest():
    xhat, params = _outlier_layer()
    x = xhat * params["norm.weight"]
    sample = qt.finalize_stats(qt.observe(sample_stats(1), x))
    group = {"prev": "norm", "linears": ["fc", "fc2"]}
    specs = {"fc": W8, "fc2": W8}
    choice = smoothquant.search_alpha(sample, params, group, activation=A8, weight_specs=specs, grid=11)
    assert choice.alphas[0] is None and choice.alphas[1:] == tuple(round(i / 10, 12) for i in range(11))
    assert math.isclose(float(choice.errors[0]), _w8a8_error(xhat, params), rel_tol=1e-4)  # no smoothing
    half = smoothquant.smooth(params, [group], [x.abs().amax(0)], alpha=0.5)
    assert math.isclose(float(choice.errors[6]), _w8a8_error(xhat, {**params, **half}), rel_tol=1e-4)
    assert float(choice.errors.min()) == float(choice.errors[choice.alphas.index(choice.alpha)])
    assert choice.alpha is not None and float(choice.errors.min()) < 0.25 * float(choice.errors[0])
    torch.testing.assert_close(choice.scales, smoothquant.scales(
        x.abs().amax(0), smoothing.weight_absmax(params, SmoothGroup.from_value(group)), choice.alpha))


def test_a_static_activation_range_covers_all_rows_not_only_the_sample():
    xhat, params = _outlier_layer(seed=5)
    x = xhat * params["norm.weight"]
    sampled = sample_stats(4)
    for part in x.split(50):  # batches of 50 rows: every 4th row of each is kept
        sampled = qt.observe(sampled, part)
    rows = qt.finalize_stats(sampled)
    assert torch.equal(rows.rows, torch.cat([p[::4] for p in x.split(50)]))
    assert torch.equal(rows.hi, x.amax(0)) and torch.equal(rows.lo, x.amin(0))
    ones = torch.ones(1, 64)
    err = layer_errors(rows, params, SmoothGroup("norm", ("fc",)), ones, activation=A8, weight_specs={"fc": W8})
    scale = qt.choose_qparams(x, A8)  # the range of all rows
    xq = qt.fake_quantize(rows.rows, scale)
    w = params["fc.weight"]
    want = (xq @ qt.fake_quantize(w, qt.choose_qparams(w, W8)).T - rows.rows @ w.T).double().pow(2).sum()
    assert math.isclose(float(err[0]), float(want), rel_tol=1e-5)


def test_row_samples_fold_batch_by_batch_as_all_at_once():
    x = torch.randn(3, 5, 6, generator=_gen(6))
    one = qt.finalize_stats(qt.observe(sample_stats(1), x))
    parts = sample_stats(1)
    for b in x:
        parts = qt.observe(parts, b)
    for a, b in zip(one, qt.finalize_stats(parts)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("alpha,error", [(1.5, ValueError), (-0.1, ValueError), ("x", ValueError), (True, TypeError),
                                         (float("nan"), ValueError), (None, TypeError)])
def test_bad_alpha_is_an_error_naming_alpha(alpha, error):
    with pytest.raises(error, match="smoothquant: alpha must be a number in \\[0, 1\\] or \"auto\""):
        qt.check_algorithm_options("smoothquant", {"alpha": alpha})
    with pytest.raises(error, match="recipe.steps\\[0\\] \\(smoothquant\\): smoothquant: alpha"):
        qt.check_steps([qt.Step("smoothquant", alpha=alpha)])


def test_other_bad_options_and_groups_are_named():
    from qtransform.algorithms.smoothquant import check_options as check
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['beta'\]"):
        check(beta=1)
    with pytest.raises(ValueError, match=r"\['grid'\] apply to alpha='auto'"):
        check(alpha=0.5, grid=5)
    with pytest.raises(ValueError, match="grid must be an int >= 2"):
        check(alpha="auto", grid=1)
    with pytest.raises(ValueError, match="tokens must be an int >= 1"):
        check(alpha="auto", tokens=0)
    with pytest.raises(ValueError, match="activation: a static activation spec must be per tensor"):
        check(alpha="auto", activation=qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)).to_dict())
    check(alpha="auto", activation=qt.QuantSpec(format="int8", granularity=qt.PerChannel(0), dynamic=True).to_dict())
    with pytest.raises(ValueError, match=r"groups\[1\]: 'linears' must be a non-empty list"):
        check(groups=[{"prev": "a", "linears": ["b"]}, {"prev": "c", "linears": []}])
    with pytest.raises(ValueError, match=r"groups\[0\]: unknown key\(s\) \['norm'\]"):
        check(groups=[{"norm": "a", "linears": ["b"]}])


def test_groups_that_do_not_fit_the_tree_are_named():
    params = {"ln.weight": torch.ones(8), "fc.weight": torch.ones(4, 6), "fc2.weight": torch.ones(4, 8)}
    with pytest.raises(ValueError, match="ln.weight: the norm has 8 channels, its linears read 6"):
        smoothing.fold(params, SmoothGroup("ln", ("fc",)), torch.ones(8))
    with pytest.raises(ValueError, match=r"read different widths \[6, 8\]"):
        smoothing.group_shape(params, SmoothGroup("ln", ("fc", "fc2")))
    with pytest.raises(ValueError, match="nope.weight: smoothing group linear 'nope' has no floating-point weight"):
        smoothing.group_shape(params, SmoothGroup("ln", ("nope",)))
    with pytest.raises(ValueError, match="rows \\[0, 4\\] give 4 channels, its linears read 8"):
        smoothing.group_shape(params, SmoothGroup("fc", ("fc2",), rows=(0, 4)))
    with pytest.raises(ValueError, match="scales must be positive"):
        smoothing.fold(params, SmoothGroup("ln", ("fc2",)), torch.zeros(8))
    with pytest.raises(ValueError, match="2 groups but 1 activation maxima"):
        smoothquant.smooth(params, [SmoothGroup("ln", ("fc2",))] * 2, [torch.ones(8)])


def test_groups_round_trip_as_plain_data():
    g = SmoothGroup("a.v", ("a.o",), rows=(8, 16), head_dim=4, transposed=True)
    assert SmoothGroup.from_value(g.to_dict()) == g
    assert qt.Step("smoothquant", groups=[g.to_dict()]).options["groups"][0]["rows"] == [8, 16]

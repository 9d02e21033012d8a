"""AWQ's pure core: the candidate scales, the scaled-and-quantized weights, the search's choice against a
brute-force evaluation, grouped-query averaging, and the clipping search under an input Gram matrix checked
against the layer output error computed directly."""

import pytest
import torch

import qtransform as qt
from qtransform.algorithms.awq_math import (candidate_scales, input_mean, scaled_weights, search_scales,
                                              weight_mean)
from qtransform.algorithms.clip_search import input_gram, search_range
from qtransform.algorithms.smoothing import SmoothGroup, group_shape

U3 = qt.QuantSpec(format="uint3", granularity=qt.PerGroup(8), symmetric=False)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_candidates_are_powers_of_the_input_means_normalised_by_the_geometric_middle():
    x = torch.tensor([1.0, 4.0, 0.25, 2.0])
    alphas, s = candidate_scales(x, 4)
    assert alphas == (0.0, 0.25, 0.5, 0.75)
    assert torch.equal(s[0], torch.ones(4))  # alpha 0: no scaling
    for a, row in zip(alphas, s):
        raw = x.double() ** a
        expected = raw / (raw.max() * raw.min()).sqrt()
        torch.testing.assert_close(row.double(), expected, rtol=1e-6, atol=0)
    w = torch.tensor([2.0, 1.0, 1.0, 0.5])
    _, duo = candidate_scales(x, 2, w_mean=w)
    raw = x.double() ** 0.5 / w.double() ** 0.5
    torch.testing.assert_close(duo[1].double(), raw / (raw.max() * raw.min()).sqrt(), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="grid must be an int >= 1"):
        candidate_scales(x, 0)


def test_scaled_weights_quantize_the_scaled_weight_and_divide_back():
    w = torch.randn(4, 16, generator=_gen())
    params = {"n.weight": torch.ones(16), "fc.weight": w, "other.weight": w.clone()}
    s = torch.rand(16, generator=_gen(1)) + 0.5
    group = SmoothGroup("n", ("fc", "other"))
    out = scaled_weights(params, group, s, {"fc": U3, "other": None})
    assert set(out) == {"fc.weight"}  # an unquantized linear is left alone
    expected = qt.fake_quantize(w * s, qt.choose_qparams(w * s, U3)) / s
    torch.testing.assert_close(out["fc.weight"], expected)
    # stored (in, out) (Conv1D): the same numbers in the transposed layout
    spec_t = qt.QuantSpec(format="uint3", granularity=qt.PerGroup(8, axis=0), symmetric=False)
    t = scaled_weights({"n.weight": torch.ones(16), "fc.weight": w.T.contiguous()},
                       SmoothGroup("n", ("fc",), transposed=True), s, {"fc": spec_t})
    torch.testing.assert_close(t["fc.weight"].T, expected)


def _salient_problem(seed=0, n=512, c=32):
    g = _gen(seed)
    x = torch.randn(n, c, generator=g)
    x[:, [3, 17]] *= 25.0  # two salient input channels
    w = torch.randn(24, c, generator=g)
    return x, {"n.weight": torch.ones(c), "fc.weight": w}


def test_the_search_picks_the_grid_point_of_smallest_output_error_computed_by_hand():
    x, params = _salient_problem()
    group = SmoothGroup("n", ("fc",))
    specs = {"fc": U3}
    run = lambda t: [x @ t.get("fc.weight", params["fc.weight"]).T]  # noqa: E731
    choice = search_scales(run, params, group, x.abs().mean(0), specs=specs, grid=10)
    ref = x @ params["fc.weight"].T
    _, cands = candidate_scales(x.abs().mean(0), 10)
    by_hand = []
    for s in cands:  # independent of the search: quantize W * s, divide back, compare outputs
        ws = params["fc.weight"] * s
        q = qt.fake_quantize(ws, qt.choose_qparams(ws, U3)) / s
        by_hand.append(float((x @ q.T - ref).double().pow(2).sum()))
    assert choice.index == min(range(10), key=by_hand.__getitem__)
    torch.testing.assert_close(choice.errors, torch.tensor(by_hand, dtype=torch.float64), rtol=1e-4, atol=0)
    assert choice.alpha > 0 and by_hand[choice.index] < 0.8 * by_hand[0]  # protecting salient channels pays
    torch.testing.assert_close(choice.scales, cands[choice.index])


def test_without_salient_channels_no_scaling_can_win_and_the_search_never_does_worse():
    g = _gen(3)
    x = torch.randn(256, 16, generator=g)
    params = {"n.weight": torch.ones(16), "fc.weight": torch.randn(8, 16, generator=g)}
    run = lambda t: [x @ t.get("fc.weight", params["fc.weight"]).T]  # noqa: E731
    choice = search_scales(run, params, SmoothGroup("n", ("fc",)), x.abs().mean(0), specs={"fc": U3})
    assert float(choice.errors[choice.index]) == float(choice.errors.min()) <= float(choice.errors[0])


def test_grouped_query_means_average_the_heads_that_read_one_value_head():
    # v_proj: 2 kv heads of 4 -> 8 channels; o_proj reads 4 heads of 4 (n_rep 2)
    params = {"v.weight": torch.randn(8, 6), "o.weight": torch.randn(6, 16)}
    group = SmoothGroup("v", ("o",), head_dim=4)
    shape = group_shape(params, group)
    m = torch.arange(16.0)
    # o's input channel (k * 2 + r, d) reads value head k: the mean over r
    expected = torch.stack([(m[(k * 2) * 4 + d] + m[(k * 2 + 1) * 4 + d]) / 2 for k in range(2) for d in range(4)])
    torch.testing.assert_close(input_mean(m, group, shape), expected)


def test_weight_means_normalise_each_quantization_block_by_its_largest_magnitude():
    w = torch.tensor([[1.0, -2.0, 4.0, 0.0], [0.5, 0.5, -1.0, 1.0]])
    params = {"n.weight": torch.ones(4), "fc.weight": w}
    group = SmoothGroup("n", ("fc",))
    spec = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(2), symmetric=False)
    got = weight_mean(params, group, {"fc": spec}, group_shape(params, group))
    torch.testing.assert_close(got, torch.tensor([(0.5 + 1.0) / 2, (1.0 + 1.0) / 2, (1.0 + 1.0) / 2, (0.0 + 1.0) / 2]))


def test_search_refuses_groups_with_nothing_to_quantize_and_wrong_statistics():
    x, params = _salient_problem()
    run = lambda t: [x]  # noqa: E731
    g = SmoothGroup("n", ("fc",))
    with pytest.raises(ValueError, match="none of its linears"):
        search_scales(run, params, g, x.abs().mean(0), specs={"fc": None})
    with pytest.raises(ValueError, match=r"input means of shape \(5,\)"):
        search_scales(run, params, g, torch.ones(5), specs={"fc": U3})


@pytest.mark.parametrize("in_axis", [1, 0])
def test_clipping_under_the_input_gram_minimises_the_layer_output_error_computed_directly(in_axis):
    g = _gen(5)
    x = torch.randn(300, 32, generator=g) @ torch.randn(32, 32, generator=g)  # correlated inputs
    w = torch.randn(12, 32, generator=g)
    w[:, 5] *= 6  # outliers that clipping may cut
    spec = qt.QuantSpec(format="uint3", granularity=qt.PerGroup(8, axis=in_axis), symmetric=False)
    stored = w if in_axis == 1 else w.T.contiguous()
    gram = input_gram(x, spec, tuple(stored.shape), in_axis=in_axis)
    qp = search_range(stored, spec, gram=gram, in_axis=in_axis, grid=6, min_ratio=0.5)
    # brute force: every ratio, each (row, group) block's output error computed by a matmul on the inputs
    stats = qt.observe(qt.init_stats(spec), stored)
    best = None
    for ratio in torch.linspace(1.0, 0.5, 6).tolist():
        cand = qt.QParams.from_range(stats.min * ratio, stats.max * ratio, spec)
        d = qt.fake_quantize(stored, cand) - stored
        dl = d if in_axis == 1 else d.T
        err = torch.stack([((x[:, j:j + 8] @ dl[:, j:j + 8].T) ** 2).sum(0) / x.shape[0]
                           for j in range(0, 32, 8)], 1)  # (rows, groups)
        err = err if in_axis == 1 else err.T
        best = (err, cand) if best is None else (torch.minimum(best[0], err),
                                                 _pick(best, err, cand))
    expected = best[1]
    torch.testing.assert_close(qp.scale, expected.scale)
    torch.testing.assert_close(qp.zero_point, expected.zero_point)


def _pick(best, err, cand):
    better = err < best[0]
    old = best[1]
    return qt.QParams(scale=torch.where(better, cand.scale, old.scale),
                      zero_point=torch.where(better, cand.zero_point, old.zero_point), spec=old.spec)


def test_a_diagonal_gram_is_the_energy_weighted_search():
    g = _gen(7)
    w = torch.randn(6, 16, generator=g)
    h = torch.rand(16, generator=g) + 0.1
    spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(4))
    gram = torch.diag_embed(h.reshape(4, 4))
    a = search_range(w, spec, gram=gram)
    b = search_range(w, spec, h)
    torch.testing.assert_close(a.scale, b.scale)


def test_a_gram_that_does_not_fit_the_blocks_is_refused():
    w = torch.randn(6, 16)
    spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(4))
    with pytest.raises(ValueError, match="does not fit the column blocks"):
        search_range(w, spec, gram=torch.zeros(2, 8, 8), path="fc.weight")
    with pytest.raises(ValueError, match=r"input rows of shape \(3, 5\)"):
        input_gram(torch.zeros(3, 5), spec, (6, 16))


def test_a_group_names_the_module_a_search_inspects_and_round_trips_through_its_dict():
    d = {"prev": "b.norm", "linears": ["b.mlp.up", "b.mlp.gate"], "inspect": "b.mlp"}
    g = SmoothGroup.from_value(d)
    assert g.inspect == "b.mlp" and SmoothGroup.from_value(g.to_dict()) == g and g.to_dict() == d
    assert "inspect" not in SmoothGroup.from_value({"prev": "n", "linears": ["fc"]}).to_dict()
    with pytest.raises(ValueError, match="'inspect' must be a module path"):
        SmoothGroup.from_value({**d, "inspect": ""})


def test_token_local_inputs_are_sampled_to_evenly_spaced_rows_and_others_left_whole():
    import importlib

    awq = importlib.import_module("qtransform.algorithms.awq")
    xs = [torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3) + 100 * b for b in range(2)]
    inputs = [((x,), {}) for x in xs]
    out, same = awq._sampled(inputs, 4)
    assert same
    rows = torch.cat([x.reshape(-1, 3) for x in xs])  # 20 rows: indices 0, 6, 13, 19
    assert len(out) == 1 and out[0][0][0].shape == (1, 4, 3)
    torch.testing.assert_close(out[0][0][0][0], rows[[0, 6, 13, 19]])
    kw = [((), {"hidden_states": x}) for x in xs]
    torch.testing.assert_close(awq._sampled(kw, 4)[0][0][1]["hidden_states"][0], rows[[0, 6, 13, 19]])
    assert awq._sampled(inputs, 50) == (inputs, False)  # fewer rows than asked: all of them
    two = [((x, x), {}) for x in xs]  # a call with another tensor (a mask, positions): not sampled
    assert awq._sampled(two, 4) == (two, False)

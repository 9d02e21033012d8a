"""auto-SmoothQuant scored on held-out sequences: the folds are disjoint sequences (checked on rows that name
their sequence), the chosen alpha minimises the held-out error computed here by brute force (numpy scales,
qt.fake_quantize, no code of the search), a single sequence falls back to the calibration score, bad options."""

import numpy as np
import pytest
import torch

import qtransform as qt
from qtransform.algorithms import smoothquant
from qtransform.algorithms.smoothquant_math import folds, sample_stats

W8 = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
A8 = qt.QuantSpec(format="int8")  # per tensor, static
GROUP = {"prev": "norm", "linears": ["fc"]}


def _labelled(units, t, c=3):
    """(units, t, c) rows whose first feature is the sequence index and second the row index in it."""
    x = torch.zeros(units, t, c)
    x[..., 0] = torch.arange(units, dtype=torch.float32)[:, None]
    x[..., 1] = torch.arange(t, dtype=torch.float32)[None, :]
    x[..., 2] = torch.randn(units, t, generator=torch.Generator().manual_seed(0))
    return x


def test_folds_hold_out_whole_sequences_and_range_only_the_others():
    x = _labelled(5, 8)
    stats = sample_stats(1)
    for batch in (x[:2], x[2:]):  # two batches: sequences numbered across them
        stats = qt.observe(stats, batch)
    sample = qt.finalize_stats(stats)
    assert sample.unit.tolist() == [u for u in range(5) for _ in range(8)]
    got = folds(sample)
    assert len(got) == 2
    for f, (held, lo, hi) in enumerate(got):
        held_units = sorted({int(v) for v in held[:, 0]})
        assert held_units == [u for u in range(5) if u % 2 == f]
        assert torch.equal(held, torch.cat([x[u] for u in held_units]))  # whole sequences, in order
        others = [u for u in range(5) if u % 2 != f]
        assert torch.equal(lo, x[others].reshape(-1, 3).amin(0)) and torch.equal(hi, x[others].reshape(-1, 3).amax(0))
        assert set(held_units).isdisjoint(others)


def test_sequences_without_sampled_rows_are_dealt_no_fold_but_count_in_the_range():
    x = _labelled(5, 2)
    sample = qt.finalize_stats(qt.observe(sample_stats(4), x))  # rows 0, 4, 8: sequences 0, 2, 4
    assert sample.unit.tolist() == [0, 2, 4]
    (held0, lo0, hi0), (held1, lo1, hi1) = folds(sample)
    assert held0[:, 0].tolist() == [0.0, 4.0] and held1[:, 0].tolist() == [2.0]
    assert torch.equal(hi0, x[[1, 2, 3]].reshape(-1, 3).amax(0)) and torch.equal(lo1, x[[0, 1, 3, 4]].reshape(-1, 3).amin(0))


def _np_scales(a, w, alpha, eps=1e-5):
    s = np.maximum(a, eps) ** alpha / np.maximum(w, eps) ** (1 - alpha)
    return s / np.prod(s) ** (1.0 / s.size)


def _brute_heldout(x, w, alphas):
    """Held-out W8A8 error of each candidate (None: no smoothing), sequences dealt to 2 folds by index."""
    errs = []
    for alpha in alphas:
        total = 0.0
        for f in range(2):
            fit = x[[u for u in range(x.shape[0]) if u % 2 != f]].reshape(-1, x.shape[-1])
            held = x[[u for u in range(x.shape[0]) if u % 2 == f]].reshape(-1, x.shape[-1])
            s = torch.ones(x.shape[-1]) if alpha is None else torch.tensor(_np_scales(
                fit.abs().amax(0).double().numpy(), w.abs().amax(0).double().numpy(), alpha), dtype=torch.float32)
            xq = qt.fake_quantize(held / s, qt.choose_qparams(fit / s, A8))  # static: the fit sequences' range
            ws = w * s
            wq = qt.fake_quantize(ws, qt.choose_qparams(ws, W8))
            total += float((xq @ wq.T - held @ w.T).double().pow(2).sum())
        errs.append(total)
    return errs


@pytest.mark.parametrize("seed", [0, 1])
def test_the_chosen_alpha_minimises_the_heldout_error_computed_by_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 24, 16, generator=g)
    x[:, :, 2] *= 30  # an outlier channel in every sequence
    x[4, :, 9] *= 60  # and one that fires in a single sequence: calibration sees it, a held-out fold does not
    params = {"norm.weight": torch.ones(16), "fc.weight": torch.randn(20, 16, generator=g) * 0.1}
    sample = qt.finalize_stats(qt.observe(sample_stats(1), x))
    choice = smoothquant.search_alpha(sample, params, GROUP, activation=A8, weight_specs={"fc": W8}, grid=11,
                                score="heldout")
    want = _brute_heldout(x, params["fc.weight"], choice.alphas)
    np.testing.assert_allclose(choice.errors.numpy(), want, rtol=2e-3)
    assert want[choice.alphas.index(choice.alpha)] <= min(want) * (1 + 2e-3)
    if choice.alpha is None:  # no smoothing won
        assert choice.scales is None
    else:  # its scales are those of the chosen alpha on *all* sequences
        torch.testing.assert_close(choice.scales, smoothquant.scales(
            x.reshape(-1, 16).abs().amax(0), params["fc.weight"].abs().amax(0), choice.alpha))
    fitted = smoothquant.search_alpha(sample, params, GROUP, activation=A8, weight_specs={"fc": W8}, grid=11)
    default = smoothquant.search_alpha(sample, params, GROUP, activation=A8, weight_specs={"fc": W8}, score="calibration")
    assert torch.equal(fitted.errors, default.errors)  # the default
    # the rare channel: smoothed by a maximum only one sequence shows, which the calibration score rewards
    assert fitted.alpha is not None and (-1 if choice.alpha is None else choice.alpha) < fitted.alpha


def test_a_single_sequence_is_scored_on_its_own_rows():
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(3))  # 2-D: one sequence
    params = {"norm.weight": torch.ones(16), "fc.weight": torch.randn(8, 16, generator=torch.Generator().manual_seed(4))}
    sample = qt.finalize_stats(qt.observe(sample_stats(1), x))
    assert folds(sample) == []
    a = smoothquant.search_alpha(sample, params, GROUP, activation=A8, weight_specs={"fc": W8}, score="heldout")
    b = smoothquant.search_alpha(sample, params, GROUP, activation=A8, weight_specs={"fc": W8}, score="calibration")
    assert torch.equal(a.errors, b.errors) and a.alpha == b.alpha


def test_bad_score_options_are_named():
    from qtransform.algorithms.smoothquant import check_options as check
    with pytest.raises(ValueError, match=r"smoothquant: score must be one of \['heldout', 'calibration'\], got 'x'"):
        check(alpha="auto", score="x")
    with pytest.raises(ValueError, match=r"\['score'\] apply to alpha='auto'"):
        check(alpha=0.5, score="heldout")
    with pytest.raises(ValueError, match=r"recipe.steps\[0\] \(smoothquant\): smoothquant: score must be one of"):
        qt.check_steps([qt.Step("smoothquant", alpha="auto", score="held")])
    with pytest.raises(TypeError, match=r"smoothquant: score must be a string"):
        qt.check_steps([qt.Step("smoothquant", alpha="auto", score=1)])
    sample = qt.finalize_stats(qt.observe(sample_stats(1), torch.randn(4, 8, 16)))
    params = {"norm.weight": torch.ones(16), "fc.weight": torch.randn(8, 16)}
    with pytest.raises(ValueError, match="smoothquant: score must be one of"):
        smoothquant.search_alpha(sample, params, GROUP, score="held-out")
    check(alpha="auto", score="calibration")

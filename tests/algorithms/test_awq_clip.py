"""AWQ's reference-form clipping search (``awq_clip``): the shrink grid and the chosen clamp per group against a
brute-force search written out from the paper's code (clamp to ±p·max|w|, asymmetric min/max quantization with an
integer zero point, mean squared partial output of each group over the tokens)."""

import pytest
import torch

import qtransform as qt
from qtransform.algorithms.awq_clip import search_magnitude, shrink_factors
from qtransform.algorithms.clip_search import input_gram


def test_the_shrink_grid_is_the_reference_one():
    assert shrink_factors() == pytest.approx([1 - i / 20 for i in range(10)])
    assert shrink_factors()[-1] == pytest.approx(0.55)
    assert shrink_factors(4, 0.0) == [1.0]
    with pytest.raises(ValueError, match="grid"):
        shrink_factors(0)
    with pytest.raises(ValueError, match="max_shrink"):
        shrink_factors(20, 1.0)


def _reference_quantize(w, bits, group):
    """Asymmetric min/max quantization per group of ``group`` columns with an integer zero point, as the paper's
    code writes it (its ``pseudo_quantize_tensor``), for a ``(rows, cols)`` weight."""
    v = w.reshape(-1, group)
    hi, lo = v.amax(1, keepdim=True), v.amin(1, keepdim=True)
    qmax = 2 ** bits - 1
    scale = (hi - lo).clamp(min=1e-5) / qmax
    zero = (-torch.round(lo / scale)).clamp(0, qmax)
    return ((torch.clamp(torch.round(v / scale) + zero, 0, qmax) - zero) * scale).reshape(w.shape)


def _brute_force(w, x, bits, group, factors):
    best, best_err = w.clone(), torch.full((w.shape[0], w.shape[1] // group), float("inf"), dtype=torch.float64)
    a = w.reshape(w.shape[0], -1, group).abs().amax(-1)  # (rows, groups)
    for f in factors:
        m = (f * a).repeat_interleave(group, 1)
        q = _reference_quantize(torch.clamp(w, -m, m), bits, group)
        for r in range(w.shape[0]):
            for j in range(w.shape[1] // group):
                cols = slice(j * group, (j + 1) * group)
                err = float(((x[:, cols] @ (q[r, cols] - w[r, cols])) ** 2).double().mean())
                if err < best_err[r, j]:
                    best_err[r, j] = err
                    best[r, cols] = q[r, cols]
    return best


@pytest.mark.parametrize("in_axis", [1, 0])
def test_the_chosen_clamp_per_group_is_the_brute_force_one_of_the_reference(in_axis):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200, 32, generator=g) @ torch.randn(32, 32, generator=g)  # correlated inputs
    w = torch.randn(6, 32, generator=g)
    w[:, 3] *= 5  # outliers worth clipping in some groups
    w[1, 9] = -7.0  # a negative one: only that side shrinks
    spec = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(8, axis=in_axis), symmetric=False)
    stored = w if in_axis == 1 else w.T.contiguous()
    gram = input_gram(x, spec, tuple(stored.shape), in_axis=in_axis)
    got = qt.fake_quantize(stored, search_magnitude(stored, spec, gram=gram, in_axis=in_axis))
    got = got if in_axis == 1 else got.T
    expected = _brute_force(w, x, 4, 8, [1 - i / 20 for i in range(10)])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(expected, _reference_quantize(w, 4, 8))  # some group was clipped


def test_it_never_does_worse_than_min_max_on_the_output_error():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(128, 16, generator=g)
    w = torch.randn(5, 16, generator=g)
    spec = qt.QuantSpec(format="uint3", granularity=qt.PerGroup(16), symmetric=False)
    gram = input_gram(x, spec, (5, 16))

    def err(q):
        return float(((x @ (q - w).T) ** 2).sum())

    assert err(qt.fake_quantize(w, search_magnitude(w, spec, gram=gram))) <= err(
        qt.fake_quantize(w, qt.choose_qparams(w, spec))) + 1e-6


def test_bad_shapes_are_refused_with_the_path():
    spec = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(8), symmetric=False)
    with pytest.raises(ValueError, match="l.weight.*Gram of shape"):
        search_magnitude(torch.randn(4, 16), spec, gram=torch.ones(3, 8, 8), path="l.weight")
    with pytest.raises(ValueError, match="2-D weight"):
        search_magnitude(torch.randn(2, 4, 16), spec, gram=torch.ones(2, 8, 8))

"""HQQ (qtransform.algorithms.hqq) against hqq 0.2.8, round-to-nearest and an independent
reference of the half-quadratic iteration written from hqq's formulas."""

from __future__ import annotations

import math

import pytest
import torch

import qtransform as qt
from qtransform.algorithms import hqq

hqq_quantize = pytest.importorskip("hqq.core.quantize")
hqq_optimize = pytest.importorskip("hqq.core.optimize")


def _spec(bits=4, gran=None, **kw):
    kw = {"scale_dtype": "float32", **kw}
    return qt.QuantSpec(format=f"uint{bits}", granularity=gran or qt.PerGroup(64), symmetric=False,
                        zero_point_domain="float", **kw)


def _weight(shape=(128, 256), seed=0, scale=0.02):
    """LLM-like weights: Gaussian bulk, heavier tails and a few outliers."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * scale
    heavy = torch.randn(shape, generator=g) / torch.rand(shape, generator=g).clamp(min=0.05)
    mask = torch.rand(shape, generator=g) < 0.02
    return torch.where(mask, heavy * scale, w)


def _sse(w, qp):
    return float((qt.dequantize(qt.quantize(w, qp)) - w).pow(2).sum())


def _group_sse(w, qp, g):
    """Squared error per group of PerGroup(g, axis=-1) on a 2-D weight."""
    return (qt.dequantize(qt.quantize(w, qp)) - w).pow(2).reshape(w.shape[0], -1, g).sum(-1)


def _hqq_sse(w, bits, g, axis):
    """hqq 0.2.8's own optimizer on exactly our groups (float32 scale and zero)."""
    if axis == 1:
        x = w
    else:  # hqq's axis=0 groups are the columns of reshape(g, -1): lay our column groups out so
        x = w.reshape(w.shape[0] // g, g, w.shape[1]).permute(1, 0, 2).reshape(g, -1)
    wq, meta = hqq_quantize.Quantizer.quantize(x, nbits=bits, group_size=g, optimize=True, axis=axis,
                                               bitpack=False, device="cpu", compute_dtype=torch.float32)
    wr = (wq.float() - meta["zero"]) * meta["scale"]
    return float((wr.reshape(x.shape) - x).pow(2).sum())


# ----------------------------------------------------------------------------- vs hqq
@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("bits,group", [(4, 64), (3, 64), (2, 16)])
@pytest.mark.parametrize("scale_dtype", ["float32", "float16"])
def test_error_at_most_hqq(bits, group, axis, scale_dtype):
    for seed in range(3):
        w = _weight(seed=seed)
        ours = _sse(w, hqq.optimize(w, _spec(bits, qt.PerGroup(group, axis=axis), scale_dtype=scale_dtype)))
        theirs = _hqq_sse(w, bits, group, axis)
        assert ours <= theirs, (seed, ours, theirs)


@pytest.mark.parametrize("bits,group", [(4, 64), (3, 64), (2, 16)])
def test_zero_point_only_matches_or_beats_hqq(bits, group):
    """With hqq's update (zero point only) the best iterate is at least as good as hqq's result."""
    w = _weight(seed=5)
    ours = _sse(w, hqq.optimize(w, _spec(bits, qt.PerGroup(group)), refine_scale=False))
    assert ours <= _hqq_sse(w, bits, group, 1) * (1 + 1e-6)


# ----------------------------------------------------------------------------- vs round-to-nearest
GRANULARITIES = [qt.PerGroup(32), qt.PerGroup(16, axis=0), qt.PerChannel(0), qt.PerChannel(1),
                 qt.PerTensor(), qt.PerBlock((8, 32))]


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("gran", GRANULARITIES, ids=str)
def test_never_worse_than_rtn(bits, gran):
    w = _weight((64, 128), seed=bits)
    for scale_dtype in ("float32", "float16", "bfloat16"):
        spec = _spec(bits, gran, scale_dtype=scale_dtype)
        assert _sse(w, hqq.optimize(w, spec)) <= _sse(w, qt.choose_qparams(w, spec)) * (1 + 1e-6)


@pytest.mark.parametrize("refine_scale", [True, False])
def test_never_worse_than_rtn_per_group(refine_scale):
    w = _weight((128, 512), seed=3)
    spec = _spec(3, qt.PerGroup(64), scale_dtype="float16")
    ours = _group_sse(w, hqq.optimize(w, spec, refine_scale=refine_scale), 64)
    rtn = _group_sse(w, qt.choose_qparams(w, spec), 64)
    assert bool((ours <= rtn * (1 + 1e-5) + 1e-12).all())
    assert float(ours.sum()) < 0.97 * float(rtn.sum())  # and it does optimize


def _group_norm(w, qp, g, p):
    return torch.linalg.vector_norm((qt.dequantize(qt.quantize(w, qp)) - w).reshape(w.shape[0], -1, g), ord=p, dim=-1)


@pytest.mark.parametrize("p", [1.0, 4.0, math.inf])
@pytest.mark.parametrize("refine_scale", [True, False])
def test_error_norm_ranks_the_iterates(p, refine_scale):
    """Without early stopping every ``error_norm`` sees the same iterates: the result is the best one
    in its own norm (so never worse than RTN there), and the squared-error choice stays best in L2."""
    w = _weight((64, 512), seed=7)
    spec = _spec(3, qt.PerGroup(64), scale_dtype="float16")
    opts = dict(refine_scale=refine_scale, early_stop=False, iters=10)
    by_p, by_l2 = hqq.optimize(w, spec, error_norm=p, **opts), hqq.optimize(w, spec, **opts)
    rtn = qt.choose_qparams(w, spec)
    tol = 1 + 1e-5
    assert bool((_group_norm(w, by_p, 64, p) <= _group_norm(w, by_l2, 64, p) * tol).all())
    assert bool((_group_norm(w, by_p, 64, p) <= _group_norm(w, rtn, 64, p) * tol).all())
    assert bool((_group_sse(w, by_l2, 64) <= _group_sse(w, by_p, 64) * tol).all())
    assert not torch.equal(by_p.zero_point, by_l2.zero_point)  # the choice matters


def test_presets_options_are_valid_hqq_options():
    from qtransform.algorithms import check_algorithm_options

    w = _weight((64, 256), seed=2)
    for name in ("hqq4-g64", "hqq3-g64", "hqq2-g16"):
        p = qt.get_preset(name)
        (step,) = p.steps
        assert step.name == "hqq"
        check_algorithm_options(step.name, step.options)
        spec = p.spec
        assert step.options["error_norm"] == 4.0
        qp = hqq.optimize(w, spec, **step.options)
        g = spec.granularity.size
        assert bool((_group_norm(w, qp, g, 4) <= _group_norm(w, qt.choose_qparams(w, spec), g, 4) * (1 + 1e-5)).all())


def test_scale_refinement_helps():
    w = _weight((128, 512), seed=4)
    spec = _spec(3, qt.PerGroup(64))
    assert _sse(w, hqq.optimize(w, spec)) < _sse(w, hqq.optimize(w, spec, refine_scale=False))


def test_iters_zero_is_round_to_nearest():
    w = _weight(seed=1)
    spec = _spec(4, qt.PerGroup(64), scale_dtype="float16")
    qp, rtn = hqq.optimize(w, spec, iters=0), qt.choose_qparams(w, spec)
    assert torch.equal(qp.scale, rtn.scale) and torch.equal(qp.zero_point, rtn.zero_point)


def test_constant_and_tiny_groups_stay_finite():
    w = _weight((8, 128), seed=2)
    w[0] = 0.25  # constant rows: zero range
    w[1, :64] = 0.0
    w[2] = w[2] * 1e-6
    spec = _spec(4, qt.PerGroup(64), scale_dtype="float16")
    qp = hqq.optimize(w, spec)
    assert bool(torch.isfinite(qp.scale.float()).all() & torch.isfinite(qp.zero_point.float()).all())
    assert _sse(w, qp) <= _sse(w, qt.choose_qparams(w, spec)) * (1 + 1e-6)


# ----------------------------------------------------------------------------- the output is ordinary QParams
def test_output_is_stored_like_the_spec():
    w = _weight(seed=6).to(torch.bfloat16)
    spec = _spec(4, qt.PerGroup(64, axis=1), scale_dtype="float16")
    qp = hqq.optimize(w, spec)
    assert isinstance(qp, qt.QParams) and qp.spec == spec
    assert qp.scale.shape == (128, 4) and qp.scale.dtype == torch.float16
    assert qp.zero_point.dtype == torch.float16 and bool((qp.scale > 0).all())
    q = qt.quantize(w, qp)
    assert qt.dequantize(q).dtype == torch.bfloat16 and q.codes.dtype == torch.uint8


def test_inverse_scale_convention_matches_hqq():
    """hqq's W_r = (W_q - zero) / s' is ours with scale = 1/s' and the same zero."""
    w = _weight(seed=7)
    qp = hqq.optimize(w, _spec(4, qt.PerGroup(64)), iters=0)
    wq, meta = hqq_quantize.Quantizer.quantize(w, nbits=4, group_size=64, optimize=False, axis=1,
                                               bitpack=False, device="cpu", compute_dtype=torch.float32)
    torch.testing.assert_close(qp.scale.reshape(-1, 1), meta["scale"], rtol=1e-5, atol=0)
    torch.testing.assert_close(qp.zero_point.reshape(-1, 1), meta["zero"], rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- the iteration itself
def _reference(w, s, z, qmax, *, lp_norm, beta, kappa, iters):
    """hqq's zero-point iteration in weight units, written out plainly (no chunks, no shortcuts):
    per-iterate (scale, zero, squared error) for groups along the last axis of ``w`` (G, g)."""
    traj = []
    for _ in range(iters + 1):
        q = torch.round(w / s + z).clamp(0, qmax)
        wr = (q - z) * s
        traj.append((s, z.clone(), (w - wr).pow(2).sum(-1)))
        we = hqq_optimize.shrink_lp_op(w - wr, beta, lp_norm)
        z = torch.mean(q - (w - we) / s, dim=-1, keepdim=True)
        beta *= kappa
    return traj


@pytest.mark.parametrize("magnitude", [0.02, 2.0])  # 2.0: residuals past the shrink threshold
@pytest.mark.parametrize("early_stop", [False, True])
def test_returns_the_best_iterate(magnitude, early_stop):
    w = _weight((64, 256), seed=8, scale=magnitude)
    spec = _spec(3, qt.PerGroup(32))
    opts = dict(lp_norm=0.7, beta=10.0, kappa=1.05, iters=12)
    qp = hqq.optimize(w, spec, refine_scale=False, early_stop=early_stop, **opts)
    init = qt.choose_qparams(w, spec)
    traj = _reference(w.reshape(-1, 32), init.scale.reshape(-1, 1), init.zero_point.reshape(-1, 1), 7.0,
                      **opts)
    errs = torch.stack([e for _, _, e in traj])  # (iters + 1, G)
    if early_stop:  # a group stops at its first iterate that does not improve on its best
        best_so_far = torch.cummin(errs, 0).values
        stalls = torch.cat([torch.zeros_like(errs[:1], dtype=torch.bool), errs[1:] >= best_so_far[:-1]])
        first = torch.where(stalls.any(0), stalls.float().argmax(0), torch.full_like(errs[0], len(traj)).long())
        keep = torch.arange(len(traj))[:, None] < first[None, :]
        errs = torch.where(keep, errs, torch.full_like(errs, math.inf))
    expected = errs.min(0).values
    got = _group_sse(w, qp, 32).reshape(-1)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-9)
    assert bool((expected < errs[0] - 1e-12).any())  # the iteration did move some groups
    if magnitude > 1:  # hqq's own result (one update past its best) is worse than the best iterate
        assert float(got.sum()) < float(errs[-1].sum())


def test_kappa_changes_the_trajectory_when_shrink_is_active():
    w = _weight((64, 256), seed=9, scale=2.0)
    spec = _spec(3, qt.PerGroup(32))
    a = hqq.optimize(w, spec, refine_scale=False, kappa=1.0, early_stop=False)
    b = hqq.optimize(w, spec, refine_scale=False, kappa=1.3, early_stop=False)
    assert not torch.equal(a.zero_point, b.zero_point)


# ----------------------------------------------------------------------------- padded groups
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("shape,gran,whole,tail", [
    ((48, 250), qt.PerGroup(64), (slice(None), slice(0, 192)), (slice(None), slice(192, 250))),
    ((250, 24), qt.PerGroup(64, axis=0), (slice(0, 192), slice(None)), (slice(192, 250), slice(None))),
    ((3, 40), qt.PerGroup(64), None, (slice(None), slice(0, 40))),
])
def test_padded_groups(bits, shape, gran, whole, tail):
    """A width the group does not divide: the result keeps the shape, is never worse than RTN on the
    same grid (per group), and the groups are fitted on their real elements only: the whole groups
    as HQQ of the divisible part, the short last group as HQQ of the tail with its own length."""
    w = _weight(shape, seed=21)
    spec = _spec(bits, gran, pad=True)
    qp, rtn = hqq.optimize(w, spec), qt.choose_qparams(w, spec)
    assert qp.scale.shape == rtn.scale.shape
    y = qt.dequantize(qt.quantize(w, qp))
    assert y.shape == w.shape
    assert _sse(w, qp) <= _sse(w, rtn)
    axis = gran.axis % 2
    per_group = lambda qp: (qt.dequantize(qt.quantize(w, qp)) - w).pow(2).split(64, dim=axis)  # noqa: E731
    for a, b in zip(per_group(qp), per_group(rtn)):
        assert bool((a.sum(axis) <= b.sum(axis) * (1 + 1e-6)).all())
    cut = lambda t, n: t.narrow(axis, t.shape[axis] - n, n) if n else t  # noqa: E731
    n_tail = w[tail].shape[axis]
    alone = hqq.optimize(w[tail], _spec(bits, qt.PerGroup(n_tail, axis=gran.axis)))
    torch.testing.assert_close(cut(qp.scale, 1), alone.scale, rtol=0, atol=0)
    torch.testing.assert_close(cut(qp.zero_point, 1), alone.zero_point, rtol=0, atol=0)
    if whole is not None:
        body = hqq.optimize(w[whole], _spec(bits, gran))
        torch.testing.assert_close(qp.scale.narrow(axis, 0, body.scale.shape[axis]), body.scale, rtol=0, atol=0)


def test_padded_stack_and_vmap_and_steps():
    ws = torch.stack([_weight((16, 100), seed=s) for s in range(3)])
    spec = _spec(3, qt.PerGroup(32), pad=True)
    loop = [hqq.optimize(w, spec) for w in ws]
    for batched in (torch.func.vmap(lambda w: hqq.optimize(w, spec))(ws), hqq.optimize_stack(ws, spec)):
        assert batched.scale.shape == (3, 16, 4)
        for i, qp in enumerate(loop):
            torch.testing.assert_close(batched.scale[i], qp.scale, rtol=1e-5, atol=0)
    params = {"fc.weight": ws[0], "fc.bias": torch.randn(16)}
    qtree = qt.quantize_tree(params, qt.Recipe(default=spec, steps=["hqq"]))
    assert qtree["fc.weight"].shape == (16, 100)
    torch.testing.assert_close(qtree["fc.weight"].qparams.scale, loop[0].scale, rtol=0, atol=0)


# ----------------------------------------------------------------------------- batching, vmap, purity
def test_vmap_and_stack_equal_a_loop():
    ws = torch.stack([_weight((32, 128), seed=s) for s in range(4)])
    spec = _spec(4, qt.PerGroup(32), scale_dtype="float16")
    loop = [hqq.optimize(w, spec) for w in ws]
    for batched in (torch.func.vmap(lambda w: hqq.optimize(w, spec))(ws), hqq.optimize_stack(ws, spec)):
        assert batched.scale.shape == (4, 32, 4)
        for i, qp in enumerate(loop):
            torch.testing.assert_close(batched.scale[i], qp.scale, rtol=2e-3, atol=0)
            torch.testing.assert_close(batched.zero_point[i], qp.zero_point, rtol=2e-3, atol=2e-3)
            one = qt.QParams(scale=batched.scale[i], zero_point=batched.zero_point[i], spec=spec)
            assert math.isclose(_sse(ws[i], one), _sse(ws[i], qp), rel_tol=1e-4)


def test_chunking_does_not_change_the_result():
    w = _weight((64, 512), seed=10)
    spec = _spec(2, qt.PerGroup(16))
    a, b = hqq.optimize(w, spec), hqq.optimize(w, spec, chunk_size=1000)
    torch.testing.assert_close(a.scale, b.scale, rtol=1e-6, atol=0)
    assert math.isclose(_sse(w, a), _sse(w, b), rel_tol=1e-5)


def test_inputs_unchanged_and_no_gradient():
    w = _weight(seed=11).requires_grad_()
    before = w.detach().clone()
    spec = _spec(4, qt.PerGroup(64, axis=0))
    qp = hqq.optimize(w, spec)
    assert torch.equal(w.detach(), before)
    assert not qp.scale.requires_grad and not qp.zero_point.requires_grad


# ----------------------------------------------------------------------------- trees and the registry
def test_fit_tree_plugs_into_quantize_tree():
    params = {"layers.0.q.weight": _weight((32, 128), seed=1), "layers.0.k.weight": _weight((32, 128), seed=2),
              "layers.0.q.bias": torch.randn(32), "head.weight": _weight((16, 128), seed=3)}
    spec = _spec(4, qt.PerGroup(64), scale_dtype="float16")
    recipe = qt.Recipe(default=spec, rules={"head.*": qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))})
    seen = []
    qps = hqq.fit_tree(params, recipe, progress=lambda it, **kw: seen.extend(it) or seen)
    assert sorted(qps) == ["layers.0.k.weight", "layers.0.q.weight"] and len(seen) == 2
    qtree = qt.quantize_tree(params, recipe, qparams=qps)
    for path, qp in qps.items():
        assert torch.equal(qt.dequantize(qtree[path]), qt.dequantize(qt.quantize(params[path], qp)))
    assert sorted(hqq.fit_tree(params, recipe, paths=["*.k.*"])) == ["layers.0.k.weight"]


def test_fit_tree_errors_name_the_path():
    params = {"a.weight": _weight((8, 64)), "b.weight": _weight((8, 64))}
    params["b.weight"][3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"b\.weight: .*non-finite"):
        hqq.fit_tree(params, _spec(4, qt.PerGroup(32)))


def test_registered_as_a_local_calibration_free_step():
    algo = qt.get_algorithm("hqq")
    assert algo.local and algo.needs is None and algo.options is hqq.Options
    params = {"fc.weight": _weight((8, 64)), "fc.bias": torch.randn(8)}
    spec = _spec(4, qt.PerGroup(32), scale_dtype="float16")
    fit = algo(params, spec, error_norm=4.0, iters=5)
    direct = hqq.optimize(params["fc.weight"], spec, error_norm=4.0, iters=5)
    assert fit.params == {} and sorted(fit.qparams) == ["fc.weight"]
    assert torch.equal(fit.qparams["fc.weight"].zero_point, direct.zero_point)
    # the same through a recipe's steps
    qtree = qt.quantize_tree(params, qt.Recipe(default=spec, steps=[qt.Step("hqq", error_norm=4.0, iters=5)]))
    assert torch.equal(qt.dequantize(qtree["fc.weight"]), qt.dequantize(qt.quantize(params["fc.weight"], direct)))
    with pytest.raises(ValueError, match="hqq: unknown option"):
        algo(params, spec, bad=1)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("spec,match", [
    (qt.QuantSpec(format="uint4", granularity=qt.PerGroup(64)), "asymmetric"),
    (qt.QuantSpec(format="int4", granularity=qt.PerGroup(64), symmetric=False, zero_point_domain="float"),
     "uint1..uint8"),
    (qt.QuantSpec(format="uint4", granularity=qt.PerGroup(64), symmetric=False), "zero point must be a float"),
    (qt.QuantSpec(format="nf4", granularity=qt.PerGroup(64)), "uint1..uint8"),
    (_spec(4, qt.PerGroup(64), rounding="stochastic"), "deterministic rounding"),
    (_spec(4, qt.PerGroup(64), dynamic=True), "static"),
])
def test_bad_spec(spec, match):
    with pytest.raises(ValueError, match=match):
        hqq.optimize(_weight(), spec, path="m.w")
    assert not hqq.supports(spec)


def test_bad_granularity_and_shapes():
    w = _weight((128, 250))
    with pytest.raises(ValueError, match=r"m\.w: group size 64 does not divide axis -1 of size 250"):
        hqq.optimize(w, _spec(4, qt.PerGroup(64)), path="m.w")
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        hqq.optimize(w, _spec(4, qt.PerGroup(2, axis=2)))
    with pytest.raises(ValueError, match=r"shape \(L, \*shape\)"):
        hqq.optimize_stack(torch.randn(64), _spec(4, qt.PerGroup(64)))


@pytest.mark.parametrize("w,exc,match", [
    ([1.0, 2.0], TypeError, "must be a torch.Tensor"),
    (torch.ones(4, 64, dtype=torch.int32), TypeError, "floating-point"),
    (torch.full((4, 64), float("inf")), ValueError, "non-finite"),
])
def test_bad_weight(w, exc, match):
    with pytest.raises(exc, match=match):
        hqq.optimize(w, _spec(4, qt.PerGroup(64)))


@pytest.mark.parametrize("opts,exc,match", [
    ({"lp_norm": 0.0}, ValueError, r"lp_norm must be a number in \(0, 1\]"), ({"lp_norm": 1.5}, ValueError, "lp_norm"),
    ({"beta": 0.0}, ValueError, "beta must be a number > 0"), ({"kappa": 0.9}, ValueError, "kappa must be a number >= 1"),
    ({"iters": -1}, ValueError, "iters must be an int >= 0"), ({"iters": 2.5}, TypeError, "iters must be an int"),
    ({"tol": 1.0}, ValueError, r"tol must be a number in \[0, 1\)"), ({"beta": "10"}, TypeError, "beta must be a number"),
    ({"early_stop": 1}, TypeError, "early_stop must be true or false"), ({"chunk_size": 0}, ValueError, "chunk_size"),
    ({"error_norm": 0.5}, ValueError, "error_norm must be a number >= 1"), ({"error_norm": math.nan}, ValueError, "error_norm"),
    ({"iter": 5}, TypeError, "'iter'"), ({"lp_norm": math.inf}, ValueError, "lp_norm"),
])
def test_bad_options(opts, exc, match):
    with pytest.raises(exc, match=match):
        hqq.optimize(_weight(), _spec(4, qt.PerGroup(64)), **opts)

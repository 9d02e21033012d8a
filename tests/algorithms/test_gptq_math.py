"""The GPTQ solver against a textbook reference written here, column by column with explicit inverses,
and its properties for every format family."""

from __future__ import annotations

import warnings

import pytest
import torch

import qtransform as qt
from qtransform.algorithms.clip_search import search_range
from qtransform.algorithms.gptq import check_options
from qtransform.algorithms.gptq_math import gptq, gptq_many, inverse_hessian_factor


def problem(out=12, width=48, rows=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, width, generator=g, dtype=torch.float64)
    mix = torch.eye(width, dtype=torch.float64) + 0.4 * torch.randn(width, width, generator=g, dtype=torch.float64)
    x = (z @ mix) * torch.linspace(0.2, 3.0, width, dtype=torch.float64)  # correlated, uneven inputs
    w = torch.randn(out, width, generator=g, dtype=torch.float64).float()
    return x, w, (x.T @ x / rows).float()


# ------------------------------------------------------------------ the reference, independent of qtransform
def affine_params(block: torch.Tensor, bits: int, symmetric: bool):
    """Per-row (scale, zero) of a slice, as documented for integer specs ("full" symmetric range:
    amax maps to 2^(b-1) - 0.5; asymmetric: [min(x, 0), max(x, 0)] onto [0, 2^b - 1], integer zero)."""
    x = block.double()
    if symmetric:
        amax = x.abs().amax(1)
        scale = torch.where(amax > 0, amax / (2 ** (bits - 1) - 0.5), torch.ones_like(amax))
        return scale, torch.zeros_like(scale), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    lo, hi = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
    qmax = 2 ** bits - 1
    scale = torch.where(hi > lo, (hi - lo) / qmax, torch.ones_like(hi))
    zero = torch.round(-lo / scale).clamp(0, qmax)
    return scale, zero, 0, qmax


def reference(w, H, bits, symmetric, group, *, act_order=False, static=True, damp=0.01, unrounded=False):
    """Textbook GPTQ (OBS with explicit inverse Hessians, one column at a time), float64; with ``unrounded``
    also each column as it stood when rounded."""
    W = w.double().clone()
    H = H.double().clone()
    n = W.shape[1]
    dead = torch.diagonal(H) <= 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H = H + damp * torch.diagonal(H).mean() * torch.eye(n, dtype=torch.float64)
    order = torch.argsort(torch.diagonal(H), descending=True, stable=True).tolist() if act_order else list(range(n))
    params = {}
    if static:
        for g0 in range(0, n, group):
            params[g0] = affine_params(W[:, g0:g0 + group], bits, symmetric)
    Hinv = torch.linalg.inv(H)
    Q, U = torch.zeros_like(W), torch.zeros_like(W)
    remaining = list(order)
    for pos, j in enumerate(order):
        g0 = (j // group) * group if static else (pos // group) * group
        if not static and pos % group == 0:
            params[g0] = affine_params(W[:, order[pos:pos + group]], bits, symmetric)
        scale, zero, qmin, qmax = params[g0]
        q = (torch.clamp(torch.round(W[:, j] / scale + zero), qmin, qmax) - zero) * scale
        Q[:, j], U[:, j] = q, W[:, j]
        remaining.remove(j)
        d = Hinv[j, j]
        err = (W[:, j] - q) / d
        for k in remaining:
            W[:, k] -= err * Hinv[j, k]
        Hinv = Hinv - torch.outer(Hinv[:, j], Hinv[j, :]) / d  # remove column j
    return (Q.float(), U.float()) if unrounded else Q.float()


def spec_of(bits, symmetric, group, width):
    gran = qt.PerChannel(0) if group >= width else qt.PerGroup(group)
    return qt.QuantSpec(format=f"{'int' if symmetric else 'uint'}{bits}", granularity=gran, symmetric=symmetric)


def agree(a, b, ties=0.02):
    """Same quantized values except (rarely) where a rounding tie in float32 vs float64 went the other way."""
    differ = (a - b).abs() > 1e-4 * b.abs().amax()
    return float(differ.float().mean()) <= ties


@pytest.mark.parametrize("bits,symmetric,group,act_order", [
    (4, True, 48, False), (4, False, 16, False), (3, False, 16, True), (4, True, 16, True), (2, False, 8, False)])
@pytest.mark.parametrize("block_size", [8, 128])
def test_matches_the_textbook_reference(bits, symmetric, group, act_order, block_size):
    x, w, H = problem()
    spec = spec_of(bits, symmetric, group, w.shape[1])
    ref = reference(w, H, bits, symmetric, group, act_order=act_order, static=True)
    r = gptq(w, H, spec, act_order=act_order, static_groups=True, block_size=block_size)
    assert agree(r.weight, ref)


@pytest.mark.parametrize("act_order,static", [(False, True), (True, True), (False, False)])
def test_the_unrounded_weight_is_each_column_as_it_stood_when_rounded(act_order, static):
    """``unrounded``: the textbook's compensated columns at their rounding (float32 against float64), and rounding
    it to nearest with the result's parameters gives the result's weight exactly."""
    x, w, H = problem(seed=5)
    spec = spec_of(3, False, 16, w.shape[1])
    q_ref, u_ref = reference(w, H, 3, False, 16, act_order=act_order, static=static, unrounded=True)
    r = gptq(w, H, spec, act_order=act_order, static_groups=static, block_size=8, unrounded=True)
    assert agree(r.weight, q_ref)
    assert gptq(w, H, spec, act_order=act_order, static_groups=static, block_size=8).unrounded is None
    torch.testing.assert_close(r.unrounded, u_ref, rtol=1e-3, atol=1e-4 * float(u_ref.abs().max()))
    assert r.unrounded.dtype == torch.float32 and r.unrounded.shape == w.shape
    assert torch.equal(qt.dequantize(qt.quantize(r.unrounded, r.qparams)), r.weight)


def test_dynamic_groups_follow_the_updated_columns():
    x, w, H = problem(seed=3)
    spec = spec_of(4, False, 16, 48)
    ref = reference(w, H, 4, False, 16, static=False)
    r = gptq(w, H, spec, act_order=False, static_groups=False, block_size=8)
    assert agree(r.weight, ref)
    assert not torch.equal(r.weight, gptq(w, H, spec, static_groups=True).weight)


def test_lazy_blocks_change_nothing():
    x, w, H = problem(seed=1)
    spec = spec_of(4, False, 16, 48)
    a, b = gptq(w, H, spec, block_size=5), gptq(w, H, spec, block_size=48)
    assert torch.allclose(a.weight, b.weight, atol=1e-5) and a.loss == pytest.approx(b.loss, rel=1e-4)


def test_sub_blocks_inside_a_lazy_block_agree_with_the_textbook(monkeypatch):
    """Errors pushed column by column onto the next 16 columns, onto the block's rest by one product per 16: the
    textbook result (float32 vs float64 ties aside), and within float noise of column-by-column updates."""
    from qtransform.algorithms import gptq_math
    x, w, H = problem(out=20, width=96, rows=600, seed=5)
    spec = spec_of(4, False, 16, 96)
    ref = reference(w, H, 4, False, 16, act_order=True, static=True)
    monkeypatch.setattr(gptq_math, "_SUB_BLOCK", 4)
    a = gptq(w, H, spec, act_order=True, static_groups=True, block_size=64)
    monkeypatch.setattr(gptq_math, "_SUB_BLOCK", 64)
    b = gptq(w, H, spec, act_order=True, static_groups=True, block_size=64)
    assert agree(a.weight, ref) and agree(b.weight, ref)
    assert agree(a.weight, b.weight, ties=0.002) and a.loss == pytest.approx(b.loss, rel=1e-4)


FAMILIES = [("int8", qt.PerChannel(0), True), ("int2", qt.PerGroup(16), True), ("uint4", qt.PerGroup(16), False),
            ("nf4", qt.PerGroup(16), True), ("fp8_e4m3", qt.PerChannel(0), True), ("fp6_e3m2", qt.PerGroup(16), True),
            ("fp4_e2m1", qt.PerGroup(16), True), ("mxfp4", qt.PerGroup(32), True), ("mxfp6_e2m3", qt.PerGroup(32), True),
            ("nvfp4", qt.PerGroup(16), True), ("mx6", qt.PerGroup(16), True), ("mx9", qt.PerGroup(16), True),
            ("bfp16", qt.PerGroup(8), True)]


@pytest.mark.parametrize("fmt,gran,symmetric", FAMILIES, ids=[f[0] for f in FAMILIES])
@pytest.mark.parametrize("init", ["minmax", "clip"])
def test_every_format_family_beats_round_to_nearest(fmt, gran, symmetric, init):
    x, w, H = problem(out=16, width=64, rows=600, seed=2)
    spec = qt.QuantSpec(format=fmt, granularity=gran, symmetric=symmetric)
    out_err = lambda v: float(((v.double() - w.double()) @ x.T).pow(2).sum())  # noqa: E731
    rtn = qt.fake_quantize(w, qt.choose_qparams(w, spec))
    r = gptq(w, H, spec, act_order=True, static_groups=True, init=init)
    assert out_err(r.weight) < out_err(rtn)
    assert torch.equal(qt.fake_quantize(r.weight, r.qparams), r.weight)  # on the grid of its own parameters
    assert r.qparams.spec == spec and r.loss > 0


def test_act_order_and_g_idx():
    x, w, H = problem(seed=4)
    spec = spec_of(4, False, 16, 48)
    r = gptq(w, H, spec, act_order=True, static_groups=False)
    perm = torch.argsort(torch.diagonal(H), descending=True, stable=True)
    assert torch.equal(r.perm, perm)
    position = torch.argsort(perm)
    assert torch.equal(r.g_idx.long(), position // 16)
    assert torch.equal(qt.fake_quantize(r.weight[:, perm], r.qparams), r.weight[:, perm])
    static = gptq(w, H, spec, act_order=True, static_groups=True)
    assert static.g_idx is None and torch.equal(qt.fake_quantize(static.weight, static.qparams), static.weight)


def test_dead_columns_and_singular_hessians():
    x, w, H = problem(seed=5)
    x[:, 7] = 0
    H = (x.T @ x / x.shape[0]).float()
    r = gptq(w, H, spec_of(4, True, 16, 48))
    assert torch.all(r.weight[:, 7] == 0) and torch.isfinite(r.weight).all()
    low_rank = torch.randn(3, 48, dtype=torch.float64)
    singular = (low_rank.T @ low_rank).float()
    with pytest.warns(UserWarning, match="fc.weight: gptq: Cholesky factorization failed"):
        out = gptq(w, singular, spec_of(4, True, 16, 48), damp=0.0, paths=["fc.weight"])
    assert torch.isfinite(out.weight).all()
    bad = H.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="fc.weight"):
        gptq(w, bad, spec_of(4, True, 16, 48), paths=["fc.weight"])


def test_inverse_factor_is_the_upper_cholesky_of_the_damped_inverse():
    x, w, H = problem(seed=6)
    U, dead = inverse_hessian_factor(H, damp=0.05)
    Hd = H.double() + 0.05 * torch.diagonal(H).double().mean() * torch.eye(48, dtype=torch.float64)
    assert not dead.any() and torch.equal(U, torch.triu(U))
    assert torch.allclose(U.double().T @ U.double(), torch.linalg.inv(Hd), rtol=1e-4, atol=1e-6)


def test_layers_sharing_an_input_are_solved_as_if_alone():
    x, w, H = problem(out=20, seed=7)
    a, b = w[:8], w[8:]
    specs = [spec_of(4, False, 16, 48), spec_of(3, True, 16, 48)]
    both = gptq_many([a, b], H, specs, act_order=True, static_groups=True)
    for got, weight, spec in zip(both, (a, b), specs):
        alone = gptq(weight, H, spec, act_order=True, static_groups=True)
        assert torch.allclose(got.weight, alone.weight, atol=1e-6)
        assert got.loss == pytest.approx(alone.loss, rel=1e-5)


def test_groups_that_do_not_divide_the_width():
    x, w, H = problem(seed=8)
    spec = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(20), symmetric=False, pad=True)
    for static in (True, False):
        r = gptq(w, H, spec, static_groups=static)
        assert r.qparams.scale.shape == (12, 3)
        assert torch.equal(qt.fake_quantize(r.weight, r.qparams), r.weight)


def test_inits_clip_and_hqq():
    x, w, H = problem(out=32, width=64, rows=600, seed=9)
    out_err = lambda v: float(((v.double() - w.double()) @ x.T).pow(2).sum())  # noqa: E731
    spec = qt.QuantSpec(format="uint3", granularity=qt.PerGroup(16), symmetric=False, zero_point_domain="float")
    rtn = out_err(qt.fake_quantize(w, qt.choose_qparams(w, spec)))
    errs = {init: out_err(gptq(w, H, spec, act_order=True, static_groups=True, init=init).weight)
            for init in ("minmax", "clip", "hqq")}
    assert max(errs.values()) < rtn  # every init beats round to nearest; which is best depends on the data
    energy = torch.diagonal(H)
    weighted = lambda qp: float(((qt.fake_quantize(w, qp) - w).square() * energy).sum())  # noqa: E731
    assert weighted(search_range(w, spec, energy)) < weighted(qt.choose_qparams(w, spec))  # the search's objective
    with pytest.raises(ValueError, match="hqq"):
        gptq(w, H, spec_of(4, True, 16, 64), init="hqq")


def test_clip_search_weighs_columns_by_their_energy():
    w = torch.cat([torch.linspace(-1, 1, 31), torch.tensor([4.0])]).reshape(1, 32)
    spec = qt.QuantSpec(format="int3", granularity=qt.PerChannel(0))
    flat = search_range(w, spec)
    heavy = torch.ones(32)
    heavy[-1] = 1e4  # the outlier's input is large: clipping it costs too much
    assert float(flat.scale) < float(qt.choose_qparams(w, spec).scale)
    assert float(search_range(w, spec, heavy).scale) == pytest.approx(float(qt.choose_qparams(w, spec).scale))


@pytest.mark.parametrize("kwargs,match", [
    ({"init": "nope"}, "init"), ({"block_size": 0}, "block_size"), ({"damp": -0.5}, "damp"),
    ({}, "W must be a 2-D")])
def test_bad_arguments(kwargs, match):
    x, w, H = problem()
    spec = spec_of(4, True, 16, 48)
    with pytest.raises(ValueError, match=match):
        gptq(w if kwargs else w[0], H, spec, **kwargs)
    with pytest.raises(ValueError, match="H must be"):
        gptq(w, H[:4], spec)
    with pytest.raises(ValueError, match="stochastic"):
        gptq(w, H, spec.replace(rounding="stochastic"))
    with pytest.raises(TypeError, match="spec"):
        gptq(w, H, "int4")


@pytest.mark.parametrize("options,match", [
    ({"damp": -1}, "damp"), ({"block_size": 0}, "block_size"), ({"colour": 1}, "unknown"),
    ({"static_groups": False}, "g_idx"), ({"observer": "hessian", "init": "minmax"}, "no quantization range"),
    ({"observer": "mse"}, "init='minmax'"), ({"true_sequential": "yes"}, "true_sequential must be true or false")])
def test_step_options(options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        check_options(**options)
    check_options(act_order=False, static_groups=False, init="hqq", damp=0.1, block_size=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_options()

"""SignRound's learned quantizer: its straight-through gradient against one derived by hand, round to nearest at
the start for every registered format, the codec's grid at the end, the signed step's ranges."""

from __future__ import annotations

import pytest
import torch

import qtransform as qt
from qtransform.algorithms import signround_math as sm


def _specs():
    out = []
    for name in qt.FORMATS:
        f = qt.get_format(name)
        g = qt.PerGroup(f.block) if f.block else qt.PerGroup(32)
        if f.codec.bits > 1:
            out.append(qt.QuantSpec(format=name, granularity=g))
        if not f.symmetric_only and f.codec.bits > 1:
            out += [qt.QuantSpec(format=name, granularity=g, symmetric=False, zero_point_domain=d)
                    for d in ("int", "float", "offset")]
    return out


SPECS = _specs()


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_start_is_round_to_nearest_and_end_is_on_the_codec_grid(spec):
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    lq = sm.prepare_weight(w, spec)
    t = sm.minmax_init(lq)
    rtn = qt.dequantize(qt.quantize(w, qt.choose_qparams(w, spec)))
    assert torch.equal(sm.learned_fake_quantize(lq, t), rtn)
    # some learned state: offsets and factors off their start
    g = torch.Generator().manual_seed(2)
    t = sm.Learned(torch.rand(w.shape, generator=g) - 0.5, 0.5 + 0.5 * torch.rand(t.alpha.shape, generator=g),
                   0.5 + 0.5 * torch.rand(t.beta.shape, generator=g))
    y = sm.learned_fake_quantize(lq, t)
    w2, qp = sm.finalize(lq, t)
    assert qp.spec == spec
    assert torch.equal(w2, y)                                       # what was trained is what is stored
    assert torch.equal(qt.dequantize(qt.quantize(w2, qp)), w2)      # on the format's grid
    assert torch.equal(w, torch.randn(6, 64, generator=torch.Generator().manual_seed(1)))  # input untouched


def test_nvfp4_keeps_the_float_weight_global_scale():
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    spec = qt.QuantSpec(format="nvfp4")
    lq = sm.prepare_weight(w, spec)
    t = sm.minmax_init(lq)
    _, qp = sm.finalize(lq, t._replace(alpha=t.alpha * 0.6, beta=t.beta * 0.6))
    assert torch.equal(qp.global_scale, qt.choose_qparams(w, spec).global_scale)


def _hand_gradient(w, V, alpha, beta, target, ste: bool):
    """dL/dV, dL/dalpha, dL/dbeta of L = sum((W~ - target)^2) for uint2 asymmetric, one group, integer zero
    point, derived by hand (straight-through rounding; clamp passes no gradient outside [0, 3])."""
    wmin, wmax = float(w.min()), float(w.max())
    lo, hi = alpha * min(wmin, 0.0), beta * max(wmax, 0.0)
    s = (hi - lo) / 3
    z = round(-lo / s)
    dV, ds_total, dlo_direct = [], 0.0, 0.0
    for wi, vi, ti in zip(w.tolist(), V.tolist(), target.tolist()):
        u = wi / s + vi + z
        g = min(max(round(u), 0), 3)
        y = (g - z) * s
        dy = 2 * (y - ti)
        inside = 0 <= u <= 3
        dV.append(dy * s if inside else 0.0)
        if inside:      # y = (u - z) s in the gradient: dy/ds = (g - z) - w/s (z cancels)
            ds_total += dy * ((g - z) - wi / s)
        else:           # y = (g - z) s with g fixed: dy/ds = (g - z) - s dz/ds; dz/ds = lo/s^2 (ste), 0 (round)
            ds_total += dy * ((g - z) - (lo / s if ste else 0.0))
            dlo_direct += dy * (1.0 if ste else 0.0)  # dy/dlo through z = -lo/s: -s * (-1/s)
    dlo = ds_total * (-1 / 3) + dlo_direct
    dhi = ds_total * (1 / 3)
    return torch.tensor(dV), dlo * min(wmin, 0.0), dhi * max(wmax, 0.0)


@pytest.mark.parametrize("ste", [True, False])
def test_straight_through_gradient_equals_the_hand_derived_one(ste):
    w = torch.tensor([[-1.0, -0.2, 0.3, 0.9]])
    spec = qt.QuantSpec(format="uint2", granularity=qt.PerGroup(4), symmetric=False)
    V = torch.tensor([[0.1, -0.3, 0.2, 0.4]])
    alpha, beta = 0.8, 0.9               # the -1.0 and 0.9 fall outside: the zero point's gradient shows
    target = torch.tensor([[-0.7, -0.1, 0.5, 0.6]])
    lq = sm.prepare_weight(w, spec)
    t = sm.Learned(V.clone().requires_grad_(), torch.full((1, 1), alpha).requires_grad_(),
                   torch.full((1, 1), beta).requires_grad_())
    loss = ((sm.learned_fake_quantize(lq, t, zero_point="ste" if ste else "round") - target) ** 2).sum()
    gV, ga, gb = torch.autograd.grad(loss, t)
    hV, ha, hb = _hand_gradient(w[0], V[0], alpha, beta, target[0], ste)
    torch.testing.assert_close(gV[0], hV.float(), rtol=1e-5, atol=1e-6)
    assert ga.item() == pytest.approx(ha, rel=1e-5, abs=1e-6)
    assert gb.item() == pytest.approx(hb, rel=1e-5, abs=1e-6)
    if not ste:  # a constant zero point: the gradient reaches alpha and beta through the scale alone, same sign
        assert ga.item() / gb.item() == pytest.approx(-min(float(w.min()), 0) / max(float(w.max()), 0), rel=1e-5)


def test_offsets_and_factors_stay_in_range_under_many_steps():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    spec = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False)
    lq = sm.prepare_weight(w, spec)
    t = sm.minmax_init(lq)
    target = torch.randn(8, 64, generator=torch.Generator().manual_seed(5)) * 3
    for _ in range(40):  # a far target: every step pushes against the bounds
        tt = sm.Learned(*(x.clone().requires_grad_() for x in t))
        loss = ((sm.learned_fake_quantize(lq, tt) - target) ** 2).sum()
        t = sm.sign_step(t, sm.Learned(*torch.autograd.grad(loss, tt)), lr=0.1, minmax_lr=0.1)
    assert float(t.offset.min()) >= -0.5 and float(t.offset.max()) <= 0.5
    assert float(t.offset.abs().max()) == 0.5                          # some reached the bound
    for f in (t.alpha, t.beta):
        assert float(f.min()) >= 0.5 and float(f.max()) <= 1.0


def test_a_step_moves_each_value_by_lr_against_its_gradient_sign():
    t = sm.Learned(torch.tensor([0.0, 0.1, -0.1]), torch.tensor([1.0, 0.7]), torch.tensor([0.9]))
    g = sm.Learned(torch.tensor([2.0, -1e-9, 0.0]), torch.tensor([-5.0, 1.0]), None)
    new = sm.sign_step(t, g, lr=0.05, minmax_lr=0.2)
    torch.testing.assert_close(new.offset, torch.tensor([-0.05, 0.15, -0.1]))
    torch.testing.assert_close(new.alpha, torch.tensor([1.0, 0.5]))
    assert new.beta is t.beta


def test_stacked_experts_and_transposed_layouts_tile_like_the_codec():
    w3 = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(6))
    spec = qt.stacked_spec(qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False), w3.shape)
    lq = sm.prepare_weight(w3, spec)
    assert lq.groups.grid == (3, 8, 2)
    rtn = qt.dequantize(qt.quantize(w3, qt.choose_qparams(w3, spec)))
    assert torch.equal(sm.learned_fake_quantize(lq, sm.minmax_init(lq)), rtn)
    wt = torch.randn(64, 8, generator=torch.Generator().manual_seed(7))   # Conv1D: groups along axis 0
    spec_t = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32, axis=0))
    lq = sm.prepare_weight(wt, spec_t)
    assert lq.groups.grid == (2, 8)


def test_bad_input_is_named():
    w = torch.randn(4, 30)
    with pytest.raises(ValueError, match="layers.0.w: group size 32 does not divide"):
        sm.prepare_weight(w, qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)), path="layers.0.w")
    lq = sm.prepare_weight(torch.randn(4, 32), qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)))
    with pytest.raises(ValueError, match="zero_point must be one of"):
        sm.learned_fake_quantize(lq, sm.minmax_init(lq), zero_point="floor")
    with pytest.raises(ValueError, match="dynamic"):
        sm.prepare_weight(torch.randn(4, 32), qt.QuantSpec(format="int8", granularity=qt.PerGroup(32), dynamic=True))


def test_a_given_start_is_used_exactly_where_the_factors_stand_at_one_and_its_range_elsewhere():
    """``prepare_weight(start=qp)``: with ``alpha = beta = 1`` the quantizer uses ``qp`` as given (its round to nearest of
    the weight, whatever float rounding inverting its range would cost); moving a factor recomputes that group's
    parameters from the range ``qp`` stands for, scaled (the range: its lowest and highest codes dequantized)."""
    spec = qt.QuantSpec(format="uint3", granularity=qt.PerGroup(16), symmetric=False)
    w = torch.randn(4, 32, generator=torch.Generator().manual_seed(7))
    qp = qt.choose_qparams(w * 0.8, spec)  # parameters of a narrower range than w's own
    lq = sm.prepare_weight(w, spec, start=qp)
    t = sm.minmax_init(lq)
    assert torch.equal(sm.learned_fake_quantize(lq, t), qt.dequantize(qt.quantize(w, qp)))
    s, z = qp.effective()
    torch.testing.assert_close(lq.wmin, (0 - z) * s)
    torch.testing.assert_close(lq.wmax, (7 - z) * s)
    alpha = t.alpha.clone()
    alpha[0, 0] = 0.75
    _, moved = sm.finalize(lq, t._replace(alpha=alpha))
    want = qt.QParams.from_range(lq.wmin[0, 0] * 0.75, lq.wmax[0, 0], spec)
    assert torch.equal(moved.scale[0, 0], want.scale) and torch.equal(moved.zero_point[0, 0], want.zero_point)
    assert torch.equal(moved.scale[1:], qp.scale[1:]) and torch.equal(moved.zero_point[1:], qp.zero_point[1:])


def test_a_start_of_another_spec_or_grid_is_refused_by_path():
    spec = qt.QuantSpec(format="uint3", granularity=qt.PerGroup(16), symmetric=False)
    w = torch.randn(4, 32)
    other = qt.choose_qparams(w, qt.QuantSpec(format="uint4", granularity=qt.PerGroup(16), symmetric=False))
    with pytest.raises(ValueError, match="layers.1.w: signround: the start's parameters must be QParams of spec"):
        sm.prepare_weight(w, spec, path="layers.1.w", start=other)
    wider = qt.choose_qparams(torch.randn(4, 48), spec)
    with pytest.raises(ValueError, match=r"layers.1.w: signround: .*one scale per group \(grid \(4, 2\)\)"):
        sm.prepare_weight(w, spec, path="layers.1.w", start=wider)


def _group_errors(w, y, group):
    return (w - y).square().reshape(w.shape[0], -1, group).sum(-1)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_clip_init_never_starts_worse_than_min_max(spec):
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.1, 3, 64)
    w[0, 5] = 9.0  # an outlier a clipped range gives up
    lq = sm.prepare_weight(w, spec)
    a = sm.learned_fake_quantize(lq, sm.minmax_init(lq))
    t = sm.clip_init(lq)
    b = sm.learned_fake_quantize(lq, t)
    assert torch.equal(t.alpha, t.beta) and bool(((t.alpha >= 0.5) & (t.alpha <= 1)).all())
    assert bool((t.offset == 0).all())
    group = lq.groups.shape[-1] // lq.groups.grid[-1] if lq.ranged else 64
    assert bool((_group_errors(w, b, group) <= _group_errors(w, a, group) + 1e-6).all())


@pytest.mark.parametrize("fmt, symmetric", [("uint2", False), ("uint3", False), ("int4", True)])
def test_clip_init_picks_the_least_error_of_the_grid_found_through_the_codec(fmt, symmetric):
    """Brute force: each candidate factor as a clipped range through QParams.from_range and the codec."""
    w = torch.randn(4, 128, generator=torch.Generator().manual_seed(4)) ** 3
    spec = qt.QuantSpec(format=fmt, granularity=qt.PerGroup(32), symmetric=symmetric)
    t = sm.clip_init(sm.prepare_weight(w, spec))
    lo, hi = w.reshape(4, 4, 32).amin(-1), w.reshape(4, 4, 32).amax(-1)
    errs = []
    for c in torch.linspace(1.0, 0.5, 11).tolist():
        y = qt.dequantize(qt.quantize(w, qt.QParams.from_range(lo * c, hi * c, spec)))
        errs.append(_group_errors(w, y, 32))
    errs = torch.stack(errs)  # (11, rows, groups)
    want = torch.linspace(1.0, 0.5, 11)[errs.argmin(0)]  # first least: 1 wins ties
    torch.testing.assert_close(t.alpha, want, rtol=0, atol=1e-6)
    assert float(torch.gather(errs, 0, errs.argmin(0)[None]).sum()) < float(errs[0].sum())  # clipping paid off

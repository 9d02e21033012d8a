"""torch.func through the fake quantizers: forward mode gives the straight-through tangents (it gave zeros),
reverse and forward mode agree, vmap equals the loop, observers refuse a differentiated input by name instead of a
silent zero, and quantization parameters a step returns in another form than the spec stores are cast where exact
and refused by path otherwise."""

import pytest
import torch

import qtransform as qt
from qtransform import learn

SPEC = qt.QuantSpec(format="int4", granularity=qt.PerChannel(0))


def _x():
    return torch.tensor([[0.1, -0.5, 0.25, 1.0, -3.0], [0.3, 0.05, -0.2, 0.7, 0.0]])


def test_forward_mode_gives_the_straight_through_tangent():
    x = _x()
    qp = qt.choose_qparams(x * 0.5, SPEC)  # a narrower range: the large values clip
    v = torch.arange(1.0, 11.0).reshape(x.shape)
    _, tangent = torch.func.jvp(lambda t: qt.fake_quantize(t, qp), (x,), (v,))
    s = qp.scale.expand_as(x)  # by hand: 1 inside [-8 s, 7 s] (int4's codes), 0 outside
    inside = (x >= -8 * s) & (x <= 7 * s)
    assert torch.equal(tangent, torch.where(inside, v, torch.zeros_like(v)))
    assert bool(inside.any()) and bool((~inside).any())
    assert torch.equal(torch.func.jacfwd(lambda t: qt.fake_quantize(t, qp))(x),
                       torch.func.jacrev(lambda t: qt.fake_quantize(t, qp))(x))


def test_vmap_of_the_learned_quantizer_is_the_loop():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, 32, generator=g)
    spec = qt.QuantSpec(format="uint3", granularity=qt.PerGroup(16), symmetric=False, scale_dtype="float16")
    rs = [learn.learnable(w[i], spec) for i in range(3)]
    lo, hi = torch.stack([r.lo * 0.9 for r in rs]), torch.stack([r.hi * 0.8 for r in rs])
    batched = torch.func.vmap(lambda a, b, c: learn.fake_quantize(a, learn.LearnedRange(lo=b, hi=c, spec=spec)))(w, lo, hi)
    loop = torch.stack([learn.fake_quantize(w[i], learn.LearnedRange(lo=lo[i], hi=hi[i], spec=spec)) for i in range(3)])
    assert torch.equal(batched, loop)


def test_observers_refuse_an_input_torch_func_differentiates():
    x = _x()
    with pytest.raises(ValueError, match="torch.func differentiates x"):
        torch.func.grad(lambda t: qt.fake_quantize(t, qt.choose_qparams(t, SPEC)).sum())(x)
    with pytest.raises(ValueError, match="torch.func differentiates x"):
        torch.func.jvp(lambda t: qt.fake_quantize(t, qt.choose_qparams(t, SPEC)), (x,), (x,))
    # detached, the parameters are constants and the straight-through gradient flows
    g = torch.func.grad(lambda t: qt.fake_quantize(t, qt.choose_qparams(t.detach(), SPEC)).sum())(x)
    assert float(g.sum()) > 0
    # plain autograd (a parameter that requires grad): statistics are taken detached, as every observer's
    p = torch.nn.Parameter(x.clone())
    assert torch.equal(qt.choose_qparams(p, SPEC).scale, qt.choose_qparams(x, SPEC).scale)


def _step_returning(scale_of, zero_of):
    def step(params, plan, *, context):
        qp = qt.choose_qparams(params["fc.weight"], plan.specs["fc.weight"])
        return qt.Fit(qparams={"fc.weight": qt.QParams(scale=scale_of(qp.scale), zero_point=zero_of(qp.zero_point),
                                                        spec=qp.spec)})
    return step


def test_a_steps_qparams_are_cast_where_exact_and_refused_by_path_otherwise():
    spec = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(16), symmetric=False, scale_dtype="float16")
    params = {"fc.weight": torch.randn(4, 32, generator=torch.Generator().manual_seed(1))}
    rtn = qt.choose_qparams(params["fc.weight"], spec)
    qt.register_algorithm("exact_demo", _step_returning(lambda s: s.float(), lambda z: z.float()))
    qt.register_algorithm("inexact_demo", _step_returning(lambda s: s.float() * 1.0001, lambda z: z.float()))
    qt.register_algorithm("fraction_demo", _step_returning(lambda s: s, lambda z: z.float() + 0.5))
    try:
        fit = qt.run_steps(params, qt.Recipe(default=spec, steps=[qt.Step("exact_demo")]))
        got = fit.qparams["fc.weight"]
        assert got.scale.dtype == torch.float16 and got.zero_point.dtype == torch.uint8
        assert torch.equal(got.scale, rtn.scale) and torch.equal(got.zero_point, rtn.zero_point)
        with pytest.raises(ValueError, match=r"recipe.steps\[0\] \(inexact_demo\): fc.weight: qparams.scale is float32"):
            qt.run_steps(params, qt.Recipe(default=spec, steps=[qt.Step("inexact_demo")]))
        with pytest.raises(ValueError, match=r"fc.weight: qparams.zero_point .* uint8"):
            qt.run_steps(params, qt.Recipe(default=spec, steps=[qt.Step("fraction_demo")]))
        with pytest.raises(ValueError, match="fc.weight: qparams.zero_point"):
            qt.quantize_tree(params, spec, qparams={"fc.weight": qt.QParams(
                scale=rtn.scale, zero_point=rtn.zero_point.float() + 0.25, spec=spec)})
    finally:
        for name in ("exact_demo", "inexact_demo", "fraction_demo"):
            qt.ALGORITHMS.unregister(name)

"""The ``lowrank`` step and its math: optimality against brute force, exactness at full rank, the
reference the pipeline hands it, and what later steps do to its corrections."""

import pytest
import torch

import qtransform as qt
from qtransform.algorithms.lowrank_math import LowRank, hessian_basis, lowrank_error

G = torch.Generator().manual_seed(0)
SPEC = qt.QuantSpec(format="uint2", granularity=qt.PerGroup(16), symmetric=False)


def _rand(*shape):
    return torch.randn(*shape, generator=G, dtype=torch.float64)


def _tail(m: torch.Tensor, r: int) -> float:
    """The best rank-r approximation's error ||M - M_r||_F, from M's singular values (Eckart-Young)."""
    s = torch.linalg.svdvals(m)
    return float(s[r:].pow(2).sum().sqrt())


@pytest.mark.parametrize("r", [1, 3, 7])
def test_weighted_correction_is_the_best_rank_r_output_error(r):
    E, X = _rand(12, 20), _rand(50, 20) * torch.linspace(0.1, 3, 20, dtype=torch.float64)  # anisotropic inputs
    c = lowrank_error(E, rank=r, hessian=X.T @ X / 50, damp=0.0)
    got = float(((E - c.delta()) @ X.T).norm())
    assert got == pytest.approx(_tail(E @ X.T, r), rel=1e-8)  # the optimum, computed from E·Xᵀ alone
    plain = lowrank_error(E, rank=r)  # the unweighted SVD is no better on these inputs
    assert float(((E - plain.delta()) @ X.T).norm()) >= got - 1e-9


@pytest.mark.parametrize("r", [1, 4])
def test_unweighted_correction_is_eckart_young(r):
    E = _rand(9, 14)
    c = lowrank_error(E, rank=r)
    assert (c.a.shape, c.b.shape) == ((r, 14), (9, r))
    assert float((E - c.delta()).norm()) == pytest.approx(_tail(E, r), rel=1e-8)


def test_full_rank_reproduces_the_error():
    E, X = _rand(6, 10), _rand(40, 10)
    for H in (None, X.T @ X / 40):
        c = lowrank_error(E, rank=50, hessian=H, damp=0.0)
        assert c.rank == 6
        torch.testing.assert_close(c.delta(), E, rtol=0, atol=1e-10)


def test_factors_are_balanced_and_keep_dtype_and_inputs():
    E = torch.randn(8, 32, generator=G)
    H = torch.eye(32) * 1e-3  # small eigenvalues: A grows as Λ^{-1/2}, B does not shrink to compensate
    before = E.clone()
    c = lowrank_error(E, rank=4, hessian=H, damp=0.0)
    assert c.a.dtype == c.b.dtype == torch.float32 and torch.equal(E, before)
    sa, sb = torch.linalg.svdvals(c.a)[0], torch.linalg.svdvals(c.b)[0]  # both sqrt(S_r)·(Λ^{-1/2} for a)
    assert float(sa) == pytest.approx(float(sb) / 1e-3 ** 0.5, rel=1e-4)


def test_damping_floors_eigenvalues():
    U, lam = hessian_basis(torch.diag(torch.tensor([2.0, 0.0])), damp=0.5)
    assert sorted(lam.tolist()) == pytest.approx([0.5, 2.5])  # + 0.5 · mean(2, 0)
    _, lam0 = hessian_basis(torch.diag(torch.tensor([2.0, 0.0], dtype=torch.float64)), damp=0.0)
    assert float(lam0.min()) == pytest.approx(2e-10)  # floored, never zero
    _, lam32 = hessian_basis(torch.diag(torch.tensor([2.0, 0.0])), damp=0.0)
    assert lam32.dtype == torch.float32 and float(lam32.min()) == pytest.approx(2e-6)  # float32: a higher floor
    with pytest.raises(ValueError, match="hessian is zero"):
        hessian_basis(torch.zeros(3, 3))


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_rank_names_the_option(bad):
    with pytest.raises((ValueError, TypeError), match="rank"):
        qt.run_steps({"fc.weight": torch.randn(8, 32)}, qt.Recipe(default=SPEC, steps=[qt.Step("lowrank", rank=bad)]))
    with pytest.raises(ValueError, match="rank"):
        lowrank_error(torch.randn(4, 4), rank=bad)


def test_weighted_needs_data_unweighted_does_not():
    w = {"fc.weight": torch.randn(8, 32, generator=G)}
    with pytest.raises(ValueError, match="calibration"):
        qt.run_steps(w, qt.Recipe(default=SPEC, steps=[qt.Step("lowrank")]))
    fit = qt.run_steps(w, qt.Recipe(default=SPEC, steps=[qt.Step("lowrank", weighted=False, rank=2)]))
    assert fit.lowrank["fc.weight"].rank == 2 and fit.info["fc.weight"]["lowrank_rank"] == 2


class _Calib:
    """A calibrator whose linear inputs are fixed tensors: ``{module: X}``."""

    def __init__(self, inputs):
        self.inputs = inputs

    def site_stats(self, params, sites):
        return {s: qt.observe(st, self.inputs[s.module]) for s, st in sites.items()}


def test_weighted_step_uses_each_linears_input_hessian():
    W = {"a.weight": torch.randn(8, 32, generator=G), "b.weight": torch.randn(16, 48, generator=G)}
    X = {"a": torch.randn(64, 32, generator=G) * torch.linspace(0.1, 4, 32), "b": torch.randn(64, 48, generator=G)}
    fit = qt.run_steps(W, qt.Recipe(default=SPEC, steps=[qt.Step("lowrank", rank=3, damp=0.0)]), calibrator=_Calib(X))
    for p, m in (("a.weight", "a"), ("b.weight", "b")):
        Q = qt.dequantize(qt.quantize(W[p], fit.qparams[p]))  # RTN: no step fitted them before
        E, x = (W[p] - Q).double(), X[m].double()
        left = float(((E - fit.lowrank[p].delta().double()) @ x.T).norm())
        assert left == pytest.approx(_tail(E @ x.T, 3), rel=1e-4)
        assert 0 < fit.info[p]["lowrank_residual"] < 1


def _register(name, fn):
    qt.register_algorithm(name, fn, local=True, replace=True)


def test_reference_is_what_a_rounding_step_was_given_else_the_new_tensor():
    w = torch.randn(8, 32, generator=G)

    def rounding(params, plan, *, context):  # GPTQ-like: returns the weight on its own grid
        qp = qt.choose_qparams(params["fc.weight"] * 0.9, plan.specs["fc.weight"])
        return qt.Fit(params={"fc.weight": qt.dequantize(qt.quantize(params["fc.weight"], qp))},
                      qparams={"fc.weight": qp})

    def doubling(params, plan, *, context):  # AWQ-like: a new float tensor, no grid
        return qt.Fit(params={"fc.weight": params["fc.weight"] * 2})

    _register("t_round", rounding)
    _register("t_double", doubling)
    try:
        full = qt.Step("lowrank", rank=32, weighted=False)
        for steps, want in ((["t_round"], w), (["t_double"], 2 * w), (["t_double", "t_round"], 2 * w),
                            (["t_round", "t_round"], w)):
            fit = qt.run_steps({"fc.weight": w}, qt.Recipe(default=SPEC, steps=[*map(qt.Step, steps), full]))
            runs = qt.dequantize(qt.quantize(fit.params["fc.weight"], fit.qparams["fc.weight"]))
            torch.testing.assert_close(runs + fit.lowrank["fc.weight"].delta(), want, rtol=0, atol=1e-4)
    finally:
        qt.ALGORITHMS.unregister("t_round")
        qt.ALGORITHMS.unregister("t_double")


def test_conv1d_weights_are_corrected_in_the_logical_layout():
    w = torch.randn(32, 16, generator=G)  # stored (in, out)
    plan = qt.Recipe(default=SPEC, steps=[qt.Step("lowrank", rank=64, weighted=False)]).plan(
        {"fc.weight": w}, types={"fc.weight": "Conv1D"})
    fit = qt.run_steps({"fc.weight": w}, plan)
    c = fit.lowrank["fc.weight"]
    assert (c.a.shape, c.b.shape) == ((16, 32), (16, 16))
    q = qt.dequantize(qt.quantize(w, fit.qparams["fc.weight"]))
    torch.testing.assert_close(q + c.delta().T, w, rtol=0, atol=1e-4)


def test_a_later_step_that_refits_or_changes_a_weight_drops_its_correction():
    w = {"fc.weight": torch.randn(8, 32, generator=G), "g.weight": torch.randn(8, 32, generator=G)}
    lr = qt.Step("lowrank", rank=2, weighted=False)
    fit = qt.run_steps(w, qt.Recipe(default=SPEC, steps=[lr, qt.Step("rtn")]))
    assert fit.lowrank == {}
    hqq = qt.QuantSpec(format="uint2", granularity=qt.PerGroup(16), symmetric=False, zero_point_domain="float")
    fit = qt.run_steps(w, qt.Recipe(default=hqq, steps=[lr, qt.Step("hqq", iters=2)]))
    assert fit.lowrank == {} and sorted(fit.qparams) == ["fc.weight", "g.weight"]
    a = qt.Fit(lowrank={"fc.weight": LowRank(a=torch.ones(1, 32), b=torch.ones(8, 1)),
                        "g.weight": LowRank(a=torch.ones(1, 32), b=torch.ones(8, 1))})
    assert sorted(a.then(qt.Fit(params={"fc.weight": torch.zeros(8, 32)})).lowrank) == ["g.weight"]


def test_run_steps_checks_correction_shapes_by_path():
    def bad(params, plan, *, context):
        return qt.Fit(lowrank={"fc.weight": LowRank(a=torch.ones(1, 31), b=torch.ones(8, 1))})

    _register("t_bad", bad)
    try:
        with pytest.raises(ValueError, match=r"fc\.weight: low-rank correction"):
            qt.run_steps({"fc.weight": torch.randn(8, 32)}, qt.Recipe(default=SPEC, steps=[qt.Step("t_bad")]))
    finally:
        qt.ALGORITHMS.unregister("t_bad")


def test_stacked_experts_are_refused_by_path():
    p = "mlp.experts.down_proj"
    plan = qt.Recipe(default=SPEC, steps=[qt.Step("lowrank", weighted=False)]).plan(
        {p: torch.randn(4, 8, 32)}, types={p: "Experts"})
    with pytest.raises(ValueError, match=r"mlp\.experts\.down_proj: a low-rank correction"):
        qt.run_steps({p: torch.randn(4, 8, 32)}, plan)


def test_lower_ranks_are_the_leading_components_of_a_higher_one():
    E, X = _rand(24, 40), _rand(80, 40)
    for H in (None, X.T @ X / 80):
        c8, c2 = lowrank_error(E, rank=8, hessian=H), lowrank_error(E, rank=2, hessian=H)
        torch.testing.assert_close(c8.a[:2], c2.a, rtol=0, atol=1e-12)
        torch.testing.assert_close(c8.b[:, :2], c2.b, rtol=0, atol=1e-12)

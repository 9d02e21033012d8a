"""The algorithm contract: Fit, apply_fit, the registry, calling an algorithm alone, rtn's observers."""

import pytest
import torch

import qtransform as qt


@pytest.fixture
def registered():
    """Register algorithms for one test only."""
    names = []

    def add(name, fn, **kw):
        names.append(name)
        return qt.register_algorithm(name, fn, **kw)

    yield add
    for n in names:
        if n in qt.ALGORITHMS:
            qt.ALGORITHMS.unregister(n)


def test_fit_is_a_pytree_and_validates_its_fields():
    qp = qt.choose_qparams(torch.randn(4, 8), qt.QuantSpec(format="int8"))
    fit = qt.Fit(params={"a.weight": torch.ones(2)}, qparams={"b.weight": qp})
    leaves = torch.utils._pytree.tree_leaves(fit)
    assert len(leaves) == 2 and all(isinstance(t, torch.Tensor) for t in leaves)
    doubled = torch.utils._pytree.tree_map(lambda t: t * 2 if t.is_floating_point() else t, fit)
    assert isinstance(doubled, qt.Fit) and doubled.params["a.weight"].tolist() == [2.0, 2.0]
    assert qt.Fit().params == {} and qt.Fit().qparams == {}
    with pytest.raises(TypeError, match=r"Fit.params\['a'\] must be a Tensor"):
        qt.Fit(params={"a": 1.0})
    with pytest.raises(TypeError, match=r"Fit.qparams\['a'\] must be a QParams"):
        qt.Fit(qparams={"a": torch.ones(1)})
    with pytest.raises(TypeError, match="Fit.params must be a mapping"):
        qt.Fit(params=[torch.ones(1)])


def test_apply_fit_returns_a_new_tree_and_checks_paths_shapes_dtypes():
    tree = {"block": {"w": torch.zeros(2, 3), "b": torch.zeros(2)}, "head": [torch.ones(4)]}
    out = qt.apply_fit(tree, qt.Fit(params={"block.w": torch.ones(2, 3), "head.0": torch.full((4,), 5.0)}))
    assert torch.equal(out["block"]["w"], torch.ones(2, 3)) and out["head"][0].tolist() == [5.0] * 4
    assert out["block"]["b"] is tree["block"]["b"]
    assert torch.equal(tree["block"]["w"], torch.zeros(2, 3))  # input untouched
    with pytest.raises(ValueError, match=r"paths not in the tree: \['block.x'\]"):
        qt.apply_fit(tree, qt.Fit(params={"block.x": torch.ones(1)}))
    with pytest.raises(ValueError, match=r"block.w: .*shape \(3, 2\)"):
        qt.apply_fit(tree, qt.Fit(params={"block.w": torch.ones(3, 2)}))
    with pytest.raises(ValueError, match=r"block.b: .*dtype torch.float64"):
        qt.apply_fit(tree, qt.Fit(params={"block.b": torch.ones(2, dtype=torch.float64)}))


def test_registry_errors(registered):
    assert {"rtn", "hqq"} <= set(qt.ALGORITHMS)
    with pytest.raises(ValueError, match="unknown algorithm 'gptq_x'; known: "):
        qt.get_algorithm("gptq_x")
    with pytest.raises(ValueError, match="already registered"):
        qt.register_algorithm("hqq", lambda params, plan, *, context: qt.Fit())
    with pytest.raises(TypeError, match="must be a name"):
        qt.get_algorithm(None)
    with pytest.raises(TypeError, match="fn must be callable"):
        qt.register_algorithm("x", 3)
    with pytest.raises(TypeError, match="check_options must be callable"):
        qt.register_algorithm("x", lambda *a, **k: qt.Fit(), check_options=3)
    with pytest.raises(TypeError, match="needs must be None, SiteStats, BlockInputs or ModelLoss"):
        qt.register_algorithm("x", lambda *a, **k: qt.Fit(), needs="data")
    assert "x" not in qt.ALGORITHMS

    def check(*, path=None, **options):
        if "bad" in options:
            raise ValueError(f"{path}: no option 'bad'")

    registered("mine", lambda params, plan, *, context, **o: qt.Fit(), check_options=check)
    qt.check_algorithm_options("mine", {"good": 1})
    with pytest.raises(ValueError, match="recipe.options: no option 'bad'"):
        qt.check_algorithm_options("mine", {"bad": 1}, path="recipe.options")
    registered("mine", lambda params, plan, *, context, **o: qt.Fit(), replace=True)  # the old check goes too
    qt.check_algorithm_options("mine", {"bad": 1})
    with pytest.raises(TypeError, match="must map option names"):
        qt.check_algorithm_options("mine", {1: 2})


def test_calling_an_algorithm_alone(registered):
    seen = {}

    def f(params, plan, *, context, scale=1.0):
        seen.update(params=params, plan=plan, context=context)
        return qt.Fit(params={p: params[p] * scale for p in plan.specs})

    algo = registered("scale_demo", f)
    tree = {"net": {"fc": {"weight": torch.ones(2, 4), "bias": torch.ones(2)}}}
    fit = algo(tree, qt.QuantSpec(format="int8"), scale=3.0)
    assert list(seen["params"]) == ["net.fc.weight", "net.fc.bias"]  # the flat tree
    assert list(seen["plan"].specs) == ["net.fc.weight"] and seen["context"].stats is None
    assert fit.params["net.fc.weight"].tolist() == [[3.0] * 4] * 2

    stats_algo = registered("stats_demo", f, needs=qt.SiteStats(lambda plan: {}))
    with pytest.raises(ValueError, match="needs statistics of activation sites: pass stats="):
        stats_algo(tree, qt.QuantSpec(format="int8"))
    registered("broken", lambda params, plan, *, context: {"net.fc.weight": params["net.fc.weight"]})
    with pytest.raises(TypeError, match="returned dict, not a qtransform.Fit"):
        qt.get_algorithm("broken")(tree, qt.QuantSpec(format="int8"))


def test_rtn_with_each_range_observer_equals_choose_qparams():
    torch.manual_seed(0)
    w = torch.randn(16, 64)
    w[3, 7] = 30.0
    spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))
    for observer in (None, "minmax", "mse", {"name": "percentile", "percentile": 99.0}):
        fit = qt.get_algorithm("rtn")({"w": w}, spec, **({} if observer is None else {"observer": observer}))
        want = qt.choose_qparams(w, spec, observer=observer)
        assert torch.equal(fit.qparams["w"].scale, want.scale), observer
    # computed here: symmetric int4 on [-8, 7] puts each group's absmax at 7.5 steps
    minmax = qt.get_algorithm("rtn")({"w": w}, spec).qparams["w"]
    torch.testing.assert_close(minmax.scale, w.reshape(16, 2, 32).abs().amax(-1) / 7.5, rtol=1e-6, atol=0)
    mse = qt.get_algorithm("rtn")({"w": w}, spec, observer="mse").qparams["w"]
    err = lambda qp: (qt.dequantize(qt.quantize(w, qp)) - w).pow(2).reshape(16, 2, 32).sum(-1)  # noqa: E731
    assert bool((err(mse) <= err(minmax) * (1 + 1e-6)).all()) and float(err(mse).sum()) < float(err(minmax).sum())
    pct = qt.get_algorithm("rtn")({"w": w}, spec, observer={"name": "percentile", "percentile": 90.0}).qparams["w"]
    assert float(pct.scale[3, 0]) < float(qt.choose_qparams(w, spec).scale[3, 0])  # the outlier's group clips
    with pytest.raises(ValueError, match="rtn: observer 'hessian' gives no quantization range"):
        qt.check_algorithm_options("rtn", {"observer": "hessian"})
    with pytest.raises(ValueError, match="rtn: observer: unknown observer 'kl'"):
        qt.check_algorithm_options("rtn", {"observer": "kl"})
    with pytest.raises(ValueError, match=r"rtn: unknown option\(s\) \['iters'\]"):
        qt.check_algorithm_options("rtn", {"iters": 3})


def test_every_step_module_follows_the_convention():
    """``<name>.py`` registers ``step`` as ``<name>``; no ``*_math.py`` module imports a step module."""
    import ast
    import importlib
    import pathlib

    import qtransform.algorithms as algorithms

    folder = pathlib.Path(algorithms.__file__).parent
    builtin = {"rtn", "hqq", "smoothquant", "gptq", "awq", "rotate", "spinquant"}
    for name in builtin:
        module = importlib.import_module(f"qtransform.algorithms.{name}")
        assert qt.get_algorithm(name).fn is module.step, name
    for path in folder.glob("*_math.py"):
        tree = ast.parse(path.read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1
                    for a in ([ast.alias(n.module)] if n.module else n.names)}
        assert not imported & builtin, f"{path.name} imports the step module(s) {sorted(imported & builtin)}"


def test_the_core_counts_no_tokens_the_caller_does():
    import qtransform.algorithms.base as base

    block = qt.Block(name="b", paths=(), inputs=(), run=lambda t: [], site_stats=lambda t, s: {})
    assert block.tokens is None  # not counted unless the caller (the bridge: which input holds the hidden states) does
    assert not hasattr(qt, "batch_tokens") and not hasattr(base, "batch_tokens")  # one count, in the bridge

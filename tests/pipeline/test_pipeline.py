"""The pipeline: a recipe's steps run in order, each on the tree the previous left; steps are
checked before any work; site statistics come from a calibrator; quantize_tree runs it all."""

import pytest
import torch

import qtransform as qt
from qtransform.algorithms import hqq

HQQ_SPEC = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False, zero_point_domain="float",
                        scale_dtype="float16")


def _w(shape=(16, 64), seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def shrunk(w, factor):  # the reference, written independently of the step below
    return w + factor * (w.mean(dim=-1, keepdim=True) - w)


@pytest.fixture
def steps():
    """Test steps: ``shrink`` (changes the quantized weights), ``bias_plus`` (changes an unquantized
    tensor), ``spy`` (records what it sees) and ``sites`` (needs site statistics)."""
    calls = []

    def shrink(params, plan, *, context, factor=0.5):
        calls.append("shrink")
        return qt.Fit(params={p: params[p] - factor * (params[p] - params[p].mean(-1, keepdim=True))
                              for p in plan.specs})

    def bias_plus(params, plan, *, context, amount=1.0):
        calls.append("bias_plus")
        return qt.Fit(params={p: params[p] + amount for p in params if p.endswith(".bias")})

    def spy(params, plan, *, context):
        calls.append(("spy", {p: t.clone() for p, t in params.items()}))
        return qt.Fit()

    def sites(params, plan, *, context):
        calls.append(("sites", context.stats))
        return qt.Fit()

    def check(*, path=None, **options):
        if set(options) - {"factor"}:
            raise ValueError(f"{path}: shrink takes factor only")

    names = {"shrink": dict(fn=shrink, local=True, check_options=check), "bias_plus": dict(fn=bias_plus),
             "spy": dict(fn=spy),
             "sites": dict(fn=sites, needs=qt.SiteStats(lambda plan: {s: "channel" for s in plan.sites()}))}
    for name, kw in names.items():
        qt.register_algorithm(name, kw.pop("fn"), **kw)
    yield calls
    for name in names:
        qt.ALGORITHMS.unregister(name)


def test_a_weight_changing_step_then_hqq(steps):
    params = {"fc.weight": _w(), "fc.bias": torch.zeros(16)}
    recipe = qt.Recipe(default=HQQ_SPEC, steps=["shrink", qt.Step("hqq", iters=5)])
    qtree = qt.quantize_tree(params, recipe)
    want = qt.quantize(shrunk(params["fc.weight"], 0.5), hqq.optimize(shrunk(params["fc.weight"], 0.5), HQQ_SPEC,
                                                                       iters=5))
    assert torch.equal(qtree["fc.weight"].codes, want.codes)
    assert torch.equal(qtree["fc.weight"].qparams.zero_point, want.qparams.zero_point)
    assert torch.equal(params["fc.weight"], _w())  # the input is untouched


def test_a_later_weight_change_drops_the_earlier_qparams(steps):
    params = {"fc.weight": _w()}
    fit = qt.run_steps(params, qt.Recipe(default=HQQ_SPEC, steps=[qt.Step("hqq", iters=5), qt.Step("shrink", factor=0.25)]))
    assert fit.qparams == {}  # hqq fitted the old weight; round to nearest fits the new one
    torch.testing.assert_close(fit.params["fc.weight"], shrunk(params["fc.weight"], 0.25))
    qtree = qt.quantize_tree(params, qt.Recipe(default=HQQ_SPEC, steps=["hqq", qt.Step("shrink", factor=0.25)]))
    w = shrunk(params["fc.weight"], 0.25)
    assert torch.equal(qt.dequantize(qtree["fc.weight"]), qt.dequantize(qt.quantize(w, qt.choose_qparams(w, HQQ_SPEC))))


def test_steps_see_the_tree_the_previous_step_left_and_may_change_unquantized_tensors(steps):
    params = {"fc.weight": _w(), "fc.bias": torch.zeros(16)}
    recipe = qt.Recipe(default=qt.QuantSpec(format="int8"), steps=[qt.Step("bias_plus", amount=2.0), "spy"])
    qtree = qt.quantize_tree(params, recipe)
    seen = steps[-1][1]
    assert torch.equal(seen["fc.bias"], torch.full((16,), 2.0)) and torch.equal(seen["fc.weight"], params["fc.weight"])
    assert torch.equal(qtree["fc.bias"], torch.full((16,), 2.0))  # the changed bias is in the result
    assert torch.equal(params["fc.bias"], torch.zeros(16))


def test_every_step_is_checked_before_any_runs(steps):
    params = {"fc.weight": _w()}
    spec = qt.QuantSpec(format="int8")
    cases = [(["shrink", "nope"], r"recipe.steps\[1\] \(nope\): unknown algorithm 'nope'"),
             (["shrink", qt.Step("shrink", amount=1)], r"recipe.steps\[1\] \(shrink\): shrink takes factor only"),
             (["shrink", qt.Step("hqq", iters=-1)], r"recipe.steps\[1\] \(hqq\): hqq: iters must be"),
             (["shrink", "sites"], r"recipe.steps\[1\] \(sites\): 'sites' needs statistics of activation sites")]
    for chain, match in cases:
        with pytest.raises(ValueError, match=match):
            qt.quantize_tree(params, qt.Recipe(default=spec, steps=chain))
    assert steps == []  # nothing ran


def test_what_a_step_returns_is_checked(steps):
    params = {"fc.weight": _w(), "fc.bias": torch.zeros(16)}
    spec = qt.QuantSpec(format="int8")
    other = qt.choose_qparams(params["fc.weight"], qt.QuantSpec(format="int4"))
    bad = {"unplanned": lambda p, plan, *, context: qt.Fit(qparams={"fc.bias": qt.choose_qparams(p["fc.bias"], spec)}),
           "wrong_spec": lambda p, plan, *, context: qt.Fit(qparams={"fc.weight": other}),
           "new_path": lambda p, plan, *, context: qt.Fit(params={"fc.extra": torch.ones(1)}),
           "reshaped": lambda p, plan, *, context: qt.Fit(params={"fc.weight": torch.ones(64, 16)}),
           "not_fit": lambda p, plan, *, context: {}}
    matches = {"unplanned": "qparams for 'fc.bias', which the recipe leaves unquantized",
               "wrong_spec": "qparams were made for int4", "new_path": "'fc.extra', which is not a tensor",
               "reshaped": r"fc.weight: returned shape \(64, 16\)", "not_fit": "returned dict, not a qtransform.Fit"}
    try:
        for name, fn in bad.items():
            qt.register_algorithm(name, fn)
            with pytest.raises((ValueError, TypeError), match=matches[name]):
                qt.run_steps(params, qt.Recipe(default=spec, steps=[name]))
    finally:
        for name in bad:
            if name in qt.ALGORITHMS:
                qt.ALGORITHMS.unregister(name)


class FakeCalibrator:
    """Statistics of each requested site from fixed activations (a stand-in for the bridge)."""

    def __init__(self, acts):
        self.acts, self.calls = acts, []

    def site_stats(self, params, sites):
        self.calls.append((dict(params), dict(sites)))
        return {site: qt.observe(stats, self.acts[site.module]) for site, stats in sites.items()}


def test_site_statistics_come_from_the_calibrator_on_the_current_tree(steps):
    params = {"a.weight": _w((8, 4)), "a.bias": torch.zeros(8), "b.weight": _w((4, 8), 1)}
    acts = {"a": torch.tensor([[1.0, -2.0, 0.5, 0.0]]), "b": torch.arange(8.0).reshape(1, 8)}
    cal = FakeCalibrator(acts)
    recipe = qt.Recipe(default=qt.QuantSpec(format="int8"), steps=[qt.Step("bias_plus", amount=1.0), "sites"])
    qt.quantize_tree(params, recipe, calibrator=cal)
    (seen_params, requested), = cal.calls
    assert torch.equal(seen_params["a.bias"], torch.ones(8))  # after bias_plus
    assert list(requested) == [qt.Site("a"), qt.Site("b")]
    assert all(s.observer == qt.make_observer("channel") and qt.observers.is_empty(s) for s in requested.values())
    stats = steps[-1][1]
    assert qt.finalize_stats(stats[qt.Site("a")]).absmax.tolist() == [1.0, 2.0, 0.5, 0.0]
    assert qt.finalize_stats(stats[qt.Site("b")]).absmax.tolist() == list(range(8))


def test_explicit_qparams_and_step_results_may_not_clash(steps):
    params = {"fc.weight": _w()}
    qp = qt.choose_qparams(params["fc.weight"], HQQ_SPEC)
    with pytest.raises(ValueError, match="which the recipe's steps also fit"):
        qt.quantize_tree(params, qt.Recipe(default=HQQ_SPEC, steps=["shrink"]), qparams={"fc.weight": qp})
    with pytest.raises(TypeError, match="qparams must map tree paths"):
        qt.quantize_tree(params, HQQ_SPEC, qparams=[qp])


def test_quantize_on_load_accepts_local_calibration_free_steps_only(steps):
    qt.check_steps([qt.Step("hqq"), qt.Step("shrink")], on_load=True)
    with pytest.raises(ValueError, match=r"\(sites\): quantize-on-load runs steps .* 'sites' needs calibration data"):
        qt.check_steps([qt.Step("sites")], on_load=True)
    with pytest.raises(ValueError, match="'bias_plus' changes several tensors together"):
        qt.check_steps([qt.Step("bias_plus")], on_load=True)


def test_steps_are_plain_data():
    s = qt.Step("hqq", error_norm=4, refine_scale=False)
    assert s == qt.Step.from_value({"name": "hqq", "options": {"refine_scale": False, "error_norm": 4}})
    assert s == qt.Step.from_value({"name": "hqq", "error_norm": 4, "refine_scale": False})
    assert hash(s) == hash(qt.Step("hqq", refine_scale=False, error_norm=4)) and s != qt.Step("hqq")
    assert dict(s.options) == {"error_norm": 4, "refine_scale": False}
    with pytest.raises(AttributeError):
        s.name = "rtn"
    with pytest.raises(TypeError, match="JSON-able"):
        qt.Step("hqq", generator=torch.Generator())
    with pytest.raises(ValueError, match=r"given twice"):
        qt.Step.from_value({"name": "hqq", "iters": 1, "options": {"iters": 2}})
    with pytest.raises(ValueError, match="needs a 'name'"):
        qt.Step.from_value({"options": {}})
    r = qt.Recipe(default=HQQ_SPEC, steps=[s, "rtn"])
    assert qt.Recipe.from_dict(r.to_dict()) == r and hash(r) == hash(qt.Recipe.from_dict(r.to_dict()))
    assert qt.Recipe(steps="hqq").steps == (qt.Step("hqq"),)
    with pytest.raises(TypeError, match="Recipe.steps must be a list"):
        qt.Recipe(steps=5)


def test_recipe_files_name_steps():
    p = qt.recipe_from_dict({"default": "hqq3-g64", "steps": ["hqq", {"name": "rtn", "observer": "mse"}]})
    assert p.recipe.steps == (qt.Step("hqq"), qt.Step("rtn", observer="mse"))
    short = qt.recipe_from_dict({"algorithm": "hqq", "options": {"iters": 3}, "default": "hqq3-g64"})
    assert short.recipe.steps == (qt.Step("hqq", iters=3),)
    assert qt.recipe_from_dict({"nbits": 3, "group_size": 64}).recipe.steps == (qt.Step("hqq"),)
    assert qt.recipe_from_dict({"nbits": 3, "steps": []}).recipe.steps == ()
    for bad, match in [({"steps": ["nope"]}, r"recipe.steps\[0\] \(nope\): unknown algorithm"),
                       ({"steps": [{"name": "hqq", "itres": 3}]}, r"hqq: unknown option\(s\) \['itres'\]"),
                       ({"steps": ["hqq"], "algorithm": "rtn"}, "either 'steps' or 'algorithm'"),
                       ({"steps": "hqq"}, "recipe.steps must be a list"),
                       ({"rules": ["*.w"]}, "recipe.rules must be a table"),
                       ({"nbits": 4, "default": "int8-channel"}, r"\['default'\] cannot be combined with the HqqConfig"),
                       ({"group_size": 32, "default": "int8-channel"}, r"\['group_size'\] belong to the HqqConfig")]:
        with pytest.raises((ValueError, TypeError), match=match):
            qt.recipe_from_dict(bad)


def test_presets_registry():
    assert qt.get_preset("hqq4-g64").steps == (qt.Step("hqq", error_norm=4.0, refine_scale=False),)
    assert qt.get_preset("int4-g128").steps == ()
    qt.register_preset("needs-a-missing-format",
                       lambda: qt.Preset("needs-a-missing-format", qt.Recipe(default=qt.QuantSpec(format="int77")), ""))
    try:
        assert "needs-a-missing-format" not in qt.presets()
        with pytest.raises(ValueError, match="unknown recipe 'needs-a-missing-format'"):
            qt.get_preset("needs-a-missing-format")
    finally:
        qt.PRESETS.unregister("needs-a-missing-format")
    # other errors are not hidden: they name the preset
    qt.register_preset("broken", lambda: qt.Preset("broken", qt.Recipe(default=qt.QuantSpec(format="int4", bits=3)), ""))
    try:
        with pytest.raises((ValueError, TypeError), match="preset 'broken'"):
            qt.presets()
    finally:
        qt.PRESETS.unregister("broken")
    qt.register_preset("not-a-preset", lambda: qt.Recipe(default=qt.QuantSpec(format="int4")))
    try:
        with pytest.raises(TypeError, match="preset 'not-a-preset'.*not a qtransform.Preset"):
            qt.presets()
    finally:
        qt.PRESETS.unregister("not-a-preset")


def test_given_qparams_are_checked_before_any_step_runs(steps):
    params = {"fc.weight": _w(), "fc.bias": torch.zeros(16)}
    wrong = qt.choose_qparams(params["fc.weight"], qt.QuantSpec(format="int4"))
    recipe = qt.Recipe(default=qt.QuantSpec(format="int8"), steps=["spy"])
    with pytest.raises(ValueError, match="fc.weight: qparams were made for int4"):
        qt.quantize_tree(params, recipe, qparams={"fc.weight": wrong})
    bias_qp = qt.choose_qparams(params["fc.bias"], qt.QuantSpec(format="int8"))
    with pytest.raises(ValueError, match="fc.bias: qparams given but the recipe leaves this path unquantized"):
        qt.quantize_tree(params, recipe, qparams={"fc.bias": bias_qp})
    assert steps == []  # the spy never ran


def test_a_plan_is_only_used_on_the_tree_it_was_resolved_for():
    params = {"fc.weight": _w(), "fc.bias": torch.zeros(16)}
    plan = qt.Recipe(default=qt.QuantSpec(format="int8")).plan(params)
    assert qt.as_plan(plan, params) is plan
    with pytest.raises(ValueError, match=r"tensor paths not in the plan \['other.weight'\]"):
        qt.quantize_tree({**params, "other.weight": _w()}, plan)
    with pytest.raises(ValueError, match=r"plan paths not in the tree \['fc.bias'\]"):
        qt.run_steps({"fc.weight": params["fc.weight"]}, plan)
    with pytest.raises(TypeError, match="types cannot be given with a Plan"):
        qt.quantize_tree(params, plan, types={"fc.weight": "Linear"})
    # observe_tree folds activations named like the plan's paths, a subset at a time
    stats = qt.observe_tree(None, {"fc.weight": torch.tensor([[-2.0, 1.0]])}, plan)
    assert list(stats) == ["fc.weight"] and abs(float(qt.compute_qparams(stats["fc.weight"]).scale) - 2.0 / 127.5) < 1e-8
    with pytest.raises(ValueError, match=r"observe_tree: tensors for paths not in the plan: \['x'\]"):
        qt.observe_tree(None, {"x": torch.ones(2, 2)}, plan)


def test_errors_raised_inside_a_step_name_it_and_calibrators_are_checked(steps):
    def fails(params, plan, *, context):
        raise ValueError("something about the weights")

    qt.register_algorithm("fails", fails)
    try:
        with pytest.raises(ValueError, match=r"^recipe.steps\[1\] \(fails\): something about the weights$"):
            qt.run_steps({"fc.weight": _w()}, qt.Recipe(default=qt.QuantSpec(format="int8"), steps=["spy", "fails"]))
    finally:
        qt.ALGORITHMS.unregister("fails")
    with pytest.raises(TypeError, match=r"recipe.steps\[0\] \(sites\): the calibrator \(object\) has no site_stats"):
        qt.run_steps({"fc.weight": _w()}, qt.Recipe(default=qt.QuantSpec(format="int8"), steps=["sites"]),
                     calibrator=object())


def test_fits_combine_in_order():
    w, spec = _w(), qt.QuantSpec(format="int8")
    first = qt.Fit(params={"a": w}, qparams={"a": qt.choose_qparams(w, spec), "b": qt.choose_qparams(w, spec)})
    later = qt.Fit(params={"a": w + 1})
    both = first.then(later)
    assert torch.equal(both.params["a"], w + 1) and list(both.qparams) == ["b"]  # a's old qparams dropped
    assert first.then(qt.Fit()).qparams.keys() == first.qparams.keys()
    with pytest.raises(TypeError, match="Fit.then: expected a Fit"):
        first.then({})
    with pytest.raises(TypeError, match="Fit.params must be keyed by tree paths"):
        qt.Fit(params={0: w})

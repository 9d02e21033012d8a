"""Options once: a step registered with an options dataclass receives one keyword, ``options``, the dataclass
built from the recipe's values (the defaults live there alone); its ``needs`` helpers receive it the same way.
Steps registered without one (plugins) keep receiving their options as keywords."""

import dataclasses
import inspect

import pytest
import torch

import qtransform as qt
from qtransform.algorithms import lowrank, rtn
from qtransform.algorithms.options import option

BUILTIN = sorted(n for n, a in qt.ALGORITHMS.items() if a.options is not None)
HELPERS = ("sites", "wanted", "tokens", "float_inputs")
SPEC = qt.QuantSpec(format="int8")


def _keywords(fn) -> dict:
    """``{name: parameter}`` of ``fn``'s keyword-only parameters; ``**kwargs`` as ``"**"``."""
    ps = inspect.signature(fn).parameters.values()
    return {("**" if p.kind is p.VAR_KEYWORD else p.name): p for p in ps
            if p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD)}


@pytest.mark.parametrize("name", BUILTIN)
def test_a_step_takes_context_and_options_only_and_writes_no_default(name):
    """The duplication cannot come back: no option (and no default) in the step's signature or its helpers'."""
    algo = qt.get_algorithm(name)
    params = list(inspect.signature(algo.fn).parameters.values())
    assert [p.name for p in params[:2]] == ["params", "plan"], name
    assert all(p.default is p.empty for p in params), f"{name}: a default in {inspect.signature(algo.fn)}"
    assert set(_keywords(algo.fn)) == {"context", "options"}, f"{name}: {inspect.signature(algo.fn)}"
    for helper in HELPERS:
        f = getattr(algo.needs, helper, None)
        if callable(f):
            sig = inspect.signature(f)
            assert set(_keywords(f)) == {"options"}, f"{name}: needs.{helper}{sig}"
            assert all(p.default is p.empty for p in sig.parameters.values()), f"{name}: needs.{helper}{sig}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Probe:
    factor: float = option(0.5, gt=0, le=1)
    tokens: int = option(64, ge=1)


class _Calibrator:
    """Serves every need: empty statistics, two blocks, a constant loss."""

    def site_stats(self, params, sites, *, online=None):
        return dict(sites)

    def blockwise(self, params, plan, fit_block, *, qparams=None, tokens=None, float_inputs=False, online=None):
        self.asked = {"tokens": tokens, "float_inputs": float_inputs}
        fits = [fit_block(qt.Block(name=f"b{i}", paths=(), inputs=[], run=lambda p: [], site_stats=lambda p, s: {}),
                          dict(params)) for i in range(2)]
        return fits[0].then(fits[1])

    def model_loss(self, plan, *, online=None):
        return lambda params, i, online=None: torch.zeros(())


@pytest.fixture
def probes():
    """A dataclass step for each need, recording what the step and its helpers receive."""
    seen = []

    def fn(params, plan, *, context, options):
        seen.append(("fn", options))
        return qt.Fit()

    def helper(kind):
        def f(*args, options):
            seen.append((kind, options))
            return {} if kind == "sites" else True if kind != "tokens" else options.tokens
        return f

    needs = {"probe_stats": qt.SiteStats(helper("sites"), wanted=helper("wanted")),
             "probe_blocks": qt.BlockInputs(tokens=helper("tokens"), float_inputs=helper("float_inputs")),
             "probe_loss": qt.ModelLoss()}
    for name, need in needs.items():
        qt.register_algorithm(name, fn, needs=need, options=Probe)
    yield seen
    for name in needs:
        qt.ALGORITHMS.unregister(name)


@pytest.mark.parametrize("name", ["probe_stats", "probe_blocks", "probe_loss"])
def test_the_step_and_its_helpers_receive_the_dataclass_built_once(probes, name):
    calibrator = _Calibrator()
    recipe = qt.Recipe(default=SPEC, steps=[qt.Step(name, factor=0.25)])
    qt.run_steps({"fc.weight": torch.ones(2, 4)}, recipe, calibrator=calibrator)
    received = [o for _, o in probes]
    assert received and all(o == Probe(factor=0.25, tokens=64) for o in received)  # the default from the dataclass
    steps = [o for kind, o in probes if kind != "wanted"]  # needs_data builds its own to decide
    assert all(o is steps[0] for o in steps), "built once per step"
    if name == "probe_blocks":
        assert [k for k, _ in probes] == ["tokens", "float_inputs", "fn", "fn"]
        assert calibrator.asked == {"tokens": 64, "float_inputs": True}


def test_calling_a_dataclass_step_alone_takes_keywords_and_checks_them(probes):
    algo = qt.get_algorithm("probe_stats")
    algo({"fc.weight": torch.ones(2, 4)}, SPEC, stats={}, factor=1)
    assert {k: o for k, o in probes} == {"wanted": Probe(factor=1), "fn": Probe(factor=1)}
    with pytest.raises(ValueError, match=r"^probe_stats: factor must be a number in \(0, 1\], got 2$"):
        algo({"fc.weight": torch.ones(2, 4)}, SPEC, stats={}, factor=2)


def test_a_plugin_without_a_dataclass_still_receives_keywords():
    seen = []

    def fn(params, plan, *, context, factor=0.5):
        seen.append(("fn", factor))
        return qt.Fit()

    def sites(plan, **options):
        seen.append(("sites", options))
        return {}

    def tokens(**options):
        seen.append(("tokens", options))
        return None

    qt.register_algorithm("kw_stats", fn, needs=qt.SiteStats(sites, wanted=lambda **o: seen.append(("wanted", o)) or 1))
    qt.register_algorithm("kw_blocks", fn, needs=qt.BlockInputs(tokens=tokens))
    try:
        tree = {"fc.weight": torch.ones(2, 4)}
        qt.run_steps(tree, qt.Recipe(default=SPEC, steps=[qt.Step("kw_stats", factor=0.25), "kw_blocks"]),
                     calibrator=_Calibrator())
        qt.get_algorithm("kw_stats")(tree, SPEC, stats={}, factor=0.75)
    finally:
        qt.ALGORITHMS.unregister("kw_stats")
        qt.ALGORITHMS.unregister("kw_blocks")
    assert ("sites", {"factor": 0.25}) in seen and ("tokens", {}) in seen and ("wanted", {"factor": 0.75}) in seen
    assert [v for k, v in seen if k == "fn"] == [0.25, 0.5, 0.5, 0.75]  # the plugin's own default where none given


def test_a_step_called_directly_takes_its_dataclass_and_checks_it():
    w = torch.cat([torch.linspace(-1, 1, 63), torch.tensor([9.0])]).reshape(1, 64)
    spec = qt.QuantSpec(format="int4", granularity=qt.PerChannel(0))
    plan = qt.as_plan(spec, {"fc.weight": w})
    direct = rtn.step({"fc.weight": w}, plan, context=qt.Context(), options=rtn.Options(observer="mse"))
    alone = qt.get_algorithm("rtn")({"fc.weight": w}, spec, observer="mse")
    assert torch.equal(direct.qparams["fc.weight"].scale, alone.qparams["fc.weight"].scale)
    assert not torch.equal(direct.qparams["fc.weight"].scale, qt.choose_qparams(w, spec).scale)  # mse clipped
    with pytest.raises(TypeError, match=r"^rtn: options must be an instance of qtransform.algorithms.rtn.Options .*got dict$"):
        rtn.step({"fc.weight": w}, plan, context=qt.Context(), options={"observer": "mse"})
    with pytest.raises(TypeError, match="got qtransform.algorithms.lowrank.Options$"):  # another step's
        rtn.step({"fc.weight": w}, plan, context=qt.Context(), options=lowrank.Options())
    with pytest.raises(ValueError, match=r"^lowrank: rank must be an int >= 1, got 0$"):  # built without checks
        lowrank.step({"fc.weight": w}, plan, context=qt.Context(), options=lowrank.Options(rank=0))

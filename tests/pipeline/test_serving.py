"""A calibrator whose methods take ``step`` is told which pass each call serves (qtransform.pipeline.run.serving);
one without it serves the same recipes, unchanged."""

import pytest
import torch

import qtransform as qt
from qtransform.pipeline.run import serving


class Told:
    """Records which pass each call says it serves; statistics from fixed activations."""

    def __init__(self, acts):
        self.acts, self.served = acts, []

    def site_stats(self, params, sites, *, step, online=None):
        self.served.append(step)
        return {site: qt.observe(stats, self.acts[site.module]) for site, stats in sites.items()}


class Untold(Told):
    def site_stats(self, params, sites):
        self.served.append(None)
        return {site: qt.observe(stats, self.acts[site.module]) for site, stats in sites.items()}


@pytest.fixture
def observe_step():
    """``observe``: a step needing the statistics of every linear's input (and fitting nothing)."""
    qt.register_algorithm("observe", lambda params, plan, *, context: qt.Fit(),
                          needs=qt.SiteStats(lambda plan: {s: "channel" for s in plan.sites()}))
    yield
    qt.ALGORITHMS.unregister("observe")


def _case():
    g = torch.Generator().manual_seed(0)
    params = {"fc.weight": torch.randn(16, 8, generator=g)}
    acts = {"fc": torch.randn(4, 8, generator=g) * torch.arange(1.0, 9.0)}
    recipe = qt.Recipe(default=qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)),
                       steps=[qt.Step("rtn"), qt.Step("observe"), qt.Step("observe")], input=qt.QuantSpec(format="int8"))
    return params, acts, recipe


def test_each_call_is_told_its_steps_index_and_the_activation_pass_its_name(observe_step):
    params, acts, recipe = _case()
    plan = recipe.plan(params, types={"fc.weight": "Linear"})
    told, untold = Told(acts), Untold(acts)
    results = []
    for cal in (told, untold):
        qtree, fit = qt.quantize_tree(params, plan, calibrator=cal, with_info=True)
        weights = {p: qt.dequantize(v) if isinstance(v, qt.QTensor) else v for p, v in qtree.items()}
        results.append((qtree, qt.activation_quantizers(weights, plan, cal)))
    assert told.served == [1, 2, "activations"]  # rtn (step 0) needs no data
    assert untold.served == [None, None, None]
    (q1, a1), (q2, a2) = results
    assert torch.equal(q1["fc.weight"].codes, q2["fc.weight"].codes)  # being told changes nothing else
    assert torch.equal(a1[qt.Site("fc")].scale, a2[qt.Site("fc")].scale)


def test_serving_reads_the_signature_not_the_name():
    assert serving(Told({}), "site_stats", 3) == {"step": 3}
    assert serving(Untold({}), "site_stats", 3) == {}
    assert serving(object(), "blockwise", 0) == {}  # no such method: not told

"""Calibration on named sites: statistics folded by hooks equal the ones computed from activations
captured independently; steps that need them run through bridge.quantize with calibration data."""

import pytest
import torch

import bridge
import qtransform as qt
from bridge_util import tiny_causal_lm


def _captured(model, batches, module_names):
    """Inputs of the named modules, captured by plain hooks on the model itself (the reference)."""
    seen = {n: [] for n in module_names}
    modules = dict(model.named_modules())
    hooks = [modules[n].register_forward_pre_hook(lambda m, args, n=n: seen[n].append(args[0].detach()))
             for n in module_names]
    with torch.no_grad():
        for b in batches:
            model(b)
    for h in hooks:
        h.remove()
    return {n: torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]) for n, xs in seen.items()}


def test_site_statistics_equal_the_captured_activations():
    torch.manual_seed(0)
    model = tiny_causal_lm("llama").eval()
    batches = [torch.randint(0, 128, (2, 7)), torch.randint(0, 128, (1, 5))]
    names = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    sites = {qt.Site(n): qt.init_stats(observer="channel") for n in names}
    sites[qt.Site(names[0], "output")] = qt.init_stats(observer="hessian")
    got = bridge.ModelCalibrator(model, batches).site_stats(bridge.extract(model), sites)
    ref = _captured(model, batches, names)
    for n in names:
        r = qt.finalize_stats(got[qt.Site(n)])
        torch.testing.assert_close(r.absmax, ref[n].abs().amax(0))
        torch.testing.assert_close(r.mean_square, ref[n].pow(2).mean(0), rtol=1e-5, atol=1e-7)
    q_out = ref[names[0]] @ model.model.layers[0].self_attn.q_proj.weight.detach().T  # q_proj has no bias
    torch.testing.assert_close(qt.finalize_stats(got[qt.Site(names[0], "output")]), q_out.T @ q_out / q_out.shape[0],
                               rtol=1e-4, atol=1e-5)


def test_the_tree_handed_in_is_what_runs_not_the_model():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=False), torch.nn.Linear(3, 2, bias=False))
    params = {"0.weight": torch.eye(3, 4) * 2.0, "1.weight": model[1].weight.detach()}
    x = torch.tensor([[1.0, -1.0, 3.0, 9.0]])
    stats = bridge.ModelCalibrator(model, [x]).site_stats(params, {qt.Site("1"): qt.init_stats(observer="channel")})
    assert qt.finalize_stats(stats[qt.Site("1")]).absmax.tolist() == [2.0, 2.0, 6.0]  # x @ (2 I)ᵀ, not model[0]
    assert not torch.equal(model[0].weight.detach(), params["0.weight"])  # the model is not modified


def test_batches_of_every_kind():
    model = tiny_causal_lm("llama").eval()
    ids = torch.randint(0, 128, (3, 6))
    site = {qt.Site("model.layers.0.mlp.up_proj"): qt.init_stats(observer="channel")}
    params = bridge.extract(model)
    results = []
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
    for batches in ([ids], [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}], [(ids,)],
                    [b for (b,) in loader]):
        s = bridge.ModelCalibrator(model, batches).site_stats(params, site)
        results.append(qt.finalize_stats(next(iter(s.values()))).absmax)
    for r in results[1:]:
        torch.testing.assert_close(r, results[0])


def test_bad_calibration_input_is_named():
    model = tiny_causal_lm("llama").eval()
    params = bridge.extract(model)
    with pytest.raises(TypeError, match="calibration must be an iterable of batches"):
        bridge.ModelCalibrator(model, torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"site module\(s\) \['model.nope'\] are not modules of LlamaForCausalLM"):
        bridge.ModelCalibrator(model, [torch.ones(1, 2, dtype=torch.long)]).site_stats(
            params, {qt.Site("model.nope"): qt.init_stats(observer="channel")})
    with pytest.raises(ValueError, match="no batches"):
        bridge.ModelCalibrator(model, []).site_stats(params, {qt.Site("lm_head"): qt.init_stats(observer="channel")})
    with pytest.raises(TypeError, match=r"^calibration batch 0: a batch must be a tensor .*, got str$"):
        bridge.ModelCalibrator(model, ["text"]).site_stats(params, {qt.Site("lm_head"): qt.init_stats(observer="channel")})


@pytest.fixture
def input_scaled():
    """A step that needs site statistics: divide each weight's input columns by the square root of
    the input's absmax (a toy smoothing; the bias-free float function changes, the test checks the math)."""

    def sites(plan):
        return {site: "channel" for site in plan.sites()}

    def fn(params, plan, *, context):
        new = {}
        for site, paths in plan.sites().items():
            amax = qt.finalize_stats(context.stats[site]).absmax.clamp(min=1e-6)
            for p in paths:
                new[p] = params[p] / amax.sqrt()
        return qt.Fit(params=new)

    qt.register_algorithm("input_scaled", fn, needs=qt.SiteStats(sites))
    yield
    qt.ALGORITHMS.unregister("input_scaled")


def test_a_step_that_needs_site_statistics_through_bridge_quantize(input_scaled):
    torch.manual_seed(1)
    model = tiny_causal_lm("llama").eval()
    batches = [torch.randint(0, 128, (2, 8))]
    spec = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
    recipe = qt.Recipe(rules={"*.mlp.down_proj.weight": spec}, steps=["input_scaled"])
    with pytest.raises(ValueError, match="'input_scaled' needs statistics of activation sites"):
        bridge.quantize(model, recipe)  # no calibration data: refused before any work
    qm = bridge.quantize(model, recipe, calibration=batches)
    for i, layer in enumerate(model.model.layers):
        x = _captured(model, batches, [f"model.layers.{i}.mlp.down_proj"])[f"model.layers.{i}.mlp.down_proj"]
        w = layer.mlp.down_proj.weight.detach() / x.abs().amax(0).clamp(min=1e-6).sqrt()
        want = qt.dequantize(qt.quantize(w, qt.choose_qparams(w, spec)))
        torch.testing.assert_close(qm.model.layers[i].mlp.down_proj.dequantized_weight(), want)
    assert isinstance(qm.model.layers[0].mlp.down_proj, bridge.QLinear)
    assert type(qm.model.layers[0].mlp.up_proj).__name__ == "Linear"


def test_calibration_runs_in_eval_mode_and_leaves_the_model_as_it_was():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5),
                                torch.nn.Linear(4, 2))  # train mode, as built
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 4)
    site = {qt.Site("3"): qt.init_stats(observer="channel")}
    a = bridge.ModelCalibrator(model, [x]).site_stats(bridge.extract(model), site)
    b = bridge.ModelCalibrator(model, [x]).site_stats(bridge.extract(model), site)
    assert torch.equal(qt.finalize_stats(a[qt.Site("3")]).absmax, qt.finalize_stats(b[qt.Site("3")]).absmax)  # no dropout
    with torch.no_grad():
        want = model.eval()[:3](x).abs().amax(0)
    model.train()
    torch.testing.assert_close(qt.finalize_stats(a[qt.Site("3")]).absmax, want)  # running statistics used
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # batch-norm buffers untouched
    assert model.training and all(m.training for m in model.modules())  # modes restored


def test_misnamed_roles_and_sites_no_batch_reaches_are_named():
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 3), "unused": torch.nn.Linear(3, 3)})
    model.forward = lambda x: model["used"](x)
    cal = bridge.ModelCalibrator(model, [torch.ones(1, 3)])
    with pytest.raises(ValueError, match=r"Site\(module='used', role='inputs'\) is not a Site\(module, role\)"):
        cal.site_stats(bridge.extract(model), {qt.Site("used", "inputs"): qt.init_stats(observer="channel")})
    with pytest.raises(ValueError, match=r"no activation reached site\(s\) \['unused \(input\)'\]"):
        cal.site_stats(bridge.extract(model), {qt.Site("used"): qt.init_stats(observer="channel"),
                                               qt.Site("unused"): qt.init_stats(observer="channel")})


def test_a_dataloader_without_a_length_shows_progress():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([torch.ones(2, 3), torch.full((2, 3), -2.0)])

    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    seen = []

    def progress(it, desc="", total=None):
        seen.append(total)
        return it

    loader = torch.utils.data.DataLoader(Stream(), batch_size=None)
    stats = bridge.ModelCalibrator(model, loader, progress=progress).site_stats(
        bridge.extract(model), {qt.Site("0"): qt.init_stats(observer="channel")})
    assert qt.finalize_stats(stats[qt.Site("0")]).absmax.tolist() == [2.0, 2.0, 2.0] and seen == [None]

"""The measurements on a tiny Llama: the estimate is the mean squared output error of the layer on the calibration
inputs (checked by capturing those inputs with a hook), q/k/v and gate/up share their Hessian and their scheme,
the searched recipe quantizes to exactly the predicted bytes, and the KL reference puts every weight back."""

import sys
import tomllib
from pathlib import Path

import pytest
import torch

import bridge
import qtransform as qt
from bridge.search import kl_reference, measure, spread_pairs
from qtransform.pipeline import recipe_from_dict
from qtransform.search import DEFAULT_CANDIDATES, candidates, quantized_weight, recipe_toml, search

sys.path.insert(0, str(Path(__file__).parents[1]))
from bridge_util import tiny_causal_lm  # noqa: E402

CANDS = candidates(DEFAULT_CANDIDATES)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = tiny_causal_lm("llama").eval()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (2, 24), generator=g) for _ in range(3)]
    return model, batches, measure(model, batches, CANDS)


def _inputs(model, batches, module):
    seen = []
    handle = module.register_forward_hook(lambda m, args, out: seen.append(args[0].detach().flatten(0, -2)))
    with torch.no_grad():
        for b in batches:
            model(b, use_cache=False)
    handle.remove()
    return torch.cat(seen).double()


@pytest.mark.parametrize("estimate", ["hessian", "fisher"])
def test_the_estimate_is_the_output_error_on_the_calibration_inputs_weighted_by_half_the_fisher(tiny, estimate):
    """hessian: the mean over tokens of ||x Eᵀ||²; fisher: each output channel's mean squared error times F_j / 2."""
    model, batches, fisher_sens = tiny
    sens = fisher_sens if estimate == "fisher" else measure(model, batches, CANDS, estimate="hessian")
    assert sens.estimate == estimate and (sens.fisher is None) == (estimate == "hessian")
    path = "model.layers.1.mlp.down_proj.weight"
    module = model.get_submodule(path.rpartition(".")[0])
    x = _inputs(model, batches, module)
    w = module.weight.detach()
    weights = torch.ones(w.shape[0], dtype=torch.float64) if estimate == "hessian" else fisher_sens.fisher[path] / 2
    for c in CANDS:
        w_hat = quantized_weight(w, c.spec).double()
        per_channel = ((x @ (w.double() - w_hat).T) ** 2).mean(0)
        want = float((per_channel * weights).sum())
        assert sens.losses[path][c.name] == pytest.approx(want, rel=1e-4), c.name


def test_groups_share_one_hessian_and_every_layer_is_scored(tiny):
    _, _, sens = tiny
    assert len(sens.layers) == 14 and all(len(v) == len(CANDS) for v in sens.losses.values())
    assert ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight"] in sens.groups
    assert ["model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"] in sens.groups
    for g in sens.groups:
        assert all(sens.hessians[p] is sens.hessians[g[0]] for p in g)


@pytest.mark.parametrize("bits", [3.0, 4.25, 6.0])
def test_the_recipe_quantizes_to_exactly_the_predicted_bytes(tiny, bits):
    model, _, sens = tiny
    r = search(sens.layers, CANDS, sens.losses, budget=bits, groups=sens.groups)
    for g in sens.groups:
        assert len({r.choice[p] for p in g}) == 1
    recipe = recipe_from_dict(tomllib.loads(recipe_toml(r, steps=("rtn",)))).recipe
    result = bridge.quantize_params(model, bridge.plan(model, recipe))
    stored = {p: v.nbytes() for p, v in result.qtree.items() if qt.is_qtensor(v)}
    assert set(stored) == set(sens.layers)
    assert stored == r.sizes and sum(stored.values()) == r.size <= r.budget
    assert r.budget == int(bits * sum(a * b for a, b in sens.layers.values()) / 8)


def test_kl_reference_is_nonnegative_ranks_widths_and_restores_the_model(tiny):
    model, batches, sens = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    two = {p: {c: v[c] for c in ("int8", "uint2-g64")} for p, v in sens.losses.items()}  # few forward passes
    pairs = spread_pairs(two, 2)
    assert [p for p, _ in pairs[::2]] == ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"]
    ref = kl_reference(model, batches[:1], CANDS, pairs, sens.losses)
    assert all(v >= 0 for v in ref.kl.values()) and -1 <= ref.spearman <= 1
    assert ref.kl[(pairs[0][0], "int8")] < ref.kl[(pairs[0][0], "uint2-g64")]
    assert ref.estimate == {k: sens.losses[k[0]][k[1]] for k in pairs}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_unknown_algorithm_names_it(tiny):
    model, batches, _ = tiny
    with pytest.raises(ValueError, match="algorithm must be one of"):
        measure(model, batches, CANDS, algorithm="awq")


def test_unknown_estimate_names_it(tiny):
    model, batches, _ = tiny
    with pytest.raises(ValueError, match="estimate must be one of"):
        measure(model, batches, CANDS, estimate="kl")

"""The search problem: predicted bytes equal the stored bytes of quantized tensors, every constraint holds in
the answer (shared schemes, pins, the target's formats, the budget), the recipe file reads back to the
same specs, and bad input names its argument."""

import itertools
import json
import math
import random
import tomllib

import pytest
import torch

import qtransform as qt
from qtransform.pipeline import recipe_from_dict
from qtransform.search import (DEFAULT_CANDIDATES, budget_bytes, candidate, candidates, output_error, quantized_weight,
                               recipe_json, recipe_toml,
                               search, search_recipe, tensor_bytes)

SHAPES = [(64, 256), (48, 192), (130, 100), (16, 1000)]


@pytest.mark.parametrize("name", DEFAULT_CANDIDATES + ("int3-g32", "nf4-g32", "fp8", "mxfp8"))
@pytest.mark.parametrize("shape", SHAPES)
def test_predicted_bytes_are_the_stored_bytes(name, shape):
    spec = candidate(name).spec
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    q = qt.quantize(w, qt.choose_qparams(w, spec))
    assert tensor_bytes(spec, shape) == q.nbytes()


def test_int4_g128_by_hand():
    # 64 rows x 256 columns: 64 * 128 bytes of nibbles, 64 * 2 float32 scales
    assert tensor_bytes(candidate("int4-g128").spec, (64, 256)) == 64 * 128 + 64 * 2 * 4
    # uint3 g64: 3-bit codes packed per row (96 bytes), float16 scale and zero point per group of 64
    assert tensor_bytes(candidate("uint3-g64").spec, (8, 256)) == 8 * 96 + 8 * 4 * 2 * 2


LAYERS = {"l0.q.weight": (32, 128), "l0.k.weight": (16, 128), "l0.o.weight": (32, 128), "l0.up.weight": (64, 128),
          "l0.down.weight": (32, 256)}
GROUPS = [["l0.q.weight", "l0.k.weight"]]
CANDS = candidates("int8, int4-g128, uint4-g64, uint3-g64, uint2-g64, mxfp4")


def random_losses(seed):
    rng = random.Random(seed)
    return {p: {c.name: rng.uniform(0, 1) * 2.0 ** -qt.bits_per_element(c.spec) for c in CANDS} for p in LAYERS}


def brute(losses, cap, groups, allowed=lambda c: True, pins=None):
    """Least loss over every assignment that honours the groups, pins and target, by enumeration."""
    best = math.inf
    names = [c for c in CANDS if allowed(c)]
    for combo in itertools.product(names, repeat=len(LAYERS)):
        pick = dict(zip(LAYERS, combo))
        if any(len({pick[p].name for p in g}) > 1 for g in groups):
            continue
        if pins and any(pick[p].name != n for p, n in pins.items()):
            continue
        if sum(tensor_bytes(pick[p].spec, s) for p, s in LAYERS.items()) > cap:
            continue
        best = min(best, sum(losses[p][pick[p].name] for p in LAYERS))
    return best


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("bits", [2.6, 3.5, 4.3])
def test_the_answer_honours_every_constraint_and_is_optimal(seed, bits):
    losses = random_losses(seed)
    pins = {"l0.down.weight": "int8"}
    allowed = lambda spec: spec.format != "mxfp4"  # noqa: E731
    try:
        r = search(LAYERS, CANDS, losses, budget=bits, groups=GROUPS, pins=pins, allowed=allowed)
    except ValueError as e:
        assert "budget" in str(e) and brute(losses, budget_bytes(bits, LAYERS.values()), GROUPS,
                                            lambda c: allowed(c.spec), pins) == math.inf
        return
    assert r.size <= r.budget == budget_bytes(bits, LAYERS.values())
    assert r.size == sum(r.sizes.values())
    assert r.choice["l0.q.weight"] == r.choice["l0.k.weight"]
    assert r.choice["l0.down.weight"] == "int8"
    assert all(s.format != "mxfp4" for s in r.specs.values())
    assert r.loss == pytest.approx(brute(losses, r.budget, GROUPS, lambda c: allowed(c.spec), pins) - losses[
        "l0.down.weight"]["int8"] + r.losses["l0.down.weight"])


def test_the_recipe_file_reads_back_to_the_same_specs():
    r = search(LAYERS, CANDS, random_losses(0), budget=4.0, groups=GROUPS)
    text = recipe_toml(r, steps=("hqq",), notes=["a note"])
    for d in (tomllib.loads(text), json.loads(recipe_json(r, steps=("hqq",)))):
        preset = recipe_from_dict(d)
        assert preset.recipe == search_recipe(r, steps=("hqq",))
        assert {p: preset.recipe.resolve(p).spec for p in LAYERS} == r.specs
    assert f"# {r.choice['l0.o.weight']}: {r.sizes['l0.o.weight']} bytes" in text
    assert "# a note" in text


def test_pareto_front_and_uniform_schemes():
    losses = random_losses(1)
    r = search(LAYERS, CANDS, losses, budget=8.5)
    sizes = [s for s, _ in r.front]
    assert sizes == sorted(sizes) and [l for _, l in r.front] == sorted((l for _, l in r.front), reverse=True)
    for name, (size, loss) in r.uniform.items():
        spec = next(c.spec for c in CANDS if c.name == name)
        assert size == sum(tensor_bytes(spec, s) for s in LAYERS.values())
        assert loss == pytest.approx(sum(losses[p][name] for p in LAYERS))
        # no uniform scheme beats the front at its own size
        best = min(l for s, l in r.front if s <= size)
        assert best <= loss + 1e-12


def test_a_missing_loss_rules_the_candidate_out_there():
    losses = random_losses(2)
    del losses["l0.up.weight"]["int8"]
    r = search(LAYERS, CANDS, losses, budget=16)
    assert r.choice["l0.up.weight"] != "int8" and r.choice["l0.o.weight"] == "int8"


@pytest.mark.parametrize("kwargs, match", [
    (dict(budget=0.5), "budget: .* below the smallest possible size"),
    (dict(budget=-1), "budget must be a positive number"),
    (dict(budget=4, pins={"l9.*": "int8"}), r"pin l9\.\*=int8: the pattern matches no searched layer"),
    (dict(budget=4, pins={"l0.q.weight": "int8", "l0.k.weight": "uint2-g64"}), "pin: .* must share one scheme"),
    (dict(budget=4, pins={"l0.q.weight": "int9"}), "candidates: unknown candidate 'int9'"),
    (dict(budget=4, allowed=lambda s: False), "candidates: no candidate fits"),
])
def test_bad_input_names_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        search(LAYERS, CANDS, random_losses(0), groups=GROUPS, **kwargs)


@pytest.mark.parametrize("names, match", [("int4-g128, bogus", "unknown candidate 'bogus'"), ("", "empty"),
                                          ("nf4,nf4", "more than once")])
def test_bad_candidate_lists(names, match):
    with pytest.raises(ValueError, match=f"candidates: .*{match}"):
        candidates(names)


def test_estimate_is_the_output_error_by_finite_sums():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(200, 16, generator=g), torch.randn(8, 16, generator=g)
    h = x.T @ x / 200
    for algorithm in ("rtn", "hqq", "gptq"):
        w_hat = quantized_weight(w, candidate("uint3-g64").spec, algorithm=algorithm, h=h)
        want = float(((x @ w.T - x @ w_hat.T) ** 2).sum(1).mean())
        assert output_error(w, w_hat, h) == pytest.approx(want, rel=1e-4)


def test_inputs_are_not_changed():
    import copy
    losses, pins = random_losses(4), {"l0.o.weight": "int8"}
    layers, groups = dict(LAYERS), [list(g) for g in GROUPS]
    before = copy.deepcopy((losses, pins, layers, groups))
    search(layers, CANDS, losses, budget=4.0, groups=groups, pins=pins)
    assert (losses, pins, layers, groups) == before

"""Recipes and tree transforms."""

import json

import pytest
import torch

import qtransform as qt

INT4 = qt.QuantSpec(format="int4", granularity=qt.PerGroup(16))
INT8 = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))


def _params():
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(32, 16, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(16, 32, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=g),
        "model.layers.0.mlp.up_proj.bias": torch.randn(32, generator=g),
        "model.norm.weight": torch.ones(16),
        "model.position_ids": torch.arange(16),
        "lm_head.weight": torch.randn(32, 16, generator=g),
    }


RECIPE = qt.Recipe(default=INT4, rules={"*.down_proj.weight": INT8, "*.embed_tokens.weight": None},
                   exclude=["lm_head*"])


def test_plan_reports_the_rule_that_matched_each_path():
    plan = RECIPE.plan(_params())
    assert {k: v.rule for k, v in plan.items()} == {
        "model.embed_tokens.weight": "rules[*.embed_tokens.weight]",
        "model.layers.0.mlp.down_proj.weight": "rules[*.down_proj.weight]",
        "model.layers.0.mlp.up_proj.weight": "default",
        "model.layers.0.mlp.up_proj.bias": "skipped (ndim 1 < min_ndim 2)",
        "model.norm.weight": "skipped (ndim 1 < min_ndim 2)",
        "model.position_ids": "skipped (not a floating-point tensor)",
        "lm_head.weight": "exclude[lm_head*]",
    }
    assert plan["model.layers.0.mlp.down_proj.weight"].spec == INT8


def test_rules_are_tried_in_order_then_type_rules_then_default():
    r = qt.Recipe(default=INT4, rules={"*.mlp.*": INT8, "*.down_proj.*": None},
                  type_rules={"Embedding": None})
    assert r.resolve("m.mlp.down_proj.weight").spec == INT8
    assert r.resolve("m.embed.weight", module_type="Embedding").rule == "type_rules[Embedding]"
    assert r.resolve("m.embed.weight").rule == "default"


def test_quantize_tree_follows_the_recipe_and_leaves_the_rest():
    params = _params()
    snapshot = {k: v.clone() for k, v in params.items()}
    qtree = qt.quantize_tree(params, RECIPE)
    assert isinstance(qtree["model.layers.0.mlp.up_proj.weight"], qt.QTensor)
    assert qtree["model.layers.0.mlp.down_proj.weight"].spec == INT8
    for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.position_ids"):
        assert qtree[k] is params[k]
    assert all(torch.equal(params[k], snapshot[k]) for k in params)  # the input tree is untouched
    deq = qt.dequantize_tree(qtree)
    w = params["model.layers.0.mlp.up_proj.weight"]
    assert deq["model.layers.0.mlp.up_proj.weight"].shape == w.shape
    assert (deq["model.layers.0.mlp.up_proj.weight"] - w).abs().max() < w.abs().max() / 7


def test_nested_trees_use_dotted_paths():
    tree = {"block": {"fc": {"weight": torch.randn(4, 16)}}, "heads": [torch.randn(4, 16)]}
    r = qt.Recipe(rules={"block.fc.weight": INT4, "heads.0": INT8})
    qtree = qt.quantize_tree(tree, r)
    assert isinstance(qtree["block"]["fc"]["weight"], qt.QTensor)
    assert isinstance(qtree["heads"][0], qt.QTensor) and qtree["heads"][0].spec == INT8


def test_precomputed_qparams_are_used_and_checked():
    params = _params()
    path = "model.layers.0.mlp.up_proj.weight"
    qp = qt.choose_qparams(params[path] * 0.5, INT4)  # deliberately different from a fresh fit
    qtree = qt.quantize_tree(params, RECIPE, qparams={path: qp})
    assert qtree[path].qparams is qp
    with pytest.raises(ValueError, match="not in the tree"):
        qt.quantize_tree(params, RECIPE, qparams={"nope.weight": qp})
    with pytest.raises(ValueError, match="lm_head.weight: qparams given but the recipe leaves"):
        qt.quantize_tree(params, RECIPE, qparams={"lm_head.weight": qp})
    with pytest.raises(ValueError, match="made for"):
        qt.quantize_tree(params, RECIPE, qparams={"model.layers.0.mlp.down_proj.weight": qp})


def test_a_bare_spec_is_a_recipe_and_bad_recipes_are_rejected():
    qtree = qt.quantize_tree({"w": torch.randn(4, 16)}, INT4)
    assert isinstance(qtree["w"], qt.QTensor)
    with pytest.raises(TypeError, match="recipe must be"):
        qt.quantize_tree({"w": torch.randn(4, 16)}, {"default": INT4})
    with pytest.raises(TypeError, match="QuantSpec or None"):
        qt.Recipe(rules={"*": "int4"})


def test_recipe_json_round_trip_and_unmatched_globs():
    d = json.loads(json.dumps(RECIPE.to_dict()))
    assert qt.Recipe.from_dict(d) == RECIPE
    r = qt.Recipe(default=INT4, rules={"*.q_prj.weight": INT8}, exclude=["lm_head*"])
    assert r.unmatched(_params()) == ["*.q_prj.weight"]


def test_observe_tree_merges_batches_per_path():
    spec = qt.QuantSpec(format="int8")
    r = qt.Recipe(rules={"act.*": spec})
    a = qt.observe_tree(None, {"act.x": torch.tensor([[1.0, -2.0]]), "other": torch.ones(1, 2)}, r)
    b = qt.observe_tree(a, {"act.x": torch.tensor([[4.0, 0.0]])}, r)
    assert set(b) == {"act.x"} and b["act.x"].max.item() == 4.0 and b["act.x"].min.item() == -2.0
    merged = qt.merge_stats_tree(a, qt.observe_tree(None, {"act.x": torch.tensor([[0.0, -3.0]])}, r))
    assert merged["act.x"].min.item() == -3.0
    qps = qt.qparams_tree(b)
    assert abs(qps["act.x"].scale.item() - 4.0 / 127.5) < 1e-7

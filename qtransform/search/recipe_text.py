"""A search's answer as a recipe: one rule per layer, and the recipe-file text (TOML or JSON) that
``qtransform quantize --recipe FILE`` reads back (:func:`qtransform.pipeline.recipe_from_dict`).

The TOML text carries, above each rule, a comment with the candidate's name, its stored bytes and its
estimated loss, and a header with the budget, the predicted size and the estimated total. JSON has no
comments: the same recipe, without them.

>>> import qtransform as qt
>>> from qtransform.search import candidates, search
>>> r = search({"a.weight": (8, 128)}, candidates("int4-g128"), {"a.weight": {"int4-g128": 0.5}}, budget=8)
>>> print(recipe_toml(r, steps=()).splitlines()[-2])
# int4-g128: 544 bytes, estimated loss 0.5
"""

from __future__ import annotations

import json
import math
import re

from ..spec import QuantSpec, Recipe
from .problem import SearchResult

__all__ = ["search_recipe", "recipe_dict", "recipe_toml", "recipe_json"]


def _spec_dict(spec: QuantSpec) -> dict:
    """``spec.to_dict()`` without its null fields (TOML has no null); checked to read back as ``spec``."""
    d = {k: v for k, v in spec.to_dict().items() if v is not None}
    if QuantSpec.from_dict(d) != spec:
        raise ValueError(f"recipe: spec {spec} does not survive without its null fields")
    return d


def search_recipe(result: SearchResult, *, steps=()) -> Recipe:
    """The recipe of ``result``: a rule per searched weight (its exact path), nothing else quantized,
    ``steps`` fitting the weights (an algorithm name, a :class:`~qtransform.Step` or a list of those)."""
    return Recipe(rules=list(result.specs.items()), exclude=(), steps=steps)


def recipe_dict(result: SearchResult, *, steps=()) -> dict:
    """The recipe-file dict of ``result`` (the schema of :func:`qtransform.pipeline.recipe_from_dict`)."""
    recipe = search_recipe(result, steps=steps)
    return {"steps": [s.to_dict() for s in recipe.steps], "exclude": [],
            "rules": {p: _spec_dict(s) for p, s in recipe.rules}}


def _key(k: str) -> str:
    """A TOML key: bare when it can be, quoted otherwise."""
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"recipe: {v} cannot be written to TOML")
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a TOML basic string
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"recipe: cannot write {type(v).__name__} to TOML")


def _header(result: SearchResult, notes) -> list[str]:
    n = sum(result.sizes.values())
    lines = [f"# qtransform search: {len(result.specs)} layers, budget {result.budget} bytes, "
             f"predicted {n} bytes ({result.bits_per_weight:.4f} bits per weight, scales and zero points counted)",
             f"# estimated loss {result.loss:.6g} (" + ("exact knapsack)" if result.exact else
                                                     f"rounded-size knapsack; optimum >= {result.bound:.6g})")]
    return lines + [f"# {line}" for line in notes]


def recipe_toml(result: SearchResult, *, steps=(), notes=()) -> str:
    """The TOML recipe file of ``result``, with the estimate of each rule in a comment above it."""
    d = recipe_dict(result, steps=steps)
    lines = _header(result, notes)
    lines += [f"steps = {_toml_value(d['steps'])}", "exclude = []", "", "[rules]"]
    for p, spec in d["rules"].items():
        lines.append(f"# {result.choice[p]}: {result.sizes[p]} bytes, estimated loss {result.losses[p]:.6g}")
        lines.append(f"{json.dumps(p)} = {_toml_value(spec)}")
    return "\n".join(lines) + "\n"


def recipe_json(result: SearchResult, *, steps=()) -> str:
    """The JSON recipe file of ``result`` (no comments: JSON has none)."""
    return json.dumps(recipe_dict(result, steps=steps), indent=2) + "\n"



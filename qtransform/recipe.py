"""``Recipe``: which spec each path of a parameter tree gets.

Resolution order for a path: ``exclude`` globs (kept in full precision), then
``rules`` in order (first matching glob wins; a ``None`` spec keeps the tensor in full
precision), then ``type_rules`` keyed by module type name (when the caller knows the
types, as the bridge does), then ``default``. The default applies only to floating
tensors with at least ``min_ndim`` dimensions (so biases and norm weights stay
as they are); explicit rules apply regardless. Non-floating tensors are never quantized.

>>> import qtransform as qt
>>> r = qt.Recipe(default=qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)),
...               rules={"*.down_proj.weight": qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))},
...               exclude=["lm_head*"])
>>> r.resolve("model.layers.0.mlp.down_proj.weight").rule
'rules[*.down_proj.weight]'
>>> r.resolve("lm_head.weight").spec is None
True
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Mapping, NamedTuple

import torch

from . import _tree
from .spec import QuantSpec

__all__ = ["Recipe", "Match", "as_recipe"]


class Match(NamedTuple):
    """The spec a path resolved to (``None``: left in full precision) and the rule that decided."""

    spec: QuantSpec | None
    rule: str


def _pairs(name: str, value) -> tuple[tuple[str, QuantSpec | None], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = tuple((k, v) for k, v in items)
    except (TypeError, ValueError):
        raise TypeError(f"Recipe.{name} must be a mapping of glob -> QuantSpec (or None)") from None
    for k, v in pairs:
        if not isinstance(k, str):
            raise TypeError(f"Recipe.{name}: keys must be glob strings, got {k!r}")
        if v is not None and not isinstance(v, QuantSpec):
            raise TypeError(f"Recipe.{name}[{k!r}] must be a QuantSpec or None, got {type(v).__name__}")
    return pairs


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """Glob rules from tree paths to :class:`QuantSpec` (hashable, JSON round-trippable)."""

    default: QuantSpec | None = None
    rules: Any = ()
    type_rules: Any = ()
    exclude: Any = ()
    min_ndim: int = 2

    def __post_init__(self):
        if self.default is not None and not isinstance(self.default, QuantSpec):
            raise TypeError(f"Recipe.default must be a QuantSpec or None, got {type(self.default).__name__}")
        object.__setattr__(self, "rules", _pairs("rules", self.rules))
        object.__setattr__(self, "type_rules", _pairs("type_rules", self.type_rules))
        excl = (self.exclude,) if isinstance(self.exclude, str) else tuple(self.exclude)
        if any(not isinstance(e, str) for e in excl):
            raise TypeError("Recipe.exclude must be a list of glob strings")
        object.__setattr__(self, "exclude", excl)
        if not isinstance(self.min_ndim, int) or self.min_ndim < 1:
            raise ValueError(f"Recipe.min_ndim must be a positive int, got {self.min_ndim!r}")

    def resolve(self, path: str, *, module_type: str | None = None, ndim: int | None = None,
                floating: bool = True) -> Match:
        """The spec for ``path`` and the name of the rule that chose it."""
        if not floating:
            return Match(None, "skipped (not a floating-point tensor)")
        for pattern in self.exclude:
            if fnmatch.fnmatchcase(path, pattern):
                return Match(None, f"exclude[{pattern}]")
        for pattern, spec in self.rules:
            if fnmatch.fnmatchcase(path, pattern):
                return Match(spec, f"rules[{pattern}]")
        if module_type is not None:
            for name, spec in self.type_rules:
                if name == module_type:
                    return Match(spec, f"type_rules[{name}]")
        if self.default is None:
            return Match(None, "no rule")
        if ndim is not None and ndim < self.min_ndim:
            return Match(None, f"skipped (ndim {ndim} < min_ndim {self.min_ndim})")
        return Match(self.default, "default")

    def plan(self, tree: Any, *, types: Mapping[str, str] | None = None) -> dict[str, Match]:
        """Resolve every tensor leaf of ``tree``: ``{path: Match}`` in tree order."""
        pairs, _ = _tree.flatten_with_paths(tree)
        types = types or {}
        return {
            path: self.resolve(path, module_type=types.get(path), ndim=leaf.dim(),
                               floating=leaf.is_floating_point())
            for path, leaf in pairs if isinstance(leaf, torch.Tensor)
        }

    def unmatched(self, paths) -> list[str]:
        """Rule and exclude globs that match none of ``paths`` (likely typos)."""
        paths = list(paths)
        globs = [p for p, _ in self.rules] + list(self.exclude)
        return [g for g in globs if not any(fnmatch.fnmatchcase(p, g) for p in paths)]

    def to_dict(self) -> dict:
        spec = lambda s: None if s is None else s.to_dict()  # noqa: E731
        return {
            "default": spec(self.default),
            "rules": [[k, spec(v)] for k, v in self.rules],
            "type_rules": [[k, spec(v)] for k, v in self.type_rules],
            "exclude": list(self.exclude),
            "min_ndim": self.min_ndim,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        if not isinstance(d, dict):
            raise TypeError(f"Recipe.from_dict expects a dict, got {type(d).__name__}")
        unknown = sorted(set(d) - {"default", "rules", "type_rules", "exclude", "min_ndim"})
        if unknown:
            raise ValueError(f"Recipe.from_dict: unknown field(s) {unknown}")
        spec = lambda s: None if s is None else QuantSpec.from_dict(s)  # noqa: E731
        pairs = lambda items: [(k, spec(v)) for k, v in (items.items() if isinstance(items, dict) else items)]  # noqa: E731
        return cls(default=spec(d.get("default")), rules=pairs(d.get("rules", [])),
                   type_rules=pairs(d.get("type_rules", [])), exclude=d.get("exclude", ()),
                   min_ndim=d.get("min_ndim", 2))


def as_recipe(recipe) -> Recipe:
    """A :class:`Recipe`, or a bare :class:`QuantSpec` as ``Recipe(default=spec)``."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, QuantSpec):
        return Recipe(default=recipe)
    raise TypeError(f"recipe must be a qtransform Recipe or QuantSpec, got {type(recipe).__name__}")

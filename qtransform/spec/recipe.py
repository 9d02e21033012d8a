"""``Recipe``: which spec each path of a parameter tree gets.

Resolution order for a path: ``exclude`` globs (kept in full precision), then
``rules`` in order (first matching glob wins; a ``None`` spec keeps the tensor in full
precision), then ``type_rules`` keyed by module type name (when the caller knows the
types, as the bridge does), then ``default``. Type rules and the default apply only to
floating tensors with at least ``min_ndim`` dimensions (a ``Linear`` rule selects the
weight, not the bias; norm weights stay as they are); glob rules apply regardless.
Non-floating tensors are never quantized.

``steps`` are the algorithms that fit the selected tensors, in order (see :class:`Step`):
none means round to nearest from each tensor's min/max.

Activations: ``input`` and ``output`` are the specs of what enters and leaves every module whose
weight is quantized (``None``: left in full precision); ``act_rules`` override them per site,
``{"<module glob>:<role>": spec or None}``, first match wins (``"*.down_proj:input"``). A
``dynamic=True`` spec is fitted to each activation at run time; a static one is calibrated from
data (see :attr:`Plan.activations`).

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
from typing import Any, Mapping

import torch

from .. import _pytree
from ..granularity import PerChannel
from .plan import KV_ROLES, ROLES, SITE_ROLES, Match, Plan, is_kv_granularity
from .quantspec import QuantSpec
from .step import Step

__all__ = ["Recipe", "as_recipe", "as_plan"]


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


def _globs(value) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    bad = lambda: TypeError(f"Recipe.exclude must be a glob string or a list of them, got {value!r}")  # noqa: E731
    if isinstance(value, (Mapping, bytes)):
        raise bad()
    try:
        globs = tuple(value)
    except TypeError:
        raise bad() from None
    wrong = [g for g in globs if not isinstance(g, str)]
    if wrong:
        raise TypeError(f"Recipe.exclude must hold glob strings, got {wrong[0]!r}")
    return globs


def check_tree(tree: Any, *, name: str = "params") -> list[tuple[str, torch.Tensor]]:
    """``[(path, tensor), ...]`` of a parameter tree; ``TypeError`` naming the path for a leaf that is not
    a tensor (a numpy array, a number, a string, ``None``...): such leaves would pass through unquantized."""
    if tree is None:
        raise TypeError(f"{name} must be a tree of tensors (a dict, list or tuple of torch.Tensor), got None")
    pairs = _pytree.flatten_with_paths(tree)[0]
    for path, leaf in pairs:
        if not isinstance(leaf, torch.Tensor):
            numpy = type(leaf).__module__.startswith("numpy")
            kind = f"numpy.{type(leaf).__name__}" if numpy else type(leaf).__name__
            hint = " (convert arrays with torch.from_numpy)" if numpy else ""
            at = f"{name}[{path!r}]" if path else name
            raise TypeError(f"{at} is not a torch.Tensor (got {kind}): {name} must be a tree (dicts, lists, "
                            f"tuples) of tensors{hint}")
    return pairs


def _check_types(types) -> dict:
    if types is None:
        return {}
    if not isinstance(types, Mapping):
        raise TypeError(f"types must map tree paths to module type names, got {type(types).__name__}")
    for k, v in types.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"types must map tree paths (str) to module type names (str), got {k!r}: {v!r}")
    return dict(types)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """Glob rules from tree paths to :class:`QuantSpec`, and the steps that fit them (hashable,
    JSON round-trippable).

    Args:
        default: spec of floating tensors with at least ``min_ndim`` dimensions no rule names.
        rules: ``{glob: spec or None}``, first match wins.
        type_rules: ``{module type name: spec or None}`` (``"Linear"``, ``"Conv1D"``...).
        exclude: globs kept in full precision whatever else matches.
        min_ndim: the default applies to tensors with at least this many dimensions.
        steps: algorithms run in order (names, :class:`Step` objects or their dicts).
        input, output: activation specs of every quantized module's input and output.
        kv_cache: spec of the key/value cache of every attention layer: keys and values as the cache
            stores them (after rotary embeddings), static per tensor (one ``k_scale`` and one ``v_scale``
            per layer, calibrated from data), e.g. ``QuantSpec(format="fp8_e4m3")``, or per key/value head
            (``granularity=PerChannel(1)``: axis 1 of the cache's ``(batch, heads, tokens, head_dim)``).
        act_rules: ``{"<module glob>:<role>": spec or None}`` overriding ``input``/``output`` (roles
            ``input``, ``output``) and ``kv_cache`` (roles ``key``, ``value`` of attention modules).
    """

    default: QuantSpec | None = None
    rules: Any = ()
    type_rules: Any = ()
    exclude: Any = ()
    min_ndim: int = 2
    steps: Any = ()
    input: QuantSpec | None = None
    output: QuantSpec | None = None
    kv_cache: QuantSpec | None = None
    act_rules: Any = ()

    def __post_init__(self):
        for name in ("default", "input", "output", "kv_cache"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), QuantSpec):
                raise TypeError(f"Recipe.{name} must be a QuantSpec or None, got {type(getattr(self, name)).__name__}")
        object.__setattr__(self, "act_rules", _pairs("act_rules", self.act_rules))
        for glob, _ in self.act_rules:
            if glob.rpartition(":")[2] not in SITE_ROLES:
                raise ValueError(f"Recipe.act_rules[{glob!r}]: keys are '<module glob>:<role>' with role in "
                                 f"{list(SITE_ROLES)}")
        kv = [("kv_cache", self.kv_cache)] + [(f"act_rules[{g!r}]", v) for g, v in self.act_rules
                                              if g.rpartition(":")[2] in KV_ROLES]
        for name, spec in kv:
            if spec is not None and (spec.dynamic or not is_kv_granularity(spec.granularity)):
                raise ValueError(f"Recipe.{name}: the key/value cache is quantized with static scales per tensor "
                                 "(PerTensor: one k_scale and one v_scale per attention layer) or per key/value head "
                                 f"(PerChannel(1)), calibrated from data, got {spec}")
        for name, spec in [("input", self.input), ("output", self.output)] + [
                (f"act_rules[{g!r}]", v) for g, v in self.act_rules]:
            g = getattr(spec, "granularity", None)
            if spec is not None and not spec.dynamic and isinstance(g, PerChannel) and g.axis == 0:
                raise ValueError(f"Recipe.{name}: a static activation spec cannot be per token (PerChannel(0): "
                                 "tokens differ at run time); use dynamic=True, or PerTensor / PerChannel(-1)")
        object.__setattr__(self, "rules", _pairs("rules", self.rules))
        object.__setattr__(self, "type_rules", _pairs("type_rules", self.type_rules))
        object.__setattr__(self, "exclude", _globs(self.exclude))
        if not isinstance(self.min_ndim, int) or isinstance(self.min_ndim, bool) or self.min_ndim < 1:
            raise ValueError(f"Recipe.min_ndim must be a positive int, got {self.min_ndim!r}")
        steps = (self.steps,) if isinstance(self.steps, (str, Step, Mapping)) else self.steps
        try:
            steps = tuple(steps)
        except TypeError:
            raise TypeError(f"Recipe.steps must be a list of steps, got {type(self.steps).__name__}") from None
        object.__setattr__(self, "steps", tuple(Step.from_value(s, where=f"Recipe.steps[{i}]")
                                                for i, s in enumerate(steps)))

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
        if ndim is not None and ndim < self.min_ndim:  # type rules and the default select weights
            return Match(None, f"skipped (ndim {ndim} < min_ndim {self.min_ndim})" if (
                self.default is not None or module_type in dict(self.type_rules)) else "no rule")
        if module_type is not None:
            for name, spec in self.type_rules:
                if name == module_type:
                    return Match(spec, f"type_rules[{name}]")
        if self.default is None:
            return Match(None, "no rule")
        return Match(self.default, "default")

    def resolve_activation(self, module: str, role: str) -> Match:
        """The activation spec of ``role`` (``"input"``/``"output"``; ``"key"``/``"value"`` of an attention
        module) of the module at path ``module``."""
        for pattern, spec in self.act_rules:
            if fnmatch.fnmatchcase(f"{module}:{role}", pattern):
                return Match(spec, f"act_rules[{pattern}]")
        spec = {"input": self.input, "output": self.output}.get(role, self.kv_cache)
        return Match(spec, ("kv_cache" if role in KV_ROLES else role) if spec is not None else "no rule")

    def plan(self, tree: Any, *, types: Mapping[str, str] | None = None, attention=(), groups=None,
             layout=None) -> Plan:
        """Resolve every tensor leaf of ``tree`` once: a :class:`Plan` (``{path: Match}`` in tree order).

        ``types`` maps paths to module type names, for ``type_rules``; ``attention`` lists the module
        paths of the attention layers (for ``kv_cache``), ``groups`` the smoothing groups and ``layout``
        the residual layout (the model's facts some steps read: :class:`Plan`). Every leaf of ``tree`` must be a tensor
        (``TypeError`` names the first that is not).
        """
        types = _check_types(types)
        pairs = check_tree(tree)
        matches = {}
        for path, leaf in pairs:
            if isinstance(leaf, torch.Tensor):
                kind = types.get(path)
                m = self.resolve(path, module_type=kind, ndim=leaf.dim(), floating=leaf.is_floating_point())
                matches[path] = m._replace(module_type=kind)
        return Plan(self, matches, attention=attention, groups=groups, layout=layout)

    def unmatched(self, paths) -> list[str]:
        """Rule and exclude globs that match none of ``paths`` (likely typos; ``:key``/``:value`` globs
        are tried on the attention modules of a :class:`Plan`)."""
        attention = getattr(paths, "attention", ())
        paths = list(paths)
        globs = [p for p, _ in self.rules] + list(self.exclude)
        out = [g for g in globs if not any(fnmatch.fnmatchcase(p, g) for p in paths)]
        sites = [f"{p.rpartition('.')[0]}:{r}" for p in paths for r in ROLES]
        sites += [f"{m}:{r}" for m in attention for r in KV_ROLES]
        return out + [g for g, _ in self.act_rules if not any(fnmatch.fnmatchcase(s, g) for s in sites)]

    def to_dict(self) -> dict:
        spec = lambda s: None if s is None else s.to_dict()  # noqa: E731
        return {
            "default": spec(self.default),
            "rules": [[k, spec(v)] for k, v in self.rules],
            "type_rules": [[k, spec(v)] for k, v in self.type_rules],
            "exclude": list(self.exclude),
            "min_ndim": self.min_ndim,
            "steps": [s.to_dict() for s in self.steps],
            **({"input": spec(self.input)} if self.input is not None else {}),
            **({"output": spec(self.output)} if self.output is not None else {}),
            **({"kv_cache": spec(self.kv_cache)} if self.kv_cache is not None else {}),
            **({"act_rules": [[k, spec(v)] for k, v in self.act_rules]} if self.act_rules else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        """Inverse of :meth:`to_dict`. Raises ``TypeError``/``ValueError`` naming the field
        (``Recipe.from_dict: rules['*.w']: ...``) for anything malformed."""
        if not isinstance(d, Mapping):
            raise TypeError(f"Recipe.from_dict expects a dict, got {type(d).__name__}")
        unknown = sorted(set(d) - {"default", "rules", "type_rules", "exclude", "min_ndim", "steps", "input", "output",
                                   "kv_cache", "act_rules"})
        if unknown:
            raise ValueError(f"Recipe.from_dict: unknown field(s) {unknown}")
        try:
            return cls(default=_spec_from(d.get("default"), "default"), rules=_pairs_from(d.get("rules", []), "rules"),
                       type_rules=_pairs_from(d.get("type_rules", []), "type_rules"), exclude=d.get("exclude", ()),
                       min_ndim=d.get("min_ndim", 2), steps=d.get("steps", ()),
                       input=_spec_from(d.get("input"), "input"), output=_spec_from(d.get("output"), "output"),
                       kv_cache=_spec_from(d.get("kv_cache"), "kv_cache"), act_rules=_pairs_from(d.get("act_rules", []), "act_rules"))
        except (TypeError, ValueError) as e:
            if str(e).startswith("Recipe.from_dict"):
                raise
            raise type(e)(f"Recipe.from_dict: {e}") from None


def _spec_from(value, where: str) -> QuantSpec | None:
    if value is None or isinstance(value, QuantSpec):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"Recipe.from_dict: {where} must be a spec dict (QuantSpec.to_dict()) or null, "
                        f"got {type(value).__name__}")
    try:
        return QuantSpec.from_dict(dict(value))
    except (TypeError, ValueError) as e:
        raise type(e)(f"Recipe.from_dict: {where}: {e}") from None


def _pairs_from(items, name: str) -> list:
    """``[[glob, spec dict], ...]`` (or ``{glob: spec dict}``) -> ``[(glob, QuantSpec or None), ...]``."""
    if isinstance(items, Mapping):
        items = list(items.items())
    if isinstance(items, (str, bytes)) or not isinstance(items, (list, tuple)):
        raise TypeError(f"Recipe.from_dict: {name} must be a list of [glob, spec] pairs or a "
                        f"{{glob: spec}} object, got {type(items).__name__}")
    out = []
    for i, pair in enumerate(items):
        if isinstance(pair, (str, bytes)) or not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise TypeError(f"Recipe.from_dict: {name}[{i}] must be a [glob, spec] pair, got {pair!r}")
        glob, value = pair
        if not isinstance(glob, str):
            raise TypeError(f"Recipe.from_dict: {name}[{i}]: the glob must be a string, got {glob!r}")
        out.append((glob, _spec_from(value, f"{name}[{glob!r}]")))
    return out


def as_recipe(recipe) -> Recipe:
    """A :class:`Recipe`, or a bare :class:`QuantSpec` as ``Recipe(default=spec)``."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, QuantSpec):
        return Recipe(default=recipe)
    raise TypeError(f"recipe must be a qtransform Recipe or QuantSpec, got {type(recipe).__name__}")


def as_plan(recipe, tree: Any, *, types: Mapping[str, str] | None = None) -> Plan:
    """``recipe`` resolved for ``tree``: a :class:`Plan` is used as it is (resolved once, upstream);
    a :class:`Recipe` or bare :class:`QuantSpec` is resolved with ``types``."""
    if isinstance(recipe, Plan):
        if types is not None:
            raise TypeError("types cannot be given with a Plan: the plan already holds each path's module type")
        paths = [p for p, _ in check_tree(tree)]
        if paths != list(recipe):
            extra = sorted(set(paths) - set(recipe))
            missing = sorted(set(recipe) - set(paths))
            raise ValueError(f"the Plan was resolved for another tree: tensor paths not in the plan "
                             f"{extra[:5]}, plan paths not in the tree {missing[:5]}"
                             + ("" if extra or missing else " (same paths, different order)"))
        return recipe
    return as_recipe(recipe).plan(tree, types=types)

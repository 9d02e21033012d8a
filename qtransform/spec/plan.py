"""``Plan``: a recipe resolved once for a parameter tree.

The plan maps every tensor path of the tree to a :class:`Match` (the spec, the rule that
chose it and the module type the caller gave), in tree order, and carries the recipe's
steps. Everything downstream (the steps, calibration, ``quantize_tree``, the bridge's
rebuild, checkpoints and reports) reads the plan instead of resolving the recipe again.

Activation *sites* are named by module path and role: ``Site("model.layers.0.mlp.down_proj",
"input")`` is what enters that module. :meth:`Plan.sites` lists the modules of the quantized
weights, the sites that calibration hooks watch.

>>> import torch, qtransform as qt
>>> params = {"fc1.weight": torch.ones(8, 16), "fc1.bias": torch.ones(8), "fc2.weight": torch.ones(4, 8)}
>>> plan = qt.Recipe(default=qt.QuantSpec(format="int8"), exclude=["fc2.*"]).plan(params)
>>> list(plan.specs), plan["fc2.weight"].rule
(['fc1.weight'], 'exclude[fc2.*]')
>>> plan.sites()
{Site(module='fc1', role='input'): ('fc1.weight',)}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Iterable, Iterator, NamedTuple

from .quantspec import QuantSpec

__all__ = ["Match", "Site", "Plan", "ROLES", "KV_ROLES", "SITE_ROLES", "is_kv_granularity", "module_of"]

#: Activation roles of a site: what enters a module, what leaves it.
ROLES = ("input", "output")
#: Roles of an attention module's sites: the keys and values as its key/value cache stores them
#: (after rotary embeddings, laid out ``(batch, heads, tokens, head_dim)``), quantized with static scales
#: per tensor or per key/value head (``k_scale``, ``v_scale``; :func:`is_kv_granularity`).
KV_ROLES = ("key", "value")
SITE_ROLES = ROLES + KV_ROLES


def is_kv_granularity(g) -> bool:
    """Whether static scales of granularity ``g`` fit a key/value cache: ``PerTensor()`` or ``PerChannel(1)``
    (one scale per key/value head: axis 1 of the cache's ``(batch, heads, tokens, head_dim)`` layout)."""
    from ..granularity import PerChannel, PerTensor

    return isinstance(g, PerTensor) or (isinstance(g, PerChannel) and g.axis == 1)


class Match(NamedTuple):
    """The spec a path resolved to (``None``: left in full precision), the rule that decided, and
    the module type the path belongs to (when the caller knows it)."""

    spec: QuantSpec | None
    rule: str
    module_type: str | None = None


class Site(NamedTuple):
    """An activation site: the ``role`` of the module at path ``module``: ``"input"`` or ``"output"``
    of a module with a quantized weight, ``"key"`` or ``"value"`` of an attention module (its cache)."""

    module: str
    role: str = "input"


def module_of(path: str) -> str:
    """The module path of a parameter path: ``"a.b.weight"`` -> ``"a.b"`` (``""`` for a top-level name)."""
    return path.rpartition(".")[0]


class Plan(Mapping):
    """``{path: Match}`` for every tensor leaf of a tree, with the recipe that made it.

    Build one with :meth:`qtransform.Recipe.plan`. Read-only. The model's facts, which the caller who
    knows the model gives (``bridge.plan`` from its architecture tables), not the user's choices:

    * ``attention``: the module paths of the attention layers (their key/value cache sites);
    * ``groups``: the smoothing groups, plain dicts ``{"prev": ..., "linears": [...], ...}``
      (:mod:`qtransform.algorithms.smoothing`), read by ``smoothquant``, ``awq`` and ``gptq``; ``None``:
      unknown;
    * ``layout``: the residual-stream layout (a :class:`qtransform.rotation.ResidualLayout` or its dict),
      read by ``rotate`` and ``spinquant``; ``None``: unknown;
    * ``transposed_experts``: the paths of the stacked ``"Experts"`` weights stored ``(experts, in, out)`` (transformers'
      ``is_transposed`` experts, GPT-OSS); the others are ``(experts, out, in)``.

    A step that needs a fact the plan does not have refuses to run, naming itself (see
    :func:`qtransform.check_steps`); the recipe, and so checkpoints, keep only what the user chose.
    """

    def __init__(self, recipe, matches: Mapping[str, Match], *, attention: Iterable[str] = (),
                 groups: Iterable[Mapping] | None = None, layout=None, transposed_experts: Iterable[str] = ()):
        self.recipe = recipe
        self._matches = dict(matches)
        self.attention = _paths(attention)
        self.transposed_experts = frozenset(_paths(transposed_experts))
        self.groups = _groups(groups)
        if isinstance(layout, (str, bytes)) or not (layout is None or isinstance(layout, Mapping)
                                                    or hasattr(layout, "to_dict")):
            raise TypeError(f"Plan: layout must be a ResidualLayout, its dict or None, got {type(layout).__name__}")
        self.layout = layout
        self._specs = {p: m.spec for p, m in self._matches.items() if m.spec is not None}

    def replace(self, **changes) -> "Plan":
        """A copy with some of ``recipe``, ``matches``, ``attention``, ``groups``, ``layout`` replaced.

        >>> import torch, qtransform as qt
        >>> p = qt.Recipe(default=qt.QuantSpec(format="int8")).plan({"fc.weight": torch.ones(2, 2)})
        >>> p.replace(groups=[{"prev": "ln", "linears": ["fc"]}]).groups, p.groups
        (({'prev': 'ln', 'linears': ['fc']},), None)
        """
        unknown = sorted(set(changes) - {"recipe", "matches", "attention", "groups", "layout", "transposed_experts"})
        if unknown:
            raise TypeError(f"Plan.replace: unknown field(s) {unknown}")
        now = dict(recipe=self.recipe, matches=self._matches, attention=self.attention, groups=self.groups,
                   layout=self.layout, transposed_experts=self.transposed_experts)
        now.update(changes)
        return Plan(now.pop("recipe"), now.pop("matches"), **now)

    @property
    def steps(self) -> tuple:
        """The recipe's steps, in order."""
        return self.recipe.steps

    @property
    def specs(self) -> Mapping[str, QuantSpec]:
        """``{path: spec}`` of the paths to quantize, in tree order."""
        return self._specs

    def site_module(self, path: str) -> str:
        """The module path of the activation sites of weight ``path``: its module (:func:`module_of`), or the
        path itself for a stacked ``"Experts"`` weight (each projection of a mixture-of-experts layer sees its
        own input, per expert).

        >>> import torch, qtransform as qt
        >>> p = qt.Recipe(default=qt.QuantSpec(format="int8")).plan(
        ...     {"mlp.experts.down_proj": torch.ones(4, 8, 8), "fc.weight": torch.ones(8, 8)},
        ...     types={"mlp.experts.down_proj": "Experts"})
        >>> p.site_module("mlp.experts.down_proj"), p.site_module("fc.weight")
        ('mlp.experts.down_proj', 'fc')
        """
        m = self._matches.get(path)
        return path if m is not None and m.module_type == "Experts" else module_of(path)

    def sites(self, role: str = "input") -> dict[Site, tuple[str, ...]]:
        """``{Site(module, role): (quantized paths of that module, ...)}`` in tree order."""
        if role not in ROLES:
            raise ValueError(f"Plan.sites: role must be one of {list(ROLES)}, got {role!r}")
        out: dict[Site, tuple[str, ...]] = {}
        for path in self._specs:
            site = Site(self.site_module(path), role)
            out[site] = out.get(site, ()) + (path,)
        return out

    @property
    def activations(self) -> dict[Site, QuantSpec]:
        """``{Site: spec}`` of the activations to quantize: the inputs and outputs of the modules whose
        weight is quantized, as the recipe's ``input``/``output``/``act_rules`` say (an embedding's
        input, token ids, never), and the keys and values of the :attr:`attention` modules as the
        recipe's ``kv_cache``/``act_rules`` say. Static specs must be calibrated, dynamic ones are
        fitted at run time."""
        resolve = getattr(self.recipe, "resolve_activation", None)
        if resolve is None:
            return {}
        out = {}
        for module in self.attention:
            for role in KV_ROLES:
                spec = resolve(module, role).spec
                if spec is not None:
                    out[Site(module, role)] = spec
        for path in self._specs:
            module, kind = self.site_module(path), self._matches[path].module_type
            for role in ROLES:
                if role == "input" and kind in ("Embedding", "EmbeddingBag"):
                    continue
                spec = resolve(module, role).spec
                if spec is not None:
                    out[Site(module, role)] = spec
        return out

    def restrict(self, paths: Iterable[str]) -> "Plan":
        """The plan of a sub-tree holding only ``paths`` (e.g. one weight read while loading)."""
        paths = list(paths)
        missing = [p for p in paths if p not in self._matches]
        if missing:
            raise ValueError(f"Plan.restrict: path(s) not in the plan: {missing[:5]}")
        return self.replace(matches={p: self._matches[p] for p in paths})

    def __getitem__(self, path: str) -> Match:
        return self._matches[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self._matches)

    def __len__(self) -> int:
        return len(self._matches)

    def __repr__(self) -> str:
        return f"Plan({len(self._specs)} of {len(self._matches)} tensors quantized, steps={list(self.steps)})"


def _groups(groups) -> tuple[dict, ...] | None:
    if groups is None:
        return None
    if isinstance(groups, (str, Mapping)) or not isinstance(groups, Iterable):
        raise TypeError(f"Plan: groups must be a list of smoothing group dicts or None, got {type(groups).__name__}")
    out = tuple(groups)
    bad = [g for g in out if not isinstance(g, Mapping)]
    if bad:
        raise TypeError(f"Plan: each smoothing group must be a dict {{'prev': ..., 'linears': [...]}}, got {bad[0]!r:.80}")
    return tuple(dict(g) for g in out)


def _paths(attention) -> tuple[str, ...]:
    if isinstance(attention, str) or not isinstance(attention, Iterable):
        raise TypeError(f"Plan: attention must be a list of module paths, got {type(attention).__name__}")
    out = tuple(attention)
    bad = [a for a in out if not isinstance(a, str)]
    if bad:
        raise TypeError(f"Plan: attention module paths must be strings, got {bad[0]!r}")
    return out

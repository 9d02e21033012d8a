"""Recipe files: the JSON/TOML schema (parsed by the caller) and transformers' ``HqqConfig`` form.

``recipe_from_dict`` reads::

    {"steps": ["hqq"] | [{"name": "hqq", "options": {"error_norm": 4}}],
     "default": spec, "rules": {glob: spec | null}, "type_rules": {...}, "exclude": [...],
     "min_ndim": 2, "input": spec, "output": spec, "kv_cache": spec,
     "act_rules": {"<module glob>:<role>": spec | null}}

where a spec is a ``QuantSpec.to_dict()`` dict or a preset name. ``"algorithm"`` with
``"options"`` is shorthand for one step. The ``HqqConfig`` form has ``nbits``, ``group_size``,
``axis``, ``skip_modules`` and ``dynamic_config`` (``{"self_attn.q_proj": {"nbits": 4,
"group_size": 64}}``), with the ``hqq`` step unless ``steps``/``algorithm`` says otherwise.

>>> from qtransform.pipeline import recipe_from_dict
>>> p = recipe_from_dict({"algorithm": "hqq", "options": {"error_norm": 4}, "default": "hqq3-g64"})
>>> p.recipe.steps, str(p.recipe.default)
((Step('hqq', error_norm=4),), 'uint3 g64 asym(float zp)')
"""

from __future__ import annotations

from typing import Mapping

from ..spec import QuantSpec, Recipe, Step
from .presets import DEFAULT_EXCLUDE, LINEAR_TYPES, Preset, get_preset, hqq_spec
from .run import check_steps

__all__ = ["recipe_from_dict", "from_hqq_config"]


def _tag_glob(tag: str) -> str:
    return f"*.{tag}.weight" if not tag.startswith("*") else f"{tag}.weight"


def from_hqq_config(*, nbits: int = 4, group_size: int | None = 64, axis: int = 1,
                    dynamic_config: Mapping[str, Mapping] | None = None,
                    skip_modules=("lm_head",), steps=("hqq",)) -> Recipe:
    """A recipe equivalent to transformers' ``HqqConfig``.

    ``dynamic_config`` is keyed by module tags without ``model``, ``layers`` and indices
    (``"self_attn.q_proj"``), each with ``nbits``/``group_size``/``axis``; tags become globs
    ``*.self_attn.q_proj.weight``. Without a dynamic config every linear layer uses
    ``nbits``/``group_size``/``axis``; with one, only the tagged layers are quantized (as in
    transformers). ``steps`` fit the parameters (HQQ by default).
    """
    _check_hqq_args("", nbits, group_size, axis)
    if dynamic_config is not None and not isinstance(dynamic_config, Mapping):
        raise TypeError(f"dynamic_config must be a dict of module tag -> {{nbits, group_size, axis}}, got "
                        f"{type(dynamic_config).__name__}")
    if skip_modules is not None and (isinstance(skip_modules, (str, Mapping)) or not isinstance(skip_modules, (list, tuple))
                                     or not all(isinstance(m, str) for m in skip_modules)):
        raise TypeError(f"skip_modules must be a list of module names (e.g. ['lm_head']), got {skip_modules!r}")
    rules = {}
    for tag, cfg in (dynamic_config or {}).items():
        if not isinstance(tag, str):
            raise TypeError(f"dynamic_config keys must be module tags (str), got {tag!r}")
        if not isinstance(cfg, Mapping):
            raise TypeError(f"dynamic_config[{tag!r}] must be a dict of nbits/group_size/axis")
        unknown = sorted(set(cfg) - {"nbits", "group_size", "axis", "quant_zero", "quant_scale",
                                     "offload_meta", "view_as_float"})
        if unknown:
            raise ValueError(f"dynamic_config[{tag!r}]: unknown key(s) {unknown}")
        args = (cfg.get("nbits", nbits), cfg.get("group_size", group_size), cfg.get("axis", axis))
        _check_hqq_args(f"dynamic_config[{tag!r}].", *args)
        rules[_tag_glob(tag)] = hqq_spec(args[0], args[1], axis=args[2])
    exclude = tuple(f"{m}*" if m == "lm_head" else _tag_glob(m) for m in (skip_modules or ()))
    type_rules = {} if rules else {t: hqq_spec(nbits, group_size, axis=axis) for t in LINEAR_TYPES}
    return Recipe(rules=rules, type_rules=type_rules, exclude=exclude, steps=steps)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_hqq_args(where: str, nbits, group_size, axis) -> None:
    """``TypeError``/``ValueError`` naming the HqqConfig key for a bad ``nbits``/``group_size``/``axis``."""
    for name, value, ok, want in (("nbits", nbits, lambda v: 1 <= v <= 8, "an int in 1..8"),
                                  ("group_size", group_size, lambda v: v >= 1, "a positive int or null"),
                                  ("axis", axis, lambda v: v in (0, 1), "0 or 1")):
        if name == "group_size" and value is None:
            continue
        if not _is_int(value):
            raise TypeError(f"{where}{name} must be {want}, got {value!r}")
        if not ok(value):
            raise ValueError(f"{where}{name} must be {want}, got {value!r}")


def _spec(value, where: str) -> QuantSpec | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            spec = get_preset(value).spec
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if spec is None:
            raise ValueError(f"{where}: preset {value!r} has no single spec")
        return spec
    if isinstance(value, Mapping):
        try:
            return QuantSpec.from_dict(dict(value))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
    raise TypeError(f"{where}: expected a spec dict, a preset name or null, got {type(value).__name__}")


def _steps(d: Mapping, default) -> tuple[Step, ...]:
    if "steps" in d and ("algorithm" in d or "options" in d):
        raise ValueError("recipe: give either 'steps' or 'algorithm' (with 'options'), not both")
    if "steps" in d:
        raw = d["steps"]
        if isinstance(raw, (str, Mapping)) or not isinstance(raw, (list, tuple)):
            raise TypeError(f"recipe.steps must be a list of steps, got {type(raw).__name__}")
        steps = tuple(Step.from_value(s, where=f"recipe.steps[{i}]") for i, s in enumerate(raw))
    elif "algorithm" in d or "options" in d:
        options = d.get("options", {})
        if not isinstance(options, Mapping):
            raise TypeError(f"recipe.options must be a table/object, got {type(options).__name__}")
        name = d.get("algorithm", default[0].name if default else "rtn")  # options alone: the form's algorithm
        steps = (Step.from_value({"name": name, "options": dict(options)}, where="recipe.algorithm"),)
    else:
        steps = default
    check_steps(steps)  # names and options now; whether calibration data is at hand is checked where it runs
    return steps


def recipe_from_dict(d: Mapping, *, name: str = "recipe") -> Preset:
    """A :class:`Preset` (``name``, recipe, description) from the recipe-file schema (see the module
    docstring). Raises ``ValueError``/``TypeError`` naming the key for anything malformed."""
    if not isinstance(d, Mapping):
        raise TypeError(f"a recipe file must hold a table/object, got {type(d).__name__}")
    known = {"steps", "algorithm", "options", "default", "rules", "type_rules", "exclude", "min_ndim", "input",
             "output", "kv_cache", "act_rules", "dynamic_config", "nbits", "group_size", "axis", "skip_modules"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"recipe: unknown key(s) {unknown}; known: {sorted(known)}")
    hqq_keys = {"dynamic_config", "nbits", "group_size", "axis", "skip_modules"}
    native_keys = {"default", "rules", "type_rules", "exclude", "min_ndim", "input", "output", "kv_cache", "act_rules"}
    if "dynamic_config" in d or "nbits" in d:
        mixed = sorted(native_keys & set(d))
        if mixed:
            raise ValueError(f"recipe: {mixed} cannot be combined with the HqqConfig form (nbits/dynamic_config); "
                             "use one form or the other")
        steps = _steps(d, (Step("hqq"),))
        try:
            recipe = from_hqq_config(nbits=d.get("nbits", 4), group_size=d.get("group_size", 64), axis=d.get("axis", 1),
                                     dynamic_config=d.get("dynamic_config"),
                                     skip_modules=d.get("skip_modules", ("lm_head",)), steps=steps)
        except (TypeError, ValueError) as e:
            raise type(e)(f"recipe.{e}") from None
        return Preset(name, recipe, "HQQ-style config")
    stray = sorted((hqq_keys - {"dynamic_config", "nbits"}) & set(d))
    if stray:
        raise ValueError(f"recipe: {stray} belong to the HqqConfig form, which needs 'nbits' or 'dynamic_config'")
    steps = _steps(d, ())
    for key in ("rules", "type_rules", "act_rules"):
        if not isinstance(d.get(key, {}), Mapping):
            raise TypeError(f"recipe.{key} must be a table/object of pattern -> spec, got {type(d[key]).__name__}")
    pairs = lambda key: {k: _spec(v, f"recipe.{key}[{k!r}]") for k, v in dict(d.get(key, {})).items()}  # noqa: E731
    default, rules, type_rules = _spec(d.get("default"), "recipe.default"), pairs("rules"), pairs("type_rules")
    try:
        recipe = Recipe(default=default, rules=rules, type_rules=type_rules, exclude=d.get("exclude", DEFAULT_EXCLUDE),
                        min_ndim=d.get("min_ndim", 2), steps=steps, input=_spec(d.get("input"), "recipe.input"),
                        output=_spec(d.get("output"), "recipe.output"),
                        kv_cache=_spec(d.get("kv_cache"), "recipe.kv_cache"), act_rules=pairs("act_rules"))
    except (TypeError, ValueError) as e:  # Recipe names the field: "Recipe.exclude must ..."
        raise type(e)(f"recipe.{str(e).removeprefix('Recipe.')}") from None
    return Preset(name, recipe, "recipe file")

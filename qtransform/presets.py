"""Named recipes (in the spirit of Quark's templates) and HQQ-style configs.

A :class:`Preset` is a recipe for the linear layers of a model plus the calibration-free
algorithm that fits its parameters (``"rtn"``: round to nearest; ``"hqq"``) and that
algorithm's options. Presets name formats of the registry; a preset whose format is not
registered is not offered.

>>> import qtransform as qt
>>> p = qt.get_preset("hqq4-g64")
>>> p.algorithm, str(p.recipe.type_rules[0][1]), dict(p.options)
('hqq', 'uint4 g64 asym(float zp)', {'error_norm': 4.0, 'refine_scale': False})

The HQQ presets pick the solver options with the lowest perplexity on SmolLM2-135M
(bench/bench_hqq.py): iterates ranked by the 4-norm of the group error, and the scale refined
at 3 and 2 bits only.

``recipe_from_dict`` reads the recipe-file schema (JSON or TOML, parsed by the caller):
``{"algorithm": "hqq", "options": {"error_norm": 4}, "default": spec, "rules": {glob: spec | null},
"type_rules": {...}, "exclude": [...], "dynamic_config": {"self_attn.q_proj": {"nbits": 4,
"group_size": 64}}}`` where a spec is a ``QuantSpec.to_dict()`` dict or a preset name and
``options`` are keyword options of the algorithm.
"""

from __future__ import annotations

import types as _types
from typing import Any, Mapping, NamedTuple

from .formats import FORMATS
from .granularity import PerChannel, PerGroup
from .recipe import Recipe
from .spec import QuantSpec

__all__ = ["Preset", "presets", "get_preset", "hqq_spec", "from_hqq_config", "recipe_from_dict",
           "LINEAR_TYPES"]

#: Module types a preset quantizes (transformers' GPT-2 Conv1D is a linear layer too).
LINEAR_TYPES = ("Linear", "Conv1D")
_EXCLUDE = ("lm_head*",)


_NO_OPTIONS: Mapping[str, Any] = _types.MappingProxyType({})


class Preset(NamedTuple):
    name: str
    recipe: Recipe
    algorithm: str
    description: str
    options: Mapping[str, Any] = _NO_OPTIONS  # keyword options of the algorithm


def hqq_spec(nbits: int, group_size: int | None = 64, *, axis: int = 1) -> QuantSpec:
    """HQQ's scheme: unsigned ``nbits`` codes, float zero point, fp16 scale and zero, groups
    along in_features (``axis=1``, the kernels' layout) or down a column (``axis=0``)."""
    if axis not in (0, 1):
        raise ValueError(f"hqq axis must be 0 or 1, got {axis!r}")
    gran = PerChannel(0) if group_size is None else PerGroup(group_size, axis=-1 if axis == 1 else 0)
    return QuantSpec(format=f"uint{nbits}", granularity=gran, symmetric=False, zero_point_domain="float",
                     scale_dtype="float16")


def _linear_recipe(spec: QuantSpec) -> Recipe:
    return Recipe(type_rules={t: spec for t in LINEAR_TYPES}, exclude=_EXCLUDE)


#: Algorithm options of the presets that have some (see the module docstring).
_OPTIONS = {"hqq4-g64": {"error_norm": 4.0, "refine_scale": False}, "hqq3-g64": {"error_norm": 4.0},
            "hqq2-g16": {"error_norm": 4.0}}


def _table() -> list[tuple[str, str | None, Any, str, str]]:
    """(name, format needed, spec factory, algorithm, description)."""
    rows = []
    for g in (32, 64, 128):
        rows.append((f"int4-g{g}", "int4", lambda g=g: QuantSpec(format="int4", granularity=PerGroup(g)),
                     "rtn", f"int4 symmetric weight-only, group {g}"))
        rows.append((f"int4-g{g}-asym", "uint4",
                     lambda g=g: QuantSpec(format="uint4", granularity=PerGroup(g), symmetric=False),
                     "rtn", f"uint4 asymmetric (integer zero point) weight-only, group {g}"))
    rows += [
        ("int8-channel", "int8", lambda: QuantSpec(format="int8", granularity=PerChannel(0)), "rtn",
         "int8 symmetric weight-only, per output channel"),
        ("hqq4-g64", "uint4", lambda: hqq_spec(4, 64), "hqq", "HQQ 4-bit, group 64 (uint4, float zero point)"),
        ("hqq3-g64", "uint3", lambda: hqq_spec(3, 64), "hqq", "HQQ 3-bit, group 64"),
        ("hqq2-g16", "uint2", lambda: hqq_spec(2, 16), "hqq", "HQQ 2-bit, group 16"),
        ("fp8", "fp8_e4m3", lambda: QuantSpec(format="fp8_e4m3", granularity=PerChannel(0)), "rtn",
         "fp8 e4m3 weight-only, per output channel"),
        ("mxfp4", "mxfp4", lambda: QuantSpec(format="mxfp4"), "rtn", "OCP MXFP4 (e2m1, block 32, E8M0 scales)"),
        ("mxfp6", "mxfp6_e2m3", lambda: QuantSpec(format="mxfp6_e2m3"), "rtn", "OCP MXFP6 e2m3 (block 32)"),
        ("mxfp8", "mxfp8_e4m3", lambda: QuantSpec(format="mxfp8_e4m3"), "rtn", "OCP MXFP8 e4m3 (block 32)"),
        ("nvfp4", "nvfp4", lambda: QuantSpec(format="nvfp4"), "rtn",
         "NVFP4 (e2m1, block 16, fp8 block scales, fp32 tensor scale)"),
        ("mx6", "mx6", lambda: QuantSpec(format="mx6"), "rtn", "MX6 (shared micro-exponents, 6 bits/weight)"),
        ("mx9", "mx9", lambda: QuantSpec(format="mx9"), "rtn", "MX9 (shared micro-exponents, 9 bits/weight)"),
        ("bfp16", "bfp16", lambda: QuantSpec(format="bfp16"), "rtn", "block floating point, block 8, int8 codes"),
    ]
    return rows


def presets() -> dict[str, Preset]:
    """Every preset whose format is registered, by name."""
    return {name: Preset(name, _linear_recipe(make()), algo, desc, _types.MappingProxyType(_OPTIONS.get(name, {})))
            for name, fmt, make, algo, desc in _table() if fmt in FORMATS}


def get_preset(name: str) -> Preset:
    table = presets()
    if name not in table:
        raise ValueError(f"unknown recipe {name!r}; presets: {', '.join(table)}")
    return table[name]


def _tag_glob(tag: str) -> str:
    return f"*.{tag}.weight" if not tag.startswith("*") else f"{tag}.weight"


def from_hqq_config(*, nbits: int = 4, group_size: int | None = 64, axis: int = 1,
                    dynamic_config: Mapping[str, Mapping] | None = None,
                    skip_modules=("lm_head",)) -> Recipe:
    """A recipe equivalent to transformers' ``HqqConfig``.

    ``dynamic_config`` is keyed by module tags without ``model``, ``layers`` and indices
    (``"self_attn.q_proj"``), each with ``nbits``/``group_size``/``axis``; tags become globs
    ``*.self_attn.q_proj.weight``. Without a dynamic config every linear layer uses
    ``nbits``/``group_size``/``axis``; with one, only the tagged layers are quantized (as in
    transformers).
    """
    rules = {}
    for tag, cfg in (dynamic_config or {}).items():
        if not isinstance(cfg, Mapping):
            raise TypeError(f"dynamic_config[{tag!r}] must be a dict of nbits/group_size/axis")
        unknown = sorted(set(cfg) - {"nbits", "group_size", "axis", "quant_zero", "quant_scale",
                                     "offload_meta", "view_as_float"})
        if unknown:
            raise ValueError(f"dynamic_config[{tag!r}]: unknown key(s) {unknown}")
        rules[_tag_glob(tag)] = hqq_spec(int(cfg.get("nbits", nbits)), cfg.get("group_size", group_size),
                                         axis=int(cfg.get("axis", axis)))
    exclude = tuple(f"{m}*" if m == "lm_head" else _tag_glob(m) for m in (skip_modules or ()))
    type_rules = {} if rules else {t: hqq_spec(nbits, group_size, axis=axis) for t in LINEAR_TYPES}
    return Recipe(rules=rules, type_rules=type_rules, exclude=exclude)


def _spec(value, where: str) -> QuantSpec | None:
    if value is None:
        return None
    if isinstance(value, str):
        return get_preset(value).recipe.type_rules[0][1]
    if isinstance(value, Mapping):
        try:
            return QuantSpec.from_dict(dict(value))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
    raise TypeError(f"{where}: expected a spec dict, a preset name or null, got {type(value).__name__}")


def _check_options(algorithm: str, options) -> Mapping[str, Any]:
    from .algorithms.registry import check_algorithm_options

    check_algorithm_options(algorithm, options, path="recipe.options")
    return _types.MappingProxyType(dict(options))


def recipe_from_dict(d: Mapping, *, name: str = "recipe") -> Preset:
    """A :class:`Preset` (recipe, algorithm, options) from the recipe-file schema (see the module
    docstring); ``name`` labels it.

    >>> p = recipe_from_dict({"algorithm": "hqq", "options": {"error_norm": 4}, "default": "hqq3-g64"})
    >>> p.algorithm, dict(p.options), str(p.recipe.default)
    ('hqq', {'error_norm': 4}, 'uint3 g64 asym(float zp)')
    """
    if not isinstance(d, Mapping):
        raise TypeError(f"a recipe file must hold a table/object, got {type(d).__name__}")
    known = {"algorithm", "options", "default", "rules", "type_rules", "exclude", "min_ndim", "dynamic_config",
             "nbits", "group_size", "axis", "skip_modules"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"recipe: unknown key(s) {unknown}; known: {sorted(known)}")
    algorithm = d.get("algorithm", "rtn")  # any registered algorithm; checked with its options below
    if "dynamic_config" in d or "nbits" in d:
        hqq = from_hqq_config(nbits=d.get("nbits", 4), group_size=d.get("group_size", 64), axis=d.get("axis", 1),
                              dynamic_config=d.get("dynamic_config"),
                              skip_modules=d.get("skip_modules", ("lm_head",)))
        algorithm = d.get("algorithm", "hqq")
        return Preset(name, hqq, algorithm, "HQQ-style config", _check_options(algorithm, d.get("options", {})))
    pairs = lambda key: {k: _spec(v, f"recipe.{key}[{k!r}]") for k, v in dict(d.get(key, {})).items()}  # noqa: E731
    recipe = Recipe(default=_spec(d.get("default"), "recipe.default"), rules=pairs("rules"),
                    type_rules=pairs("type_rules"), exclude=d.get("exclude", _EXCLUDE),
                    min_ndim=d.get("min_ndim", 2))
    return Preset(name, recipe, algorithm, "recipe file", _check_options(algorithm, d.get("options", {})))

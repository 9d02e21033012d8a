"""The versioned ``quantization_config`` of qtransform checkpoints (JSON, no tensors).

Version 2::

    {"quant_method": "qtransform", "version": 2, "qtransform_version": "0.3.0", "layout": "native",
     "specs": [<QuantSpec.to_dict()>, ...],
     "tensors": {"model.layers.0.mlp.up_proj.weight": {"spec": 0, "shape": [1536, 576], "dtype": "float32"}},
     "recipe": <Recipe.to_dict(), steps included> | null, "recipe_name": "hqq4-g64",
     "rules": {path: rule}, "aliases": {path: path}, "skip_modules": [...] | null,
     "carried": [name, ...]}  (the input's tensors its model does not load, written as stored; optional)

Version 3 is version 2 with activation quantizers, written only when a model has some (older
readers refuse it rather than drop them)::

     "activations": {"model.layers.0.mlp.up_proj:input": <spec index>, ...}

a spec with ``dynamic: true`` is fitted at run time; a static one's parameters are the module's
stored tensors ``<module>.input_scale`` (``input_zero_point``...; ``output_...`` for outputs).

Version 4 adds the online rotations a rotated model applies at run time (QuaRot's ``R4`` before
the down projections, ``R3`` on queries and keys), written only when a model has some (older
readers refuse it rather than run the rotated weights without them)::

     "online": {"model.layers.0.mlp.down_proj:input": {"kind": "hadamard", "size": 1536}, ...}

Version 5 adds the step outputs a model carries beside its quantized tensors (:mod:`bridge.step_outputs`), each
kind's record under its name, written only when a model has some (older readers refuse it rather than drop
them). Today the low-rank corrections quantized linears run (the ``lowrank`` step): their ranks, the tensors
``<module>.lowrank_a`` ``(rank, in)`` and ``<module>.lowrank_b`` ``(out, rank)`` stored in the dtype of
the module's weight entry::

     "lowrank": {"model.layers.0.mlp.down_proj": 32, ...}

``tensors`` lists every quantized tensor: its spec (an index into ``specs``), logical shape and
dequantized dtype; with the layout (:mod:`bridge.checkpoint.layout`) this fixes the exact names,
shapes and dtypes of its stored parts. Specs hold what decoding needs only.

Version 1 (qtransform 0.1) stored calibration choices in every spec (``observer``,
``percentile``, ``histogram_bins``) and the algorithm apart from the recipe (``algorithm``,
``algorithm_options``); :func:`decode` reads it by upgrading it to version 2: the choices leave the
specs (decoding never needed them), the algorithm becomes the recipe's step, and round to nearest
keeps the observer as its option when every spec of the recipe chose the same one.

>>> import torch, qtransform as qt
>>> spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))
>>> d = encode({"fc.weight": Entry(spec, (8, 64), torch.float32)})
>>> d["version"], d["tensors"]
(2, {'fc.weight': {'spec': 0, 'shape': [8, 64], 'dtype': 'float32'}})
>>> decode(d).entries["fc.weight"] == Entry(spec, (8, 64), torch.float32)
True
"""

from __future__ import annotations

import copy
import json
import types
from typing import Mapping, NamedTuple

import torch

import qtransform as qt

from ..step_outputs import SLOTS, VERSION_OUTPUTS
from .layout import LAYOUTS, dtype_from_name, dtype_name

__all__ = ["VERSION", "VERSION_ACTIVATIONS", "VERSION_ONLINE", "VERSION_OUTPUTS", "READABLE", "QUANT_METHOD", "Entry", "Metadata", "CheckpointError", "encode", "decode", "checkpoint_config",
           "entries_of", "upgrade"]

VERSION = 2
#: The version of checkpoints with activation quantizers.
VERSION_ACTIVATIONS = 3
#: The version of checkpoints with online rotations.
VERSION_ONLINE = 4
# VERSION_OUTPUTS (5): checkpoints with step outputs (low-rank corrections), :mod:`bridge.step_outputs`'s.
READABLE = (1, 2, 3, 4, 5)
QUANT_METHOD = "qtransform"
_EMPTY: Mapping[str, str] = types.MappingProxyType({})


class CheckpointError(ValueError):
    """A checkpoint file or its metadata is malformed, incomplete or does not fit the model."""


class Entry(NamedTuple):
    """Static description of one quantized tensor."""

    spec: qt.QuantSpec
    shape: tuple[int, ...]
    dtype: torch.dtype


class Metadata(NamedTuple):
    """A decoded ``quantization_config``."""

    entries: dict[str, Entry]
    layout: str = "native"
    recipe: qt.Recipe | None = None
    recipe_name: str | None = None
    rules: Mapping[str, str] = _EMPTY
    aliases: Mapping[str, str] = _EMPTY
    skip_modules: list[str] | None = None
    version: int = VERSION
    activations: Mapping[qt.Site, qt.QuantSpec] = _EMPTY
    online: Mapping[qt.Site, qt.OnlineRotation] = _EMPTY
    outputs: Mapping[str, Mapping] = _EMPTY  # {kind: record} of the step outputs (bridge.step_outputs.SLOTS)
    carried: tuple = ()  # the input's tensors its model does not load, written as stored (bridge.stream.inventory)


def entries_of(quantized: Mapping) -> dict[str, Entry]:
    """``{path: Entry}`` from ``{path: QTensor}``."""
    return {p: Entry(q.spec, tuple(q.shape), q.dtype) for p, q in quantized.items()}


def encode(entries: Mapping[str, Entry], *, layout: str = "native", recipe: qt.Recipe | None = None,
           recipe_name: str | None = None, rules: Mapping[str, str] | None = None,
           aliases: Mapping[str, str] | None = None, skip_modules=None,
           activations: Mapping[qt.Site, qt.QuantSpec] | None = None,
           online: Mapping[qt.Site, qt.OnlineRotation] | None = None, outputs: Mapping[str, Mapping] | None = None,
           carried=()) -> dict:
    """JSON-able ``quantization_config``: version 2, 3 with ``activations``, 4 with ``online`` rotations,
    5 (a kind's ``version``) with step ``outputs`` (``{kind: record}``, each under its kind's name, in the order
    the kinds were registered; absent optional fields are left out)."""
    specs: list[qt.QuantSpec] = []
    index: dict[qt.QuantSpec, int] = {}

    def spec_index(spec):
        if spec not in index:
            index[spec] = len(specs)
            specs.append(spec)
        return index[spec]

    tensors = {path: {"spec": spec_index(e.spec), "shape": [int(n) for n in e.shape], "dtype": dtype_name(e.dtype)}
               for path, e in entries.items()}
    acts = {f"{site.module}:{site.role}": spec_index(spec) for site, spec in (activations or {}).items()}
    rotations = {f"{site.module}:{site.role}": rot.to_dict() for site, rot in (online or {}).items()}
    recorded = {name: dict(outputs[name]) for name in SLOTS if (outputs or {}).get(name)}
    unknown = sorted(set(k for k, v in (outputs or {}).items() if v) - set(recorded))
    if unknown:
        raise ValueError(f"encode: outputs of kinds without a registered slot: {unknown}; known: {list(SLOTS)}")
    version = max([VERSION_ONLINE if rotations else VERSION_ACTIVATIONS if acts else VERSION,
                   *(SLOTS[name].version for name in recorded)])
    d = {"quant_method": QUANT_METHOD, "version": version,
         "qtransform_version": qt.__version__, "layout": layout,
         "specs": [s.to_dict() for s in specs], "tensors": tensors,
         "recipe": None if recipe is None else recipe.to_dict(), "skip_modules": skip_modules}
    if acts:
        d["activations"] = acts
    if rotations:
        d["online"] = rotations
    d.update(recorded)
    for key, value in (("recipe_name", recipe_name), ("rules", dict(rules or {})), ("aliases", dict(aliases or {})),
                       ("carried", sorted(carried or ()))):
        if value:
            d[key] = value
    return d


def checkpoint_config(quantized: Mapping, *, recipe: qt.Recipe | None = None, recipe_name: str | None = None,
                        rules: Mapping[str, str] | None = None, aliases: Mapping[str, str] | None = None,
                        skip_modules=None, activations: Mapping | None = None, online: Mapping | None = None,
                        outputs: Mapping[str, Mapping] | None = None, carried=(),
                        where: str = "quantization_config") -> dict:
    """The ``quantization_config`` a qtransform checkpoint records for its ``quantized`` tensors (``{path:
    QTensor}``), whichever driver wrote it: :func:`encode` of their entries, the activation quantizers as their
    specs (``{Site: QuantSpec | QParams}``), checked to read back (:class:`CheckpointError` naming ``where``)
    before anything is written."""
    specs = {s: q if isinstance(q, qt.QuantSpec) else q.spec for s, q in (activations or {}).items()}
    d = encode(entries_of(quantized), layout="native", recipe=recipe, recipe_name=recipe_name, rules=rules,
               aliases=aliases, skip_modules=skip_modules, activations=specs or None, online=dict(online or {}) or None,
               outputs=outputs, carried=carried)
    decode(d, where=where)
    return d


def _fail(where: str, msg: str):
    raise CheckpointError(f"{where}: quantization_config {msg}")


def _strip_calibration(spec: dict) -> dict:
    return {k: v for k, v in spec.items() if k not in qt.spec.CALIBRATION_FIELDS} if isinstance(spec, dict) else spec


def _observer(spec) -> str | None:
    """A version-1 spec's calibration choice as an ``rtn`` observer option (JSON), ``None`` for minmax."""
    if not isinstance(spec, dict) or spec.get("observer", "minmax") == "minmax":
        return None
    option = {"name": spec["observer"]}
    if "histogram_bins" in spec:
        option["bins"] = spec["histogram_bins"]
    if spec["observer"] == "percentile" and "percentile" in spec:
        option["percentile"] = spec["percentile"]
    return json.dumps(option, sort_keys=True)


def _v1_steps(recipe: dict, algorithm, options) -> list | None:
    """The version-1 algorithm as the recipe's steps; round to nearest keeps its observer when every
    quantized spec of the recipe chose the same one."""
    if algorithm not in (None, "rtn"):
        return [{"name": algorithm, "options": dict(options)}]
    specs = [recipe.get("default")] + [v for key in ("rules", "type_rules") if isinstance(recipe.get(key), list)
                                       for _, v in recipe[key]]
    chosen = {_observer(s) for s in specs if s is not None}
    if len(chosen) == 1 and None not in chosen:
        return [{"name": "rtn", "options": {**dict(options), "observer": json.loads(chosen.pop())}}]
    return [{"name": "rtn", "options": dict(options)}] if options else None


def upgrade(d: Mapping) -> dict:
    """A version-1 ``quantization_config`` as version 2 (a new dict; version 2 passes through)."""
    d = copy.deepcopy(dict(d))
    if d.get("version") != 1:
        return d
    d["specs"] = [_strip_calibration(s) for s in d.get("specs", [])] if isinstance(d.get("specs"), list) else d.get("specs")
    algorithm, options = d.pop("algorithm", None), d.pop("algorithm_options", None) or {}
    recipe = d.get("recipe")
    if isinstance(recipe, dict):
        steps = _v1_steps(recipe, algorithm, options)
        if recipe.get("default") is not None:
            recipe["default"] = _strip_calibration(recipe["default"])
        for key in ("rules", "type_rules"):
            if isinstance(recipe.get(key), list):
                recipe[key] = [[k, None if v is None else _strip_calibration(v)] for k, v in recipe[key]]
        if steps:
            recipe["steps"] = steps
    d["version"], d["layout"] = VERSION, "native"
    return d


def decode(d, *, where: str = "quantization_config") -> Metadata:
    """Validate a ``quantization_config`` dict (version 1 or 2) and return its :class:`Metadata`.

    Raises :class:`CheckpointError` naming ``where`` for anything malformed: a wrong
    ``quant_method``, a missing or unknown ``version`` or layout, specs naming unknown formats,
    bad shapes or recipes.
    """
    if not isinstance(d, Mapping):
        _fail(where, f"must be a JSON object, got {type(d).__name__}")
    if d.get("quant_method") != QUANT_METHOD:
        _fail(where, f"has quant_method {d.get('quant_method')!r}, expected {QUANT_METHOD!r}")
    version = d.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        _fail(where, f"has no integer 'version' (got {version!r})")
    if version not in READABLE:
        _fail(where, f"has version {version}; this qtransform reads versions {list(READABLE)} (upgrade qtransform)")
    d = upgrade(d)
    layout = d.get("layout", "native")
    if layout not in LAYOUTS:
        _fail(where, f"has layout {layout!r}; known: {sorted(LAYOUTS)}")
    specs_raw, tensors = d.get("specs", []), d.get("tensors", {})
    if not isinstance(specs_raw, list) or not isinstance(tensors, Mapping):
        _fail(where, "needs 'specs' as a list and 'tensors' as an object")
    specs = []
    for i, s in enumerate(specs_raw):
        try:
            specs.append(qt.QuantSpec.from_dict(s))
        except (TypeError, ValueError) as e:
            _fail(where, f"specs[{i}] is not a valid QuantSpec: {e}")
    entries = {}
    for path, t in tensors.items():
        try:
            index, raw_shape = t["spec"], t["shape"]
            if not isinstance(index, int) or isinstance(index, bool) or index < 0:
                raise IndexError(f"spec index {index!r} is not an index of 'specs'")
            if not isinstance(raw_shape, list) or not all(isinstance(n, int) and not isinstance(n, bool)
                                                          for n in raw_shape):
                raise TypeError(f"shape {raw_shape!r} is not a list of ints")
            spec = specs[index]
            shape = tuple(raw_shape)
            dtype = dtype_from_name(t["dtype"])
        except (KeyError, TypeError, IndexError, ValueError) as e:
            _fail(where, f"entry for tensor {path!r} is malformed ({type(e).__name__}: {e}); expected "
                         "{'spec': <index>, 'shape': [...], 'dtype': '<name>'}")
        if not dtype.is_floating_point or any(n < 1 for n in shape):
            _fail(where, f"entry for tensor {path!r} has shape {list(shape)} / dtype {t['dtype']!r}")
        entries[path] = Entry(spec, shape, dtype)
    recipe = None
    if d.get("recipe") is not None:
        try:
            recipe = qt.Recipe.from_dict(d["recipe"])
        except (TypeError, ValueError) as e:
            _fail(where, f"'recipe' is not a valid recipe: {e}")
    aliases, rules = d.get("aliases") or {}, d.get("rules") or {}
    for key, value in (("aliases", aliases), ("rules", rules)):
        if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            _fail(where, f"'{key}' must be an object of path -> string")
    skip = d.get("skip_modules")
    if skip is not None and (not isinstance(skip, list) or not all(isinstance(m, str) for m in skip)):
        _fail(where, "'skip_modules' must be a list of module names or null")
    name = d.get("recipe_name")
    if name is not None and not isinstance(name, str):
        _fail(where, f"'recipe_name' must be a string, got {type(name).__name__}")
    carried = d.get("carried") or []
    if not isinstance(carried, list) or not all(isinstance(n, str) for n in carried):
        _fail(where, "'carried' must be a list of tensor names")
    return Metadata(entries=entries, layout=layout, recipe=recipe, recipe_name=name,
                    rules=dict(rules), aliases=dict(aliases), skip_modules=skip, version=version,
                    activations=_activations(d.get("activations"), specs, where),
                    online=_online(d.get("online"), where), outputs=_outputs(d, entries, where), carried=tuple(carried))


def _sites(raw, field: str, roles, what: str, where: str, value) -> dict:
    """``{Site: value(key, entry)}`` from the object ``field`` of ``'<module>:<role>'`` keys (roles ``roles``)."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        _fail(where, f"'{field}' must be an object of '<module>:<role>' -> {what}, got {type(raw).__name__}")
    out = {}
    for key, entry in raw.items():
        module, _, role = key.rpartition(":")
        if role not in roles or not module:
            _fail(where, f"'{field}' key {key!r} is not '<module>:<role>' with role in {list(roles)}")
        out[qt.Site(module, role)] = value(key, entry)
    return out


def _activations(raw, specs: list, where: str) -> dict:
    def spec(key, index):
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(specs):
            _fail(where, f"'activations' entry {key!r}: {index!r} is not an index of 'specs'")
        return specs[index]
    return _sites(raw, "activations", qt.spec.SITE_ROLES, "spec index", where, spec)


def _online(raw, where: str) -> dict:
    def rotation(key, entry):
        try:
            return qt.OnlineRotation.from_value(entry, where=f"'online' entry {key!r}")
        except (TypeError, ValueError) as e:
            _fail(where, str(e))
    return _sites(raw, "online", qt.rotation.ONLINE_ROLES, "rotation", where, rotation)


def _outputs(d: Mapping, entries: Mapping[str, Entry], where: str) -> dict:
    """``{kind: record}`` of the registered kinds of step output the config records, each checked by its slot."""
    out = {}
    for name, slot in SLOTS.items():
        if d.get(name) is not None:
            try:
                out[name] = slot.check_record(d[name], entries)
            except (TypeError, ValueError) as e:
                _fail(where, str(e))
    return out

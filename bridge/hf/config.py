"""``QTransformConfig``: transformers' quantization config for ``quant_method: "qtransform"``.

It serves both directions:

* quantize-on-load: ``QTransformConfig(recipe=...)`` with the recipe's steps (calibration-free,
  one tensor at a time: ``rtn``, ``hqq``, or a local algorithm of yours), ``skip_modules``;
* loading a checkpoint: transformers builds it from ``config.json``'s ``quantization_config``
  (the versioned metadata of :mod:`bridge.checkpoint.metadata`, versions 1 and 2).

``algorithm=``/``algorithm_options=`` are shorthand for a recipe with one step (qtransform 0.1).

>>> import qtransform as qt
>>> cfg = QTransformConfig(recipe=qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)), algorithm="hqq")
>>> d = cfg.to_dict()
>>> d["quant_method"], d["version"], d["recipe"]["default"]["format"], d["recipe"]["steps"]
('qtransform', 2, 'int4', [{'name': 'hqq', 'options': {}}])
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

import qtransform as qt

from ..checkpoint import metadata
from ..checkpoint.metadata import Entry
from ..step_outputs import SLOTS

__all__ = ["QTransformConfig"]

_SAVED = ("quant_method", "version", "qtransform_version", "layout", "specs", "tensors", "aliases", "recipe_name",
          "rules", "skip_modules", "recipe", "algorithm", "algorithm_options", "activations",
          "online", "carried")  # and each registered kind of step output's record (bridge.step_outputs.SLOTS)


def _as_recipe(recipe) -> qt.Recipe | None:
    if recipe is None or isinstance(recipe, qt.Recipe):
        return recipe
    if isinstance(recipe, qt.QuantSpec):
        return qt.Recipe(default=recipe)
    if isinstance(recipe, dict):
        if "format" in recipe:  # the dict form of a QuantSpec
            return qt.Recipe(default=qt.QuantSpec.from_dict(recipe))
        return qt.Recipe.from_dict(recipe)
    raise TypeError(f"QTransformConfig: recipe must be a Recipe, QuantSpec, dict or None, got {type(recipe).__name__}")


class QTransformConfig(QuantizationConfigMixin):
    """transformers quantization config for qtransform checkpoints and quantize-on-load.

    Args:
        recipe: ``Recipe``, ``QuantSpec`` or their dict form: what to quantize on load, and its steps.
        steps: replaces the recipe's steps (names, :class:`~qtransform.Step` objects or dicts).
        algorithm, algorithm_options: shorthand for ``steps=[Step(algorithm, **algorithm_options)]``.
        skip_modules: module names kept in full precision (``None``: transformers' defaults: the
            output embeddings, tied weights and the last module; ``[]`` quantizes every supported module).
        verify: when loading a checkpoint, check every tensor against the checksum written with it
            (default). ``from_pretrained(path, quantization_config=QTransformConfig(verify=False))``
            skips that for speed; the headers are checked either way. Not saved.
        **saved: the fields of a saved checkpoint's ``quantization_config`` (``version``, ``specs``,
            ``tensors``, ``aliases``, ``recipe_name``, ``rules``, ``layout``...), read with
            :func:`bridge.checkpoint.metadata.decode` (versions 1 and 2).
    """

    def __init__(self, recipe=None, *, steps=None, algorithm: str | None = None, algorithm_options: dict | None = None,
                 skip_modules: list[str] | None = None, verify: bool = True, **saved):
        unknown = sorted(set(saved) - set(_SAVED) - set(SLOTS))
        if unknown:
            raise ValueError(f"QTransformConfig: unknown field(s) {unknown}")
        self.quant_method = metadata.QUANT_METHOD
        if "version" in saved:  # a checkpoint's quantization_config
            meta = metadata.decode({**saved, "recipe": recipe, "skip_modules": skip_modules,
                                    **({"algorithm": algorithm} if algorithm is not None else {}),
                                    **({"algorithm_options": algorithm_options} if algorithm_options else {})},
                                   where="config.json")
            recipe, skip_modules = meta.recipe, meta.skip_modules
            algorithm = algorithm_options = None  # version 1's algorithm is the decoded recipe's step
            self.entries, self.aliases, self.rules = meta.entries, dict(meta.aliases), dict(meta.rules)
            self.recipe_name, self.layout = meta.recipe_name, meta.layout
            self.activations = dict(meta.activations)
            self.online = dict(meta.online)
            self.outputs = dict(meta.outputs)  # {kind: record} of the step outputs (low-rank corrections' ranks)
            self.carried = tuple(meta.carried)  # the input's tensors its model does not load, kept as stored
        else:
            stray = sorted(set(saved) - {"quant_method"})
            if stray:
                raise ValueError(f"QTransformConfig: {stray} describe a saved checkpoint and come with its 'version'; "
                                 "to quantize on load give recipe=, steps= and skip_modules=")
            if saved.get("quant_method", metadata.QUANT_METHOD) != metadata.QUANT_METHOD:
                raise ValueError(f"QTransformConfig: quant_method must be {metadata.QUANT_METHOD!r}, got "
                                 f"{saved['quant_method']!r}")
            self.entries: dict[str, Entry] = {}
            self.aliases, self.rules, self.recipe_name, self.layout = {}, {}, None, "native"
            self.activations: dict = {}
            self.online: dict = {}
            self.outputs: dict = {}
            self.carried: tuple = ()
        recipe = _as_recipe(recipe)
        if algorithm_options is not None and not isinstance(algorithm_options, dict):
            raise TypeError(f"QTransformConfig: algorithm_options must be a dict, got {type(algorithm_options).__name__}")
        if algorithm is not None or algorithm_options:
            if steps is not None:
                raise ValueError("QTransformConfig: give steps or algorithm/algorithm_options, not both")
            steps = [qt.Step(algorithm or "rtn", **(algorithm_options or {}))]
        if steps is not None:
            if recipe is None:
                raise ValueError("QTransformConfig: steps need a recipe (what to quantize)")
            recipe = dataclasses.replace(recipe, steps=steps)
        if recipe is not None and "version" not in saved:  # a saved recipe is provenance: loading never runs it
            qt.check_steps(recipe.steps, where="QTransformConfig.recipe.steps")  # names and options, now
        if skip_modules is not None and (isinstance(skip_modules, str) or not isinstance(skip_modules, (list, tuple))
                                         or not all(isinstance(m, str) for m in skip_modules)):
            raise TypeError(f"QTransformConfig: skip_modules must be a list of module names or None, got "
                            f"{skip_modules!r}")
        if not isinstance(verify, bool):
            raise TypeError(f"QTransformConfig: verify must be True or False, got {verify!r}")
        self.verify = verify
        self.recipe = recipe
        self.skip_modules = None if skip_modules is None else list(skip_modules)

    def to_dict(self) -> dict[str, Any]:
        return metadata.encode(self.entries, layout=self.layout, recipe=self.recipe, recipe_name=self.recipe_name,
                               rules=self.rules, aliases=self.aliases, skip_modules=self.skip_modules,
                               activations=self.activations, online=self.online, outputs=self.outputs,
                               carried=self.carried)

    def get_loading_attributes(self) -> dict[str, Any]:
        """What a config passed to ``from_pretrained`` changes in a checkpoint's own (transformers' protocol)."""
        return {"verify": self.verify}

    def to_diff_dict(self) -> dict[str, Any]:
        return self.to_dict()

    def __iter__(self):
        yield from self.to_dict().items()

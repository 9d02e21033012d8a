"""transformers integration: ``quant_method: "qtransform"``.

Importing :mod:`bridge` registers :class:`QTransformConfig` and :class:`QTransformHfQuantizer`
with transformers, so that

1. ``AutoModelForCausalLM.from_pretrained(saved_dir)`` loads a checkpoint written by
   :func:`bridge.save` (or ``save_pretrained`` of a quantized model): the float modules are
   replaced by quantized skeletons on ``meta`` *before* the weights load, and the packed
   codes and scales load straight into them (nothing is dequantized);
2. ``from_pretrained(path, quantization_config=QTransformConfig(recipe=...))`` quantizes
   each weight as it is read (calibration-free: ``algorithm="rtn"`` round-to-nearest,
   ``"hqq"``, or any algorithm added with :func:`qtransform.algorithms.register_algorithm`);
3. ``generate()`` works on the result, and ``save_pretrained`` writes it back.

``skip_modules`` works like transformers' other quantizers: ``None`` (default) keeps the
output embeddings, tied weights and the last module in full precision; a list names
modules to keep (``[]`` quantizes every supported module the recipe selects).

>>> import qtransform as qt
>>> cfg = QTransformConfig(recipe=qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)))
>>> cfg.to_dict()["quant_method"], cfg.to_dict()["recipe"]["default"]["format"]
('qtransform', 'int4')
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import auto as hf_auto
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizers_utils import should_convert_module
from transformers.utils.quantization_config import QuantizationConfigMixin

import qtransform as qt
from qtransform.algorithms import check_algorithm_options, get_algorithm

from . import metadata
from .metadata import CheckpointError, Entry
from .modules import QModule
from .qstate import abstract_qtensor, check_like, named_tensors
from .rebuild import _submodule

__all__ = ["QTransformConfig", "QTransformHfQuantizer", "attach_config", "register"]

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
        recipe: ``Recipe``, ``QuantSpec`` or their dict form; what to quantize on load.
        algorithm: calibration-free weight algorithm of :mod:`qtransform.algorithms` (``"rtn"``, ``"hqq"``).
        algorithm_options: keyword options of the algorithm (e.g. a preset's ``options``).
        skip_modules: module names kept in full precision (``None``: transformers' defaults).
        aliases: ``{path: path}`` of tensors stored once for two tied names (checkpoints).
        recipe_name: the preset or recipe file a checkpoint was made with (informational).
        rules: ``{path: rule}``, the recipe rule that chose each quantized tensor's spec.
        tensors, specs, version: the per-tensor description of a saved checkpoint
            (:mod:`bridge.metadata`); filled in by saving and by quantize-on-load.
    """

    def __init__(self, recipe=None, *, algorithm: str = "rtn", skip_modules: list[str] | None = None,
                 tensors: dict | None = None, specs: list | None = None, version: int = metadata.VERSION,
                 quant_method: str = metadata.QUANT_METHOD, qtransform_version: str | None = None,
                 aliases: dict | None = None, recipe_name: str | None = None, rules: dict | None = None,
                 algorithm_options: dict | None = None, **kwargs):
        if kwargs:
            raise ValueError(f"QTransformConfig: unknown field(s) {sorted(kwargs)}")
        self.quant_method = metadata.QUANT_METHOD
        self.recipe = _as_recipe(recipe)
        self.algorithm = algorithm
        if algorithm_options is not None and not isinstance(algorithm_options, dict):
            raise TypeError(f"QTransformConfig: algorithm_options must be a dict, got {type(algorithm_options).__name__}")
        self.algorithm_options = dict(algorithm_options or {})
        self.skip_modules = None if skip_modules is None else list(skip_modules)
        self.aliases = dict(aliases or {})
        self.recipe_name = recipe_name
        self.rules = dict(rules or {})
        self.entries: dict[str, Entry] = {}
        if tensors:
            self.entries = metadata.decode({"quant_method": quant_method, "version": version,
                                            "specs": specs or [], "tensors": tensors}, where="config.json")

    def to_dict(self) -> dict[str, Any]:
        return metadata.encode(self.entries, recipe=None if self.recipe is None else self.recipe.to_dict(),
                               algorithm=self.algorithm, skip_modules=self.skip_modules,
                               **({"algorithm_options": self.algorithm_options} if self.algorithm_options else {}),
                               **({"aliases": self.aliases} if self.aliases else {}),
                               **({"recipe_name": self.recipe_name} if self.recipe_name else {}),
                               **({"rules": self.rules} if self.rules else {}))

    def to_diff_dict(self) -> dict[str, Any]:
        return self.to_dict()

    def __iter__(self):
        yield from self.to_dict().items()


def _untie(model: nn.Module, paths) -> None:
    """Drop transformers' weight-tying entries that involve a quantized weight."""
    tied = getattr(model, "all_tied_weights_keys", None)
    if tied:
        for k, v in list(tied.items()):
            if k in paths or v in paths:
                tied.pop(k)


class QTransformHfQuantizer(HfQuantizer):
    """Loads qtransform checkpoints and quantizes on load (see module docstring)."""

    requires_calibration = False
    quantization_config: QTransformConfig

    def _process_model_before_weight_loading(self, model, dtype=None, **kwargs):
        from .rebuild import _replace, plan

        cfg = self.quantization_config
        if not self.pre_quantized:
            if cfg.recipe is None:
                raise ValueError("QTransformConfig: quantize-on-load needs a recipe (a Recipe or QuantSpec)")
            check_algorithm_options(cfg.algorithm, cfg.algorithm_options)  # fail before loading anything
            skip = self.get_modules_to_not_convert(model, cfg.skip_modules, getattr(model, "_keep_in_fp32_modules", None))
            cfg.entries = {}
            for path, match in plan(model, cfg.recipe).items():
                if match.spec is None or not should_convert_module(path.rpartition(".")[0], skip):
                    continue
                w = _submodule(model, path)[0].weight
                cfg.entries[path] = Entry(match.spec, tuple(w.shape), w.dtype)
        if not cfg.entries:
            raise ValueError("QTransformConfig: no module to quantize (empty recipe match or empty checkpoint config)")
        for path, e in cfg.entries.items():
            try:
                module = _submodule(model, path)[0]
            except AttributeError:
                raise CheckpointError(f"config.json: quantized tensor {path!r} names no module of "
                                      f"{type(model).__name__}") from None
            if not isinstance(module, QModule) and tuple(module.weight.shape) != e.shape:
                raise CheckpointError(f"config.json: quantized tensor {path!r} has shape {list(e.shape)}, "
                                      f"the model's is {list(module.weight.shape)}")
            _replace(model, path, abstract_qtensor(e.shape, e.dtype, e.spec), "auto")
            if dtype is not None:
                _submodule(model, path)[0].compute_dtype = dtype
        _untie(model, set(cfg.entries))

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        return not self.pre_quantized and param_name in self.quantization_config.entries

    def get_quantize_ops(self):
        return _QuantizeOnLoad(self)

    def _process_model_after_weight_loading(self, model, **kwargs):
        for path, e in self.quantization_config.entries.items():
            module = _submodule(model, path)[0]
            q = module.qweight
            bad = [n for n in module._qnames if module._buffers[n].is_meta]
            if bad:
                raise CheckpointError(f"checkpoint: quantized tensor(s) {[path.rpartition('.')[0] + '.' + n for n in bad]} "
                                      "are missing")
            check_like(path, q, abstract_qtensor(e.shape, e.dtype, e.spec), where="checkpoint")
            module._cache = None
        return model

    def is_serializable(self):
        return True

    @property
    def is_trainable(self) -> bool:
        return False


class _QuantizeOnLoad(ConversionOps):
    """Float weight -> ``{path: codes, path_scale: ..., ...}`` as the checkpoint is read."""

    def __init__(self, quantizer: QTransformHfQuantizer):
        self.quantizer = quantizer

    def convert(self, input_dict, source_patterns=None, target_patterns=None, full_layer_name=None, **kwargs):
        cfg = self.quantizer.quantization_config
        (key, value), = input_dict.items()
        w = value[0] if isinstance(value, list) else value
        e = cfg.entries[key]
        tree, recipe = {key: w}, qt.Recipe(rules={key: e.spec})  # a one-leaf tree for the tree-level algorithm
        with torch.no_grad():
            qps = get_algorithm(cfg.algorithm)(tree, recipe, **cfg.algorithm_options)
            q = qt.quantize_tree(tree, recipe, qparams=qps)[key]  # paths it skips: round-to-nearest
        return named_tensors(key, q)


def attach_config(model: nn.Module, quantized: dict) -> None:
    """After :func:`bridge.to_module`: a transformers model records its quantization config."""
    config = getattr(model, "config", None)
    if not quantized or config is None or not hasattr(model, "all_tied_weights_keys"):
        return
    cfg = getattr(config, "quantization_config", None)
    if not isinstance(cfg, QTransformConfig):
        cfg = QTransformConfig()
    cfg.entries = {**cfg.entries, **metadata.entries_of(quantized)}
    config.quantization_config = cfg
    model.hf_quantizer = QTransformHfQuantizer(cfg, pre_quantized=True)
    model.is_quantized = True
    model.quantization_method = metadata.QUANT_METHOD
    _untie(model, set(quantized))


def register() -> None:
    """Register the config and quantizer with transformers (idempotent; done on ``import bridge``)."""
    hf_auto.AUTO_QUANTIZATION_CONFIG_MAPPING[metadata.QUANT_METHOD] = QTransformConfig
    hf_auto.AUTO_QUANTIZER_MAPPING[metadata.QUANT_METHOD] = QTransformHfQuantizer


register()

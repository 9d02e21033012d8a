"""transformers integration: ``quant_method: "qtransform"``.

Importing :mod:`bridge` registers :class:`~bridge.hf.config.QTransformConfig` and
:class:`QTransformHfQuantizer` with transformers, so that

1. ``AutoModelForCausalLM.from_pretrained(saved_dir)`` loads a checkpoint written by
   :func:`bridge.save` (or ``save_pretrained`` of a quantized model), version 1 or 2: the float
   modules are replaced by quantized skeletons on ``meta`` *before* the weights load, and the
   packed codes and scales load straight into them (nothing is dequantized);
2. ``from_pretrained(path, quantization_config=QTransformConfig(recipe=...))`` quantizes each
   weight as it is read, running the recipe's steps on that one tensor (calibration-free steps
   that fit one tensor at a time: ``rtn``, ``hqq``, or one of yours registered with
   ``local=True``); anything else is refused before loading starts;
3. ``generate()`` works on the result, and ``save_pretrained`` writes it back.

This package is a leaf: nothing else in the bridge imports it. It records the quantization
config of models that :func:`bridge.to_module` rebuilds through a rebuild hook.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import auto as hf_auto
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizers_utils import should_convert_module

import qtransform as qt

from ..checkpoint import metadata
from ..checkpoint.layout import NATIVE, abstract_qtensor, check_like
from ..checkpoint.metadata import CheckpointError, Entry
from ..modules import QModule
from ..modules import actquant, kvcache, online
from ..step_outputs import abstract_outputs, read_outputs, records
from ..modules.actquant import abstract_qparams, activation_specs
from ..pipeline import plan as model_plan
from ..modules.experts import QExperts
from ..tree import REBUILD_HOOKS, experts_slot, float_slot, qtensor_at, replace_module, site_buffers, submodule
from . import checks, offload
from .config import QTransformConfig
from .dequantize import dequantize_model

__all__ = ["QTransformHfQuantizer", "attach_config", "register"]


def _untie(model: nn.Module, paths) -> None:
    """Drop transformers' weight-tying entries that involve a quantized weight."""
    tied = getattr(model, "all_tied_weights_keys", None)
    if tied:
        for k, v in list(tied.items()):
            if k in paths or v in paths:
                tied.pop(k)


def _tie_aliases(model: nn.Module, cfg) -> None:
    """The float tensors the checkpoint stores once for several names (``aliases``: ``{alias: stored}``) are tied
    on load whatever the config's ``tie_word_embeddings`` says: a head untied by quantization writes it false
    (:func:`bridge.io.write_extras`), and transformers would then leave BERT's ``cls.predictions.decoder.bias``
    (stored as ``cls.predictions.bias``) unread."""
    tied = getattr(model, "all_tied_weights_keys", None)
    if tied is None:
        return
    for alias, stored in cfg.aliases.items():
        if alias not in cfg.entries and stored not in cfg.entries:
            tied.setdefault(alias, stored)


def _in_place(converter) -> bool:
    """Whether a transformers weight converter changes tensors in place: the same names in and out."""
    sources = getattr(converter, "_original_source_patterns", None)
    targets = getattr(converter, "_original_target_patterns", None)
    return bool(sources) and list(sources) == list(targets or ()) and bool(getattr(converter, "operations", None))


def _float_slots(model: nn.Module, entries: dict) -> None:
    """Quantize-on-load: the codes slot of each quantized module holds a ``meta`` tensor of the
    float weight (shape and dtype) until the weight is read: transformers 5.17 casts each checkpoint
    tensor to the dtype of the model's slot before the quantize op sees it (5.24 leaves tensors
    quantized on load alone), and a cast to the codes' dtype would destroy the float weight. The
    op's result replaces the slot; the after-loading check verifies it."""
    for path, e in entries.items():
        module, name = submodule(model, path)
        module._buffers[name] = torch.empty(e.shape, dtype=e.dtype, device="meta")


class QTransformHfQuantizer(HfQuantizer):
    """Loads qtransform checkpoints and quantizes on load (see module docstring)."""

    requires_calibration = False
    quantization_config: QTransformConfig

    def _process_model_before_weight_loading(self, model, dtype=None, **kwargs):
        cfg = self.quantization_config
        if not self.pre_quantized:
            if cfg.recipe is None:
                raise ValueError("QTransformConfig: quantize-on-load needs a recipe (a Recipe or QuantSpec)")
            qt.check_steps(cfg.recipe.steps, on_load=True, where="QTransformConfig.recipe.steps")  # before loading
            skip = self.get_modules_to_not_convert(model, cfg.skip_modules, getattr(model, "_keep_in_fp32_modules", None))
            self.plan = model_plan(model, cfg.recipe)
            cfg.entries = {}
            for path, spec in self.plan.specs.items():
                if should_convert_module(qt.module_of(path), skip):
                    w = float_slot(model, path)
                    cfg.entries[path] = Entry(spec, tuple(w.shape), w.dtype)
        if not cfg.entries:
            raise ValueError("QTransformConfig: no module to quantize (empty recipe match or empty checkpoint config)")
        for path, e in cfg.entries.items():
            try:
                module = submodule(model, path)[0]
            except AttributeError:
                raise CheckpointError(f"config.json: quantized tensor {path!r} names no module of "
                                      f"{type(model).__name__}") from None
            if not isinstance(module, (QModule, QExperts)) and tuple(float_slot(model, path).shape) != e.shape:
                raise CheckpointError(f"config.json: quantized tensor {path!r} has shape {list(e.shape)}, "
                                      f"the model's is {list(float_slot(model, path).shape)}")
            replace_module(model, path, abstract_qtensor(e.shape, e.dtype, e.spec))
            if dtype is not None:
                submodule(model, path)[0].compute_dtype = dtype
        attention = set(kvcache.attention_modules(model)) if any(
            s.role in qt.spec.KV_ROLES for s in cfg.activations) else set()
        for site, spec in cfg.activations.items():
            owner, leaf = experts_slot(model, site.module)
            if isinstance(owner, QExperts) and site.role == "input":  # a projection of quantized experts
                owner.set_input_quant(leaf, spec if spec.dynamic else owner.abstract_input(leaf, spec))
                continue
            try:
                module = model.get_submodule(site.module)
            except AttributeError:
                module = None
            if site.role in qt.spec.KV_ROLES:
                if site.module not in attention:
                    raise CheckpointError(f"config.json: key/value quantizer {site.module}:{site.role} is not on an "
                                          f"attention module of {type(model).__name__}")
                actquant.attach(module, site.role, abstract_qparams(module, site.role, spec))
                continue
            if not isinstance(module, QModule):
                raise CheckpointError(f"config.json: activation quantizer {site.module}:{site.role} is not on a "
                                      "quantized module")
            module.set_activation(site.role, spec if spec.dynamic else abstract_qparams(module, site.role, spec))
        try:
            online.install_online_rotations(model, cfg.online)
            abstract_outputs(model, cfg.outputs)  # empty step outputs for the checkpoint's tensors to fill
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"config.json: {e}") from None
        kvcache.route_attention(model)
        offload.distinct_buffers(model)  # the cached abstract tensors, one per module (see bridge.hf.offload)
        if not self.pre_quantized:
            _float_slots(model, cfg.entries)
        _untie(model, set(cfg.entries))
        _tie_aliases(model, cfg)
        if self.pre_quantized:  # the files against the skeleton, before transformers reads any data
            checks.check_checkpoint(model, cfg, kwargs.get("checkpoint_files"), verify=cfg.verify)

    def update_weight_conversions(self, weight_conversions, model):
        """A qtransform checkpoint holds every tensor under the model's own name in the model's own layout
        (:func:`bridge.save` writes the model's tree): transformers' in-place layout changes of a checkpoint's tensor
        (a converter whose sources are its targets: Qwen3-VL-MoE's transposed experts) must not run on it (they
        would transpose packed codes). Renames and merges of other names find nothing to match and stay."""
        if self.pre_quantized:
            weight_conversions = [c for c in weight_conversions if not _in_place(c)]
        return super().update_weight_conversions(weight_conversions, model)

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        return not self.pre_quantized and param_name in self.quantization_config.entries

    def get_quantize_ops(self):
        return _QuantizeOnLoad(self)

    def _process_model_after_weight_loading(self, model, **kwargs):
        for path, e in self.quantization_config.entries.items():
            module = submodule(model, path)[0]
            q = qtensor_at(model, path)
            held = offload.offloaded_names(module)  # on meta between forwards, read by accelerate's hooks
            bad = [n for n, b in module._buffers.items() if b is not None and b.is_meta and n not in held]
            if bad:
                raise CheckpointError(f"checkpoint: quantized tensor(s) {[path.rpartition('.')[0] + '.' + n for n in bad]} "
                                      "are missing")
            check_like(path, q, abstract_qtensor(e.shape, e.dtype, e.spec), where="checkpoint")
            module.prepare()  # the kernel chosen and packed at load, outside any compiled forward
        for site in self.quantization_config.activations:
            owner = experts_slot(model, site.module)[0] or model.get_submodule(site.module)
            held = offload.offloaded_names(owner)
            bad = [k for k, b in site_buffers(model, site).items() if b.is_meta and k.rpartition(".")[2] not in held]
            if bad:
                raise CheckpointError(f"checkpoint: activation quantizer tensor(s) {bad} are missing")
        return model

    def is_serializable(self):
        return True

    def _dequantize(self, model, dtype=None):
        """``model.dequantize()``: the float model (:func:`bridge.hf.dequantize.dequantize_model`); transformers
        then removes the quantization config, so ``save_pretrained`` writes a plain float checkpoint."""
        return dequantize_model(model, dtype)

    @property
    def is_trainable(self) -> bool:
        """Adapters (peft LoRA, :mod:`bridge.hf.peft`) train on the frozen quantized weights."""
        return True


class _QuantizeOnLoad(ConversionOps):
    """Float weight -> ``{path: codes, path_scale: ..., ...}`` as the checkpoint is read."""

    def __init__(self, quantizer: QTransformHfQuantizer):
        self.quantizer = quantizer

    def convert(self, input_dict, source_patterns=None, target_patterns=None, full_layer_name=None, **kwargs):
        (key, value), = input_dict.items()
        w = value[0] if isinstance(value, list) else value
        with torch.no_grad():  # the recipe's steps on this one weight (checked: local, calibration-free)
            q = qt.quantize_tree({key: w}, self.quantizer.plan.restrict([key]))[key]
        return NATIVE.parts(key, q)


def attach_config(model: nn.Module, quantized: dict, plan: qt.Plan | None = None) -> None:
    """Rebuild hook: a transformers model rebuilt with quantized modules records its quantization
    config (entries, and the recipe and rules when the plan is known), for ``save_pretrained``."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "all_tied_weights_keys"):
        return
    untied = getattr(model, "_qt_untied", ())
    if untied:  # names the tree gave different tensors (a rotated head): saved and loaded apart
        _untie(model, set(untied))
        if hasattr(config, "tie_word_embeddings"):
            config.tie_word_embeddings = False
    if not quantized:
        return
    config._is_quantized = True  # what transformers' own quantizers set (Jamba's Mamba mixer calls dt_proj then)
    cfg = getattr(config, "quantization_config", None)
    if not isinstance(cfg, QTransformConfig):
        cfg = QTransformConfig()
    cfg.entries = {**cfg.entries, **metadata.entries_of(quantized)}
    cfg.activations = activation_specs(model)
    cfg.online = online.online_rotations(model)
    cfg.outputs = records(read_outputs(model))
    if plan is not None:
        cfg.recipe = plan.recipe
        cfg.rules = {**cfg.rules, **{p: plan[p].rule for p in quantized if p in plan}}
    config.quantization_config = cfg
    model.hf_quantizer = QTransformHfQuantizer(cfg, pre_quantized=True)
    model.is_quantized = True
    model.quantization_method = metadata.QUANT_METHOD
    _untie(model, set(quantized))


def register() -> None:
    """Register the config and quantizer with transformers (idempotent; done on ``import bridge``)."""
    hf_auto.AUTO_QUANTIZATION_CONFIG_MAPPING[metadata.QUANT_METHOD] = QTransformConfig
    hf_auto.AUTO_QUANTIZER_MAPPING[metadata.QUANT_METHOD] = QTransformHfQuantizer
    checks.patch_transformers_loader(QTransformConfig)
    offload.patch_accelerate_dispatch()
    if "transformers" not in REBUILD_HOOKS:
        REBUILD_HOOKS.register("transformers", attach_config)


register()

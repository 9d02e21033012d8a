"""The model of a checkpoint's ``config.json`` without its weights, and the checkpoint that quantizing it gives,
laid out before any tensor is read.

:func:`build` makes the model with every parameter on the ``meta`` device and its buffers real (a rotary
embedding's frequencies are computed in ``__init__``, not stored): no memory for the weights, and the
parts that are not weights work. :func:`output_layout` gives the tree that the quantized model's
:func:`bridge.extract` would give (quantized weights as QTensors on ``meta``, in its order, with the
static activation quantizers' buffers), which tensors are stored once for several paths (tied weights),
and the groups of stored tensors :class:`bridge.stream.shards.ShardPlan` lays out.
"""

from __future__ import annotations

import contextlib
from typing import Mapping, NamedTuple

import torch
from torch import nn

import qtransform as qt

from ..arch.towers import encoder_decoder
from ..checkpoint import LAYOUTS
from ..checkpoint.layout import abstract_qtensor
from ..io import cast_leaf
from ..modules.actquant import abstract_qparams
from ..tree import Quantized, extract, tie_groups, to_module

__all__ = ["params_on_meta", "class_for", "build", "model_tensors", "OutputLayout", "output_layout", "stored_parts"]


@contextlib.contextmanager
def params_on_meta():
    """Parameters created inside go to the ``meta`` device as they are registered (before any
    initialisation touches them); buffers stay where they are made."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        p = module._parameters.get(name)
        if p is not None and not p.is_meta:
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def class_for(config):
    """The class a checkpoint of ``config`` loads as, the one rule of both drivers: the class its
    ``architectures`` names when transformers has it as a causal LM or an image-text-to-text model (a
    vision-language checkpoint keeps its vision tower and its own config type; Qwen3.5's text-only causal-LM class
    would drop both), else ``AutoModelForCausalLM``; ``ValueError`` naming the model where transformers has no
    causal-LM class for its type, or the config is an encoder-decoder model's (T5; Whisper and BART, whose causal-LM
    class is the decoder alone)."""
    import transformers
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    generative = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()) | set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.values())
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None) if name in generative else None
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    kind = getattr(config, "model_type", None)
    pair = encoder_decoder(config)  # Whisper, BART: their causal-LM class is the decoder alone
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or pair:
        names = ", ".join(getattr(config, "architectures", None) or ()) or type(config).__name__
        what = ("an encoder-decoder model: its causal-LM class, if any, is its decoder alone" if pair else
                "not a causal LM: transformers has no causal-LM or vision-language class for it")
        raise ValueError(f"{names} (model type {kind!r}) is {what}; the command quantizes causal LMs and "
                         "vision-language models: quantize it from Python (bridge.quantize(model, recipe) quantizes "
                         "and calibrates both stacks, calibration batches as dicts of its inputs; bridge.save)")
    return transformers.AutoModelForCausalLM


def build(directory, model_class=None) -> nn.Module:
    """The model of ``directory``'s ``config.json`` (``model_class``, default :func:`class_for` the config;
    anything with ``from_config``), weights on ``meta``, in eval mode."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    cls = model_class or class_for(config)
    with params_on_meta():
        model = cls.from_config(config) if hasattr(cls, "from_config") else cls._from_config(config)
    return model.eval()


def model_tensors(model: nn.Module, stored=()) -> tuple[dict[str, tuple], dict[str, str]]:
    """``({path: shape}, {tied path: path stored instead})`` of the model's stored tensors (parameters and
    persistent buffers; a tensor tied to others may be stored under any of their names). ``stored``: the names a
    checkpoint holds; each tied path maps to the first of its group (model order) stored there, else to the group's
    first other path (a group of three, lm_head and two embeddings, is stored under any one of them)."""
    shapes = {p: tuple(t.shape) for p, t in model.state_dict(keep_vars=True).items()}
    tied = {}
    for paths in tie_groups(model):
        present = [p for p in paths if p in stored]
        for p in paths:
            others = [q for q in present if q != p] or [q for q in paths if q != p]
            if others:
                tied[p] = others[0]
    return shapes, tied


class OutputLayout(NamedTuple):
    """The quantized checkpoint of a streamed run, before any tensor is read: ``tree`` ``{path: meta leaf}``
    in the quantized model's order, ``aliases`` ``{path: stored path}`` (tied tensors), ``groups`` (lists of
    ``{stored name: (dtype, shape)}`` kept in one shard) and ``owner`` ``{stored name: path}`` (the path whose
    leaf each stored tensor is, or is a part of)."""

    tree: dict
    aliases: dict
    groups: list
    owner: dict


def output_layout(model: nn.Module, plan: qt.Plan, dtypes: Mapping[str, torch.dtype], *,
                  activations: Mapping | None = None) -> OutputLayout:
    """See :class:`OutputLayout`. ``dtypes`` ``{path: dtype}``: the float tensors' stored dtypes (a QTensor
    dequantizes to its path's); ``activations`` ``{Site: QuantSpec}`` of the plan (static ones get their buffers)."""
    params = extract(model)
    qtree = {p: abstract_qtensor(t.shape, torch.float32, plan[p].spec) if p in plan.specs else t
             for p, t in params.items()}
    acts = {}
    for site, spec in (activations or {}).items():
        acts[site] = spec if spec.dynamic else abstract_qparams(model.get_submodule(site.module), site.role, spec)
    qmodel = to_module(model, Quantized(params, qtree, plan, activations=acts))
    tree = {p: cast_leaf(v, dtypes[p]) if p in dtypes else v for p, v in extract(qmodel).items()}
    first, order = {}, {p: i for i, p in enumerate(tree)}
    for paths in tie_groups(qmodel):  # stored once, under the name that comes first (as bridge.save does)
        plain = sorted((p for p in paths if p in tree and not isinstance(tree[p], qt.QTensor)), key=order.get)
        first.update({p: plain[0] for p in plain[1:]})
    layout = LAYOUTS["native"]
    groups, owner = [], {}
    for path, leaf in tree.items():
        if path in first:
            continue
        parts = layout.parts(path, leaf) if isinstance(leaf, qt.QTensor) else {path: leaf}
        groups.append({n: (t.dtype, tuple(t.shape)) for n, t in parts.items()})
        owner.update({n: path for n in parts})
    return OutputLayout(tree, first, groups, owner)


def stored_parts(path: str, q: qt.QTensor) -> dict:
    """``{stored name: tensor}`` of the quantized tensor ``q`` at ``path`` in the native layout."""
    return LAYOUTS["native"].parts(path, q)

"""The transformers model a checkpoint's ``config.json`` describes, for the exporters and importers that
need its module classes (Quark, compressed-tensors), its float forward (ONNX) or a model to load an
import into (the ``qtransform`` command).

The class is the config's ``architectures`` entry when this transformers defines it, else the first
head class (causal LM first, then image-text-to-text for a vision-language model whose checkpoint
names no class; masked LM first for an encoder, ``is_decoder: false``), else the first causal-LM or
image-text-to-text class registered for the config's own class (a composite model's text part, which the
auto classes do not build), whose state dict holds every given path. Candidates are tried on the ``meta`` device (no memory); only the chosen one is
built on a real device.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
from torch import nn

import qtransform as qt

from ..checkpoint.config_file import decode_floats
from ..modules.actquant import PREFIX
from ..tree import tie_groups
from .base import Checkpoint

__all__ = ["HEADS", "transformers_model", "registered_heads", "model_paths", "float_model"]

#: Head classes tried, in order, when the config names no class this transformers defines.
HEADS = ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModelForMaskedLM", "AutoModelForSeq2SeqLM",
         "AutoModelForSequenceClassification", "AutoModelForTokenClassification", "AutoModel")
_BUILD_ERRORS = (ValueError, KeyError, TypeError, AttributeError, RuntimeError)


def transformers_model(config: Mapping, *, paths: Iterable[str] = (), device: str = "meta",
                       dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model of ``config`` (a ``config.json`` dict) that has every tensor in ``paths``, on ``device``
    (freshly initialized weights in ``dtype`` off ``meta``; the global random state is left as it was),
    in eval mode. ``ValueError`` when this transformers builds no such model."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if config.get("model_type") not in CONFIG_MAPPING:
        raise ValueError(f"config.json names model_type {config.get('model_type')!r}, not a transformers model "
                         "this transformers builds")
    try:  # a dict as json.loads gave it may still hold transformers' tagged floats ({"__float__": "Infinity"})
        cfg = CONFIG_MAPPING[config["model_type"]].from_dict(decode_floats({k: v for k, v in config.items()
                                                                            if k != "quantization_config"}))
    except Exception as e:  # noqa: BLE001  (huggingface_hub's strict-dataclass errors are no ValueError)
        raise ValueError(f"config.json of model_type {config['model_type']!r} is not a valid "
                         f"{CONFIG_MAPPING[config['model_type']].__name__} ({type(e).__name__}: {e})") from e
    named = [a for a in config.get("architectures") or [] if isinstance(a, str) and hasattr(transformers, a)]
    heads = list(HEADS)
    if config.get("is_decoder") is False:  # an encoder (BERT) that could be a decoder: its masked LM first
        heads.insert(0, heads.pop(heads.index("AutoModelForMaskedLM")))
    wanted, tried = set(paths), []
    last = [a for a in registered_heads(type(cfg)) if a not in named]  # what the auto classes do not build
    for name in named + heads + last:
        cls = getattr(transformers, name)

        def build(cls=cls, name=name):
            return cls.from_config(cfg) if name in heads else cls(cfg)
        try:
            with torch.device("meta"):
                model = build()
        except _BUILD_ERRORS:
            continue
        tried.append(name)
        if wanted <= set(model.state_dict(keep_vars=True)):
            break
    else:
        raise ValueError(f"no transformers class of model_type {config['model_type']!r} has every tensor of the "
                         f"checkpoint (tried {tried})")
    if device != "meta":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the initialisation is overwritten; seeded so that builds repeat
            with torch.device(device):
                model = build().to(dtype)
    return model.eval()


def registered_heads(config_class: type) -> list[str]:
    """The causal-LM and image-text-to-text classes transformers registers (under any model type of the config's
    own package) whose config class is ``config_class``: the text part of a composite model (Mllama's
    ``MllamaTextConfig`` -> ``MllamaForCausalLM``, registered under ``mllama``), which the auto classes do not build
    from that config. Only that package's classes are imported.

    >>> from transformers import MllamaTextConfig
    >>> registered_heads(MllamaTextConfig)
    ['MllamaForCausalLM']
    """
    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as VLM

    package = config_class.__module__.split(".")[2] if config_class.__module__.startswith("transformers.models.") else None
    out = []
    for mapping in (CAUSAL, VLM):
        for model_type, name in mapping.items():
            if model_type_to_module_name(model_type) == package and name not in out:
                cls = getattr(transformers, name, None)
                if cls is not None and getattr(cls, "config_class", None) is config_class:
                    out.append(name)
    return out


def model_paths(source: Checkpoint) -> list[str]:
    """The paths of ``source``'s tree that are the model's own tensors (not activation or key/value scales)."""
    acts = {f"{s.module}{sep}{PREFIX[s.role]}{f}" for s in source.meta.activations for f in qt.QParams.FIELDS
            for sep in (".", "_")}  # a module's buffers; a stacked experts weight's (experts.gate_up_proj_input_scale)
    return [p for p in source.tree if p not in acts]


def float_model(source: Checkpoint, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The transformers model whose weights ``source`` holds (see :func:`transformers_model`) in ``dtype``,
    loaded with the tree (quantized tensors dequantized; activation and key/value scales left out).
    Paths the config ties whose tree values differ (an output projection quantized, the input embedding
    tied to it kept in float) get a parameter each, as the quantized model holds them: loading one into
    the other's tensor would change the model. ``ValueError`` naming the tensors the model lacks or the
    checkpoint does not give."""
    paths = model_paths(source)
    model = transformers_model(source.config, paths=paths, device="cpu", dtype=dtype)
    state = {}
    for p in paths:
        leaf = source.tree[p]
        t = qt.dequantize(leaf) if qt.is_qtensor(leaf) else leaf
        state[p] = t.to(dtype) if t.is_floating_point() else t
    _untie_differing(model, state)
    missing = set(model.load_state_dict(state, strict=False).missing_keys)
    missing -= {p for group in tie_groups(model) for p in group if any(q in state for q in group)}
    if missing:
        raise ValueError(f"{source.directory}: no value for {sorted(missing)[:5]} of {type(model).__name__}")
    return model


def _untie_differing(model: nn.Module, state: Mapping) -> None:
    """Give each path of a tie group its own parameter where ``state`` holds different values for them."""
    for group in tie_groups(model):
        given = [p for p in group if p in state]
        if all(state[p].shape == state[given[0]].shape and torch.equal(state[p], state[given[0]]) for p in given):
            continue
        for p in group:
            owner, _, name = p.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            old = getattr(module, name)
            if isinstance(old, nn.Parameter):
                setattr(module, name, nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad))
            else:
                module._buffers[name] = old.detach().clone()

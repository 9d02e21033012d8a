"""Other tools' checkpoints (Quark's HF format, compressed-tensors, GGUF files) as transformers models
with our quantized modules, built from the checkpoint's own config: no ``like`` model needed.

The quantized tensors are the importer's (:data:`bridge.interop.IMPORTERS`), as stored: never
re-quantized. This is what ``qtransform eval --model``, ``inspect`` and ``quantize --model`` use
for such directories, so they need neither amd-quark nor compressed-tensors' own modules.
"""

from __future__ import annotations

import torch
from torch import nn

import qtransform as qt

from .. import interop
from ..io import from_source, imported_format
from ..tree import tie_groups as _tied

__all__ = ["load_imported", "model_from_config"]


def model_from_config(config: dict, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The transformers model of a ``config.json`` dict (its ``architectures`` class, else a causal LM)
    with freshly initialized weights in ``dtype``, in eval mode."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k not in ("quantization_config", "model_type")}
    if "model_type" not in config:
        raise ValueError(f"the checkpoint's config has no model_type (keys: {sorted(config)[:8]})")
    cfg = AutoConfig.for_model(config["model_type"], **fields)
    names = config.get("architectures") or []
    cls = getattr(transformers, names[0], None) if names else None
    cls = cls if isinstance(cls, type) and issubclass(cls, nn.Module) else AutoModelForCausalLM
    model = cls.from_config(cfg, dtype=dtype) if cls is AutoModelForCausalLM else cls._from_config(cfg, dtype=dtype)
    return model.eval()


def load_imported(path, *, dtype: torch.dtype = torch.float32, kernel: str = "auto",
                  dequantize: bool = False) -> nn.Module:
    """The model of another tool's checkpoint at ``path`` (a directory, or a ``.gguf`` file) with our
    quantized modules holding its tensors as stored; with ``dequantize`` the float model of the same
    values instead (its activation quantizers dropped): the source of a new recipe. ``ValueError``
    when no importer reads ``path`` or the importer cannot map a tensor (named)."""
    fmt = imported_format(path)
    if fmt is None:
        raise ValueError(f"load_imported: {path} is not a checkpoint of a format qtransform imports "
                         f"({', '.join(sorted(interop.IMPORTERS))})")
    source = interop.IMPORTERS[fmt].read(path)
    model = model_from_config(source.config, dtype)
    if not dequantize:
        return from_source(model, source, kernel=kernel)
    own = model.state_dict()
    state = {p: (qt.dequantize(v, dtype=own[p].dtype) if isinstance(v, qt.QTensor) else v.to(own[p].dtype))
             for p, v in source.tree.items() if p in own}  # activation and key/value scales: not the model's
    missing = set(model.load_state_dict(state, strict=False).missing_keys)
    tied = {p for group in _tied(model) for p in group if any(q in state for q in group)}
    if missing - tied:
        raise ValueError(f"{path}: no value for {sorted(missing - tied)[:5]} of {type(model).__name__}")
    return model

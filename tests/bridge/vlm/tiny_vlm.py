"""Tiny random multimodal models (issue 51): every sub-config of a vision-language, audio or encoder-decoder
config shrunk by field name as :func:`moe.tiny_moe.tiny_moe_config` shrinks a text config, built with the class
its config names (``architectures``), deterministic finite weights."""

from __future__ import annotations

import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from moe.tiny_moe import _reinit, _small_value

#: the image/patch sizes of a tiny vision tower (small images, a few patches)
_VISION = {"image_size": 32, "patch_size": 8, "spatial_patch_size": 8, "num_channels": 3, "window_size": 16,
           "vision_output_dim": 64, "max_num_tiles": 4, "scale_factor": 2, "spatial_merge_size": 2,
           "temporal_patch_size": 2, "out_hidden_size": 64, "projection_dim": 64, "depth": 2,
           "num_position_embeddings": 16, "image_seq_length": 4, "mm_tokens_per_image": 4}


def _shrink(d: dict, *, hidden: int = 64, layers: int = 2, vocab: int = 256) -> dict:
    out = {}
    for name, value in d.items():
        if name.startswith("_") or name in ("model_type", "transformers_version", "architectures"):
            continue
        if isinstance(value, dict) and ("model_type" in value or name.endswith("_config")):
            out[name] = _shrink(value, hidden=hidden, layers=layers, vocab=vocab)
            continue
        if name in _VISION and isinstance(value, int) and not isinstance(value, bool):
            out[name] = _VISION[name]
            continue
        heads = d.get(name.replace("key_value", "attention").replace("kv_", ""), 1 << 30)
        new = _small_value(name, value, heads=heads if isinstance(heads, int) else 1 << 30, experts=4, top_k=2,
                           hidden=hidden, layers=layers, vocab=vocab)
        if name.endswith("intermediate_size") and isinstance(value, int):
            new = 128
        out[name] = new
    return out


def tiny_config(model_type: str, **overrides):
    cls = CONFIG_MAPPING[model_type]
    small = _shrink(cls().to_dict())
    small.update(overrides)
    config = cls(**small)
    config._attn_implementation = "eager"
    return config


def build_tiny(model_type: str, seed: int = 0, model_class=None, **overrides):
    import transformers

    config = tiny_config(model_type, **overrides)
    cls = model_class or getattr(transformers, (config.architectures or [None])[0] or "", None)
    if cls is None:
        from transformers import AutoModelForImageTextToText
        cls = AutoModelForImageTextToText
    torch.manual_seed(seed)
    model = cls.from_config(config) if hasattr(cls, "from_config") and cls.__name__.startswith("Auto") else cls(config)
    _reinit(model, seed)
    return model.eval()

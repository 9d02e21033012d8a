"""The parts of a multimodal model besides its language model: vision and audio towers, their projectors.

A vision-language model (LLaVA, Qwen2.5/3-VL, Qwen3.5, Gemma-3, SmolVLM, Idefics3, Mllama...) is its language
model plus a tower that encodes images (or audio) and a projector into the language model's embeddings. The
field quantizes the language model and keeps the tower and projector in their precision unless asked (they are
small, and the first to break): :func:`towers` finds them without a table, from the model itself: the language
model is what ``get_decoder()`` returns, and the towers are its siblings that hold weights, in a model whose
config has a vision or audio sub-config (an encoder-decoder model's encoder is no tower: it is quantized).
"""

from __future__ import annotations

from torch import nn

__all__ = ["towers"]

_SUBCONFIGS = ("vision_config", "audio_config", "speech_config", "vision_tower_config")


def towers(model: nn.Module) -> tuple[str, ...]:
    """Module paths of ``model``'s towers and projectors (see the module docstring); ``()`` for a text model."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return ()
    if not any(getattr(config, k, None) is not None for k in _SUBCONFIGS):
        return ()
    get = getattr(model, "get_decoder", None)
    try:
        decoder = get() if callable(get) else None
    except (AttributeError, NotImplementedError, TypeError):
        decoder = None
    path = next((n for n, m in model.named_modules() if m is decoder), None) if decoder is not None else None
    if not path:
        return ()
    parent, _, own = path.rpartition(".")
    base = model.get_submodule(parent) if parent else model
    return tuple(f"{parent}.{k}" if parent else k for k, child in base.named_children()
                 if k != own and any(True for _ in child.parameters()))

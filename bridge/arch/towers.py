"""The parts of a multimodal model besides its language model: vision and audio towers, their projectors.

A vision-language model (LLaVA, Qwen2.5/3-VL, Qwen3.5, Gemma-3, SmolVLM, Idefics3, Mllama...) is its language
model plus a tower that encodes images (or audio, proteins...) and a projector into the language model's
embeddings. The field quantizes the language model and keeps the tower and projector in their precision unless
asked (they are small, and the first to break): :func:`towers` finds them without a table, from the model itself,
in a model whose config has a sub-config besides its text one (``vision_config``, ``audio_config``,
``vq_config``, ``encoder_config``...). The language model is what ``get_decoder()`` returns; the towers are

* the siblings of the language model and of its parents that hold a matrix (LLaVA's ``vision_tower`` and
  ``multi_modal_projector``), and
* where the language model is the whole base model (Chameleon's VQ image tokenizer, Phi-4-multimodal's feature
  embedding, Evolla's protein encoder, GIT's image encoder), its children that hold a matrix and are not on its
  text path: not its blocks (its shallowest module list), not its input or output embeddings (nor hold them).

An encoder-decoder model's encoder (``get_encoder()``) is no tower: it is quantized (a decoder's audio encoder, which
``get_encoder()`` may also return, is one).
"""

from __future__ import annotations

from torch import nn

from .embeddings import input_embeddings, model_part, output_embeddings

__all__ = ["towers", "encoder_decoder"]


def _subconfigs(config) -> list:
    """The config's sub-configs besides its text one (an attribute holding a config object)."""
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    return [v for k, v in vars(config).items() if hasattr(v, "to_dict") and hasattr(v, "model_type") and v is not text
            and not k.startswith("_")]


def encoder_decoder(config) -> bool:
    """Whether the config (or its text part: Florence-2's BART) is an encoder-decoder model's."""
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    return bool(getattr(config, "is_encoder_decoder", False) or getattr(text, "is_encoder_decoder", False))


def _path_of(model: nn.Module, module) -> str | None:
    return next((n for n, m in model.named_modules() if m is module), None) if module is not None else None


def _holds(module: nn.Module, ids: set) -> bool:
    return any(id(m) in ids for m in module.modules())


def _matrix(module: nn.Module) -> bool:
    return any(p.dim() >= 2 for p in module.parameters())


def _shallowest_list(module: nn.Module) -> nn.Module | None:
    """The module list nearest ``module`` (fewest dots; ties: the most parameters): a decoder's blocks."""
    lists = [(n.count("."), -sum(p.numel() for p in m.parameters()), i, m)
             for i, (n, m) in enumerate(module.named_modules()) if isinstance(m, nn.ModuleList) and len(m)]
    return min(lists, key=lambda t: t[:3])[3] if lists else None


def towers(model: nn.Module) -> tuple[str, ...]:
    """Module paths of ``model``'s towers and projectors (see the module docstring); ``()`` for a text model."""
    config = getattr(model, "config", None)
    if config is None or not _subconfigs(config):
        return ()
    decoder = model_part(model, "get_decoder")
    path = _path_of(model, decoder)
    if not path:
        return ()
    encoder = model_part(model, "get_encoder") if encoder_decoder(config) else None  # else: an audio encoder, a tower
    text = {id(m) for m in (input_embeddings(model), output_embeddings(model), encoder) if isinstance(m, nn.Module)}
    chain = {""} | {path[:i] for i, c in enumerate(path) if c == "."} | {path}
    out = []
    for parent in sorted(chain - {path}, key=len):
        for k, child in model.get_submodule(parent).named_children():
            p = f"{parent}.{k}" if parent else k
            if p not in chain and _matrix(child) and not _holds(child, text):
                out.append(p)
    if decoder is getattr(model, "base_model", None):  # the whole base model: its towers are inside it
        blocks = _shallowest_list(decoder)
        inner = text | ({id(blocks)} if blocks is not None else set())
        out += [f"{path}.{k}" for k, child in decoder.named_children() if _matrix(child) and not _holds(child, inner)]
    return tuple(out)

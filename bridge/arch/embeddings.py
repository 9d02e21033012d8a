"""A model's input and output embeddings, as transformers names them (``get_input_embeddings`` /
``get_output_embeddings``), or ``None``: a model without the method, or whose method raises because the class does
not implement it (``NotImplementedError``: PP-FormulaNet's) or has no such module (``AttributeError``). Every caller
in the bridge asks here, so that a model that lacks them is answered the same way everywhere."""

from __future__ import annotations

from torch import nn

__all__ = ["model_part", "input_embeddings", "output_embeddings", "head_apart"]


def model_part(model, method: str) -> nn.Module | None:
    """The module a transformers getter of ``model`` gives (``get_input_embeddings``, ``get_decoder``,
    ``get_encoder``...), or ``None``: no such method, or one that raises because the class does not implement it or
    has no such part."""
    get = getattr(model, method, None)
    if not callable(get):
        return None
    try:
        found = get()
    except (NotImplementedError, AttributeError, TypeError):
        return None
    return found if isinstance(found, nn.Module) else None


def input_embeddings(model) -> nn.Module | None:
    """``model.get_input_embeddings()``, or ``None`` where the model has none (see the module docstring)."""
    return model_part(model, "get_input_embeddings")


def output_embeddings(model) -> nn.Module | None:
    """``model.get_output_embeddings()``, or ``None`` where the model has none (see the module docstring)."""
    return model_part(model, "get_output_embeddings")


def head_apart(model, qconfig) -> bool:
    """Whether checkpoint config ``qconfig`` (its ``tensors`` and ``aliases``) quantizes ``model``'s output head apart
    from its input embeddings (Whisper's ``proj_out``, BERT's ``cls.predictions.decoder``: the embedding kept in
    float, or quantized as another tensor): the written config must then say untied (``tie_word_embeddings``
    false), or a reader ties them again (:func:`bridge.io.write_extras`, both drivers)."""
    head, emb = output_embeddings(model), input_embeddings(model)
    paths = {id(m): n for n, m in model.named_modules()} if head is not None and emb is not None else {}
    if id(head) not in paths or id(emb) not in paths:
        return False
    h, e = f"{paths[id(head)]}.weight", f"{paths[id(emb)]}.weight"
    aliases, tensors = qconfig.get("aliases") or {}, qconfig.get("tensors") or {}
    # still one tensor: stored once (an alias), or both quantized alike from the one tied weight (the same entry)
    still = h == e or aliases.get(e) == h or aliases.get(h) == e or (e in tensors and tensors.get(h) == tensors[e])
    return h in tensors and not still

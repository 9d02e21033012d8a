"""A model's input and output embeddings, as transformers names them (``get_input_embeddings`` /
``get_output_embeddings``), or ``None``: a model without the method, or whose method raises because the class does
not implement it (``NotImplementedError``: PP-FormulaNet's) or has no such module (``AttributeError``). Every caller
in the bridge asks here, so that a model that lacks them is answered the same way everywhere."""

from __future__ import annotations

from torch import nn

__all__ = ["input_embeddings", "output_embeddings"]


def _ask(model, method: str) -> nn.Module | None:
    get = getattr(model, method, None)
    if not callable(get):
        return None
    try:
        found = get()
    except (NotImplementedError, AttributeError):
        return None
    return found if isinstance(found, nn.Module) else None


def input_embeddings(model) -> nn.Module | None:
    """``model.get_input_embeddings()``, or ``None`` where the model has none (see the module docstring)."""
    return _ask(model, "get_input_embeddings")


def output_embeddings(model) -> nn.Module | None:
    """``model.get_output_embeddings()``, or ``None`` where the model has none (see the module docstring)."""
    return _ask(model, "get_output_embeddings")

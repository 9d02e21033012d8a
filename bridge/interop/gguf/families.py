"""GGUF's views of the model-family table (``bridge.arch.ARCHS``): which families export, under which llama.cpp
architecture, which of them carry experts; computed from the rows when asked, so a family's GGUF facts live in
its row only (``Arch.gguf``, ``Arch.expert_count``, ``Arch.sliding_window``).

>>> arches()["mistral"], moe_arches()["mixtral"], family({"model_type": "qwen2"}).gguf.arch, family({})
('llama', 'llama', 'qwen2', None)
"""

from __future__ import annotations

from ...arch import Arch, families

__all__ = ["family", "arches", "moe_arches", "moe_family", "expert_counts"]


def family(config: dict) -> Arch | None:
    """The row of ``config``'s ``model_type`` when it has GGUF facts (``None``: no GGUF export)."""
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict (config.json), got {type(config).__name__}")
    kind = config.get("model_type")
    arch = families.arch_for(kind) if isinstance(kind, str) else None
    return arch if arch is not None and arch.gguf is not None else None


def arches() -> dict[str, str]:
    """transformers ``model_type`` -> GGUF ``general.architecture``, for every family with GGUF facts."""
    return {t: a.gguf.arch for a in families.ARCHS if a.gguf is not None for t in a.model_types}


def moe_arches() -> dict[str, str]:
    """:func:`arches` of the mixture-of-experts families (a row with an ``expert_count``)."""
    return {t: a.gguf.arch for a in families.ARCHS if a.gguf is not None and a.expert_count
            for t in a.model_types}


def moe_family(arch: str) -> Arch | None:
    """The mixture-of-experts family a GGUF file of architecture ``arch`` with an expert count holds (``llama``
    with experts: Mixtral), ``None`` when none."""
    return next((a for a in families.ARCHS if a.gguf is not None and a.expert_count and a.gguf.arch == arch), None)


def expert_counts() -> tuple[str, ...]:
    """The ``config.json`` keys of a mixture-of-experts model's expert count, every row's ``expert_count``."""
    return tuple(dict.fromkeys(a.expert_count for a in families.ARCHS if a.expert_count))

"""Low-rank corrections on a model's quantized linears (the ``lowrank`` step's ``Fit.lowrank``).

Each correction lives on its :class:`~bridge.modules.QLinear` as the buffers ``<module>.lowrank_a``
``(r, in)`` and ``<module>.lowrank_b`` ``(out, r)`` (logical layout, also for ``Conv1D``), kept in the
dtype of the weight's dequantized values (the model's dtype: 4 bytes per element in float32, 2 in
bf16/fp16), so a correction of rank ``r`` costs ``r·(in + out)`` such elements. A checkpoint records
each module's rank (``quantization_config["lowrank"]``); the shapes follow from its weight.

>>> import torch, qtransform as qt
>>> from bridge.modules import QLinear
>>> w = torch.randn(8, 32)
>>> m = torch.nn.Sequential(QLinear(qt.quantize(w, qt.choose_qparams(w, qt.QuantSpec(format="int4")))))
>>> attach_lowrank(m, {"0.weight": qt.LowRank(a=torch.ones(2, 32), b=torch.zeros(8, 2))})
>>> lowrank_ranks(m), lowrank_bytes(m)
({'0': 2}, 320)
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

import qtransform as qt

from .linear import QLinear

__all__ = ["attach_lowrank", "lowrank_of", "lowrank_ranks", "lowrank_bytes", "abstract_lowrank", "NAMES"]

#: The buffer names of a correction, ``a`` then ``b``.
NAMES = ("lowrank_a", "lowrank_b")


def _linear(model: nn.Module, module: str, what: str) -> QLinear:
    try:
        m = model.get_submodule(module)
    except AttributeError:
        m = None
    if not isinstance(m, QLinear):
        raise ValueError(f"{module}: {what} goes on a quantized linear (QLinear), and {module!r} is "
                         f"{'no module' if m is None else type(m).__name__} of {type(model).__name__}")
    return m


def attach_lowrank(model: nn.Module, corrections: Mapping[str, qt.LowRank]) -> None:
    """Put ``corrections`` (``{weight path: LowRank}``) on their QLinears, cast to each weight's dequantized
    dtype; a path that is not a quantized linear's weight is a ``ValueError`` naming it (checked for all
    before any is attached)."""
    targets = {}
    for path, c in corrections.items():
        module, _, leaf = path.rpartition(".")
        m = _linear(model, module, "a low-rank correction")
        if leaf != "weight":
            raise ValueError(f"{path}: a low-rank correction corrects a linear's 'weight', not {leaf!r}")
        if not isinstance(c, qt.LowRank):
            raise TypeError(f"{path}: expected a qtransform.LowRank, got {type(c).__name__}")
        if c.a.shape[1] != m.in_features or c.b.shape[0] != m.out_features:
            raise ValueError(f"{path}: low-rank correction a {tuple(c.a.shape)}, b {tuple(c.b.shape)} does not fit "
                             f"{m.in_features} inputs and {m.out_features} outputs")
        targets[path] = (m, c)
    for m, c in targets.values():
        m.set_lowrank(c.to(m.weight_dtype) if m.weight_dtype is not None else c)


def lowrank_of(model: nn.Module) -> dict[str, qt.LowRank]:
    """``{weight path: LowRank}`` of the corrections ``model``'s quantized linears run."""
    return {(f"{n}." if n else "") + "weight": m.lowrank for n, m in model.named_modules()
            if isinstance(m, QLinear) and m.lowrank is not None}


def lowrank_ranks(model: nn.Module) -> dict[str, int]:
    """``{module path: rank}`` of the corrections in ``model`` (what a checkpoint's config records)."""
    return {p.rpartition(".")[0]: c.rank for p, c in lowrank_of(model).items()}


def lowrank_bytes(model: nn.Module) -> int:
    """Bytes of the corrections' buffers in ``model``."""
    return sum(t.numel() * t.element_size() for c in lowrank_of(model).values() for t in (c.a, c.b))


def abstract_lowrank(model: nn.Module, ranks: Mapping[str, int], *, device="meta") -> None:
    """Empty corrections of ``ranks`` (``{module: rank}``) on ``model``'s QLinears, in each weight's dtype, for
    a checkpoint's tensors to fill (loading through transformers)."""
    for module, r in ranks.items():
        m = _linear(model, module, "a recorded low-rank correction")
        dt = m.weight_dtype or torch.float32
        m.set_lowrank(qt.LowRank(a=torch.empty(r, m.in_features, dtype=dt, device=device),
                                 b=torch.empty(m.out_features, r, dtype=dt, device=device)))

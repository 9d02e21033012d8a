"""Low-rank corrections on a model's quantized linears (the ``lowrank`` step's ``Fit.lowrank``).

Each correction lives on its :class:`~bridge.modules.QLinear` as the buffers ``<module>.lowrank_a``
``(r, in)`` and ``<module>.lowrank_b`` ``(out, r)`` (logical layout, also for ``Conv1D``), kept in the
dtype of the weight's dequantized values (the model's dtype: 4 bytes per element in float32, 2 in
bf16/fp16), so a correction of rank ``r`` costs ``r·(in + out)`` such elements. A checkpoint records
each module's rank (``quantization_config["lowrank"]``); the shapes follow from its weight. ``model.dequantize()``
folds a correction into its float weight. All of that is the kind's one registration, :data:`SLOT`
(:mod:`bridge.step_outputs`).

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

from ..step_outputs import OutputSlot, register_slot
from .linear import QLinear, is_conv1d

__all__ = ["attach_lowrank", "lowrank_of", "lowrank_ranks", "lowrank_bytes", "abstract_lowrank", "NAMES", "SLOT"]

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
    return _ranks(lowrank_of(model))


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


def _ranks(corrections: Mapping[str, qt.LowRank]) -> dict[str, int]:
    return {p.rpartition(".")[0]: int(c.rank) for p, c in corrections.items()}


def _check_ranks(raw, entries) -> dict:
    """``{module: rank}``: each a quantized 2-D weight's module, each rank an int >= 1."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"'lowrank' must be an object of module -> rank, got {type(raw).__name__}")
    for module, r in raw.items():
        e = entries.get(f"{module}.weight")
        if e is None or len(e.shape) != 2:
            raise ValueError(f"'lowrank' names {module!r}, which has no quantized 2-D weight in 'tensors'")
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ValueError(f"'lowrank' rank of {module!r} must be an int >= 1, got {r!r}")
    return dict(raw)


def _tensors(corrections: Mapping[str, qt.LowRank]) -> dict:
    out = {}
    for path, c in corrections.items():
        module = path.rpartition(".")[0]
        out.update({f"{module}.{NAMES[0]}": c.a, f"{module}.{NAMES[1]}": c.b})
    return out


def _parts(like: nn.Module, ranks: Mapping[str, int], entries) -> dict:
    """``<module>.lowrank_a`` ``(rank, in)`` and ``.lowrank_b`` ``(out, rank)`` in the weight entry's dtype,
    ``in``/``out`` the logical widths of ``like``'s linear (a ``Conv1D`` stores its weight (in, out))."""
    out = {}
    for module, r in ranks.items():
        e = entries[f"{module}.weight"]
        try:
            m = like.get_submodule(module)
        except AttributeError:
            raise ValueError(f"low-rank correction of {module!r} names no module of {type(like).__name__}") from None
        if not isinstance(m, nn.Linear) and not is_conv1d(m) and not isinstance(m, QLinear):
            raise ValueError(f"low-rank correction of {module!r}: a {type(m).__name__}, not a linear")
        n_out, n_in = e.shape[::-1] if (is_conv1d(m) or getattr(m, "transposed", False)) else e.shape
        out[f"{module}.{NAMES[0]}"] = ((r, n_in), e.dtype)
        out[f"{module}.{NAMES[1]}"] = ((n_out, r), e.dtype)
    return out


def _take(tree: dict, ranks: Mapping[str, int]) -> dict:
    return {f"{m}.weight": qt.LowRank(a=tree.pop(f"{m}.{NAMES[0]}"), b=tree.pop(f"{m}.{NAMES[1]}")) for m in ranks}


def _fold(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """A correction folds into the float weight: ``Q x + B A x = (Q + B A) x``."""
    c = module.lowrank if type(module) is QLinear else None
    return weight if c is None else weight + (c.delta().T if module.transposed else c.delta()).to(weight.dtype)


def _summary(ranks: Mapping[str, int]) -> str:
    return f"low-rank corrections: {len(ranks)} linears, rank {', '.join(map(str, sorted(set(ranks.values()))))}"


#: The ``lowrank`` kind on the torch side (see :mod:`bridge.step_outputs`).
SLOT = register_slot(OutputSlot(
    name="lowrank", label="low-rank corrections", attach=attach_lowrank, read=lowrank_of, record=_ranks,
    check_record=_check_ranks, tensors=_tensors, parts=_parts, take=_take, abstract=abstract_lowrank, fold=_fold,
    describe=lambda module, rank: f"a low-rank correction (rank {rank})", summary=_summary, streams=False))

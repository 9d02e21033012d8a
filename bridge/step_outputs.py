"""The torch side of the kinds of step output (:data:`qtransform.OUTPUT_KINDS`): one registration per kind.

A step's :attr:`Fit.outputs <qtransform.Fit>` (``{kind: {tree path: value}}``, e.g. ``lowrank``'s
``{weight path: LowRank}``) travels in :class:`~bridge.tree.Quantized` and onto the built model, into
checkpoints and back. What each kind needs for that is one :class:`OutputSlot`, registered in the kind's
module (:mod:`bridge.modules.lowrank` for ``lowrank``) with :func:`register_slot`; everything else
(:func:`bridge.to_module`, :func:`bridge.save` / :func:`bridge.load`, the ``quantization_config``,
transformers loading, ``model.dequantize()``, the report, streamed runs, exporters) iterates over
:data:`SLOTS` and names no kind:

* ``attach(model, values)`` puts ``{path: value}`` on a built model (every path checked before any is
  attached; ``ValueError`` naming the path); ``read(model)`` gives them back;
* ``record(values)``: what the checkpoint's ``quantization_config`` records under the kind's name (a JSON
  object ``{key: JSON value}``: ``lowrank``'s ``{module: rank}``); ``check_record(raw, entries)`` validates a
  read one against the quantized tensors' entries (``ValueError``) and returns it;
* ``tensors(values)``: the stored tensors ``{name: tensor}`` (the names of the buffers ``attach`` makes, so a
  model's state dict holds them); ``parts(like, record, entries)``: their names, shapes and dtypes as a record
  fixes them for the float model ``like`` (checked before data is read); ``take(tree, record)``: the values
  popped from a read tree;
* ``abstract(model, record)``: empty values (``meta`` tensors) for transformers to fill when it loads a
  checkpoint (``None``: such checkpoints load with :func:`bridge.load` only);
* ``fold(module, weight)``: the float weight of ``module`` with its value folded in, for
  ``model.dequantize()`` (``None``: a model carrying the kind is refused there);
* ``label`` (plural, ``"low-rank corrections"``), ``describe(key, entry)`` (one record entry: ``"a low-rank
  correction (rank 4)"``) and ``summary(record)`` (the report's line) say what it is in messages;
* ``streams``: whether a streamed run writes it (else its steps are refused there up front);
  ``version``: the ``quantization_config`` version a checkpoint carrying it is written with.

The report counts each kind's bytes as those of its ``tensors``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from torch import nn

import qtransform as qt

__all__ = ["OutputSlot", "SLOTS", "register_slot", "attach_outputs", "read_outputs", "records", "output_tensors",
           "output_bytes", "output_parts", "take_outputs", "abstract_outputs", "VERSION_OUTPUTS"]

#: The first ``quantization_config`` version that records step outputs.
VERSION_OUTPUTS = 5


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutputSlot:
    """How a kind of step output lives on the torch side (see the module docstring)."""

    name: str
    label: str
    attach: Callable[[nn.Module, Mapping[str, Any]], None]
    read: Callable[[nn.Module], dict]
    record: Callable[[Mapping[str, Any]], dict]
    check_record: Callable[[Any, Mapping], dict]
    tensors: Callable[[Mapping[str, Any]], dict]
    parts: Callable[[nn.Module, Mapping, Mapping], dict]
    take: Callable[[dict, Mapping], dict]
    describe: Callable[[str, Any], str]
    summary: Callable[[Mapping], str]
    abstract: Callable[[nn.Module, Mapping], None] | None = None
    fold: Callable[[nn.Module, Any], Any] | None = None
    streams: bool = False
    version: int = VERSION_OUTPUTS


def _check(name: str, slot) -> None:
    if not isinstance(slot, OutputSlot):
        raise TypeError(f"register_slot: expected an OutputSlot, got {type(slot).__name__}")
    if name != slot.name or name not in qt.OUTPUT_KINDS:
        raise ValueError(f"register_slot: {name!r} is not a kind of step output declared in qtransform "
                         f"(qt.register_output_kind; declared: {list(qt.OUTPUT_KINDS)})")


#: The registry: kind name -> :class:`OutputSlot`.
SLOTS = qt.Registry("step output slot", check=_check)


def register_slot(slot: OutputSlot, *, replace: bool = False) -> OutputSlot:
    """Register ``slot`` under its kind's name; returns it."""
    return SLOTS.register(getattr(slot, "name", None), slot, replace=replace)


def attach_outputs(model: nn.Module, outputs: Mapping[str, Mapping]) -> None:
    """Put ``outputs`` (``{kind: {path: value}}``) on ``model`` (each kind's ``attach``)."""
    for name, values in outputs.items():
        SLOTS[name].attach(model, values)


def read_outputs(model: nn.Module) -> dict:
    """``{kind: {path: value}}`` of the step outputs ``model`` carries (kinds without any left out)."""
    return {name: values for name, slot in SLOTS.items() if (values := slot.read(model))}


def records(outputs: Mapping[str, Mapping]) -> dict:
    """``{kind: record}``: what a checkpoint's ``quantization_config`` records of ``outputs``."""
    return {name: SLOTS[name].record(values) for name, values in outputs.items() if values}


def output_tensors(outputs: Mapping[str, Mapping]) -> dict:
    """The stored tensors ``{name: tensor}`` of ``outputs`` (a :class:`~bridge.tree.Quantized` result's)."""
    return {n: t for name, values in outputs.items() for n, t in SLOTS[name].tensors(values).items()}


def output_bytes(model: nn.Module) -> dict:
    """``{kind: bytes}`` of the stored tensors of the step outputs ``model`` carries."""
    return {name: sum(t.numel() * t.element_size() for t in SLOTS[name].tensors(values).values())
            for name, values in read_outputs(model).items()}


def output_parts(like: nn.Module, recorded: Mapping[str, Mapping], entries: Mapping) -> dict:
    """``{stored name: (shape, dtype)}`` of the tensors the ``recorded`` outputs (``{kind: record}``) store."""
    return {n: v for name, rec in recorded.items() for n, v in SLOTS[name].parts(like, rec, entries).items()}


def take_outputs(tree: dict, recorded: Mapping[str, Mapping]) -> dict:
    """``{kind: {path: value}}`` popped from a read ``tree`` (each kind's ``take``)."""
    return {name: SLOTS[name].take(tree, rec) for name, rec in recorded.items()}


def abstract_outputs(model: nn.Module, recorded: Mapping[str, Mapping]) -> None:
    """Empty values of the ``recorded`` outputs on ``model`` for a checkpoint's tensors to fill (transformers)."""
    for name, rec in recorded.items():
        slot = SLOTS[name]
        if slot.abstract is None:
            raise ValueError(f"{slot.label} ({name!r}) load with bridge.load, not through transformers")
        slot.abstract(model, rec)

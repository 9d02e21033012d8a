"""What a streamed run accepts, decided before anything is read but headers and ``config.json``: the one
pre-run check of :func:`bridge.stream.quantize_checkpoint`, and what ``qtransform quantize`` asks to choose its
driver.

:func:`accepted_run` builds the model's skeleton from ``config.json`` (weights on ``meta``), maps the stored tensors to
it, checks them against it and plans the recipe (:func:`bridge.pipeline.prepare`, the pre-run check of both
drivers). What the streamed driver cannot do but the in-memory one can is a :class:`CannotStream`
(a ``ValueError``) naming the part and the reason: a quantized input, a step that learns on the whole model's
loss or changes tensors across the whole model together, low-rank corrections, a rotation or a static
activation quantizer that does not fit one decoder block. Every other problem (a recipe that selects nothing,
a missing tensor) is the error the in-memory run would give too.
"""

from __future__ import annotations

from typing import NamedTuple

import qtransform as qt
from torch import nn

from .. import pipeline
from ..calibrate.blocks import find_stacks
from ..step_outputs import SLOTS
from . import skeleton as skel
from .inventory import Inventory, check_rules, take
from .source import Source

__all__ = ["CannotStream", "Accepted", "accepted_run"]


class CannotStream(ValueError):
    """A run the streamed driver cannot do (the in-memory driver can): the message names the part and why."""


class Accepted(NamedTuple):
    """What :func:`accepted_run` found: the ``src`` tensors mapped to ``model`` (the skeleton on ``meta``), its
    ``shapes`` and ``tied`` tensors, the ``plan``, and whether the run goes ``tensor_run`` (shard to shard)
    or block by block."""

    src: Source
    model: nn.Module
    shapes: dict
    tied: dict
    plan: qt.Plan
    tensor_run: bool
    inventory: Inventory  # each stored tensor loaded or carried (:mod:`.inventory`)

    @property
    def mode(self) -> str:
        return "shard to shard" if self.tensor_run else "block by block"


def accepted_run(source, recipe, *, calibrated: bool, model_class=None) -> Accepted:
    """The checks and the plan of a streamed run of ``recipe`` on checkpoint directory ``source`` (a path or a
    :class:`~bridge.stream.Source`), with calibration data or not: :class:`CannotStream` for what only the
    in-memory driver does, ``ValueError``/``CheckpointError`` for what neither does."""
    src = source if isinstance(source, Source) else Source(source)
    qc = src.config().get("quantization_config")
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        raise CannotStream(f"{src.root} holds a quantized checkpoint (quantization_config, quant_method "
                           f"{method!r}); a streamed run reads float checkpoints: quantize it in memory "
                           "(--in-memory; its values are dequantized first)")
    model = skel.build(src.root, model_class)
    src.map_to(model)  # stored names -> the model's (transformers' conversion mapping: stacked experts...)
    shapes, tied = skel.model_tensors(model, src)
    src.check_against(shapes, tied)
    inventory = take(src, model)
    p = plan_streamed(model, recipe, calibrated=calibrated)
    check_rules(p.recipe, inventory.carried)
    tensor_run = qt.pipeline.tensor_by_tensor(p) and not calibrated
    if not tensor_run:
        stacks = find_stacks(model)
        why = qt.pipeline.block_by_block_refusal(p, stacks[0]) if len(stacks) == 1 else (
            f"{type(model).__name__} calibrates two stacks of blocks, its encoder's ({stacks[0][0]}...) then its "
            f"decoder's ({stacks[1][0]}...) on the encoder's output")
        if why is not None:
            raise CannotStream(f"{why}; a streamed run quantizes one block at a time: quantize in memory "
                               "(--in-memory) on a machine the model fits")
    return Accepted(src, model, shapes, tied, p, tensor_run, inventory)


def plan_streamed(model: nn.Module, recipe, *, calibrated: bool) -> qt.Plan:
    """``recipe`` planned on ``model`` with the checks of both drivers, then the steps a streamed run cannot
    take refused as :class:`CannotStream`."""
    p = pipeline.prepare(model, recipe, calibrated=calibrated)
    for i, s in enumerate(p.steps):
        for kind in qt.get_algorithm(s.name).outputs:  # outputs a streamed run does not write: refused, never dropped
            slot = SLOTS.get(kind)
            if slot is None or not slot.streams:
                raise CannotStream(f"recipe.steps[{i}] ({s.name}): {slot.label if slot else repr(kind) + ' outputs'} "
                                   "are not written by a streamed run; quantize in memory (--in-memory)")
    return p

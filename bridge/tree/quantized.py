"""What the pipeline made of a model: :class:`Quantized`, the one value that :func:`bridge.to_module`
turns into a model and :func:`bridge.save` writes, so that the quantized tree travels with what it
needs at run time (its plan, activation quantizers and online rotations) instead of one keyword
per feature.

>>> import torch, qtransform as qt
>>> from bridge.tree import Quantized, extract
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 32))
>>> params = extract(model)
>>> r = Quantized(params, qt.quantize_tree(params, qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))))
>>> sorted(r.changed()), type(r.changed()["0.weight"]).__name__
(['0.weight'], 'QTensor')
"""

from __future__ import annotations

from typing import NamedTuple

import qtransform as qt

__all__ = ["Quantized", "Written"]


class Written(NamedTuple):
    """Where a streamed run's quantized tree went (:func:`bridge.stream.quantize_checkpoint`): the checkpoint
    ``directory``, bytes read and written, seconds, the units a resumed run found done, the ``mode``
    (``"shard to shard"`` or ``"block by block"``) and the stored tensors ``carried`` as they are (the model does
    not load them: :mod:`bridge.stream.inventory`)."""

    directory: str
    bytes_in: int
    bytes_out: int
    seconds: float
    resumed: int
    mode: str
    carried: tuple = ()


class Quantized(NamedTuple):
    """What the pipeline made of a model: the tree before (``params``, the model's own tensors), the
    quantized tree after the steps (``qtree``), the ``plan``, and the activation quantizers
    (``{Site: dynamic QuantSpec | calibrated QParams}``), what the steps reported (``info``:
    ``{path: {name: value}}``, e.g. GPTQ's layer losses), and the online rotations the quantized tree
    expects at run time (``online``: ``{Site: OnlineRotation}``, the ``rotate`` step's ``R3``/``R4``), and the
    step outputs that run beside its tensors (``outputs``: ``{kind: {path: value}}``, :mod:`bridge.step_outputs`).

    :func:`bridge.to_module` ``(model, result)`` builds the quantized model from it (for
    :func:`bridge.quantize` and the ``qtransform`` command alike); :func:`bridge.save` writes it.

    The one result of both drivers: a streamed run (:func:`bridge.stream.quantize_checkpoint`) returns it too,
    with the same plan, activation quantizers, reports and rotations, its trees left empty (its tensors never
    were in memory at once) and ``written`` saying where they went (:class:`Written`; ``None`` in memory).
    """

    params: dict
    qtree: dict
    plan: qt.Plan | None = None
    activations: dict = {}
    info: dict = {}
    online: dict = {}
    outputs: dict = {}
    written: Written | None = None

    def changed(self) -> dict:
        """``{path: value}`` of the leaves of ``qtree`` that are not the very tensors of ``params``: the
        quantized weights and the tensors a step rewrote (a smoothed norm, a rotated embedding)."""
        if self.written is not None:
            raise ValueError(f"this result of a streamed run holds no tensors: they are in {self.written.directory} "
                             "(bridge.load it)")
        params = self.params or {}
        return {p: v for p, v in qt.flatten_tree(self.qtree).items() if v is not params.get(p)}

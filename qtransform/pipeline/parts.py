"""A plan run one part of a model at a time (a decoder block, or the tensors outside the blocks): the rules
of a streamed run, on plain data (a plan and the blocks' tree paths), so that any driver applies the same ones.

* :func:`tensor_by_tensor`: every step fits one tensor at a time without data, so the run goes tensor by
  tensor (shard to shard) when it has no calibration data either;
* :func:`block_by_block_refusal`: why a plan cannot run one block at a time (``None``: it can): a step that
  learns on the whole model's loss, or changes tensors across the model without being a rotation of the
  residual stream; a rotation whose norm feeds linears of another block; a static activation quantizer
  outside the blocks (its statistics come from the blocks' pass);
* :meth:`qtransform.rotation.ResidualLayout.restrict` gives a rotating step its block's part of the layout.

>>> import torch, qtransform as qt
>>> spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))
>>> plan = qt.Recipe(default=spec, steps=[qt.Step("gptq")]).plan({"layers.0.fc.weight": torch.empty(8, 64)})
>>> tensor_by_tensor(plan), block_by_block_refusal(plan, ["layers.0"])
(False, None)
"""

from __future__ import annotations

from typing import Sequence

from ..algorithms import ALGORITHMS, ModelLoss
from ..spec import Plan

__all__ = ["tensor_by_tensor", "rotates_block_by_block", "block_by_block_refusal"]


def tensor_by_tensor(plan: Plan) -> bool:
    """Every step of ``plan`` fits one tensor at a time without data."""
    return all(ALGORITHMS[s.name].one_tensor_at_a_time for s in plan.steps)


def rotates_block_by_block(name: str) -> bool:
    """Step ``name`` needs no data and rotates the residual stream (it ``requires`` the layout): it runs block
    by block on each block's part of the layout."""
    algo = ALGORITHMS[name]
    return algo.needs is None and not algo.local and "layout" in algo.requires


def block_by_block_refusal(plan: Plan, blocks: Sequence[str]) -> str | None:
    """Why ``plan`` cannot run one decoder block at a time, blocks being the tree paths ``blocks``
    (``model.layers.0``...), naming the step or the tensor; ``None`` when it can."""
    def block_of(path: str) -> str:
        return next((b for b in blocks if path.startswith(b + ".")), "")

    for i, s in enumerate(plan.steps):
        algo = ALGORITHMS[s.name]
        if isinstance(algo.needs, ModelLoss):
            return (f"recipe.steps[{i}] ({s.name}): learns on the whole model's loss, which a run one block at a "
                    "time never holds")
        if algo.needs is None and not algo.local and not rotates_block_by_block(s.name):
            return f"recipe.steps[{i}] ({s.name}): changes tensors across the whole model together"
    if plan.layout is not None and any(rotates_block_by_block(s.name) for s in plan.steps):
        split = [n.weight for n in plan.layout.norms if any(block_of(r) != block_of(n.weight) for r in n.readers)]
        if split:
            return f"rotations: norm {split[0]!r} feeds linears in another decoder block"
    outside = [f"{s.module} ({s.role})" for s, spec in plan.activations.items()
               if not spec.dynamic and not block_of(s.module)]
    if outside:
        return (f"static activation quantizer(s) {outside[:3]} sit outside the decoder blocks "
                f"({blocks[0] if blocks else 'none'}...), whose pass calibrates them")
    return None

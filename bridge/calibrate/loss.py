"""The model's loss on calibration data as a differentiable function of its tree (for
:class:`qtransform.ModelLoss` steps: SpinQuant).

``CalibrationLoss(model, batches, plan)(params, i)`` runs ``model`` on batch ``i`` through
``torch.func.functional_call`` with its tensors taken from ``params`` and returns the model's own
loss: transformers' causal-LM cross-entropy, the batch's token ids as labels (a dict batch's
``labels`` when it has them). While it runs, the plan's activation quantizers fake-quantize the
inputs (and outputs) of their modules with straight-through gradients, with parameters fitted to
each activation, the gradient flowing through their scales as well (a static spec is fitted per
batch: its scales are calibrated after the step), and the online rotations are in place
(:mod:`bridge.modules.online`). The model itself is not changed.
"""

from __future__ import annotations

import contextlib
from typing import Mapping

import torch
from torch import nn

import qtransform as qt

from ..modules.actquant import activation_view
from ..modules.online import installed
from .sites import evaluating, run_batch, takes

__all__ = ["CalibrationLoss", "quantizing_activations"]


def _fake(module: nn.Module, x: torch.Tensor, spec: qt.QuantSpec) -> torch.Tensor:
    """``x`` fake-quantized as the quantized modules view it (:func:`~bridge.modules.actquant.activation_view`),
    parameters fitted to it (the gradient flows through the fitted scale too, as a function of the
    activation's range)."""
    m = activation_view(module, x)
    return qt.fake_quantize(m, qt.choose_qparams(m.detach(), spec), range_grad=True).reshape(x.shape)


@contextlib.contextmanager
def quantizing_activations(model: nn.Module, plan: qt.Plan):
    """Within the block, the plan's input/output activation specs fake-quantize their modules' activations
    (straight-through gradients; key/value sites are left to the attention modules' own quantizers)."""
    handles = []
    try:
        modules = dict(model.named_modules())
        for site, spec in plan.activations.items():
            module = modules.get(site.module)
            if module is None:  # a stacked experts weight's input, inside the experts forward: left float here
                continue
            if site.role == "input":
                handles.append(module.register_forward_pre_hook(
                    lambda m, args, kwargs, spec=spec: ((_fake(m, args[0], spec), *args[1:]), kwargs)
                    if args and isinstance(args[0], torch.Tensor) else None, with_kwargs=True))
            elif site.role == "output":
                handles.append(module.register_forward_hook(
                    lambda m, args, out, spec=spec: _fake(m, out, spec) if isinstance(out, torch.Tensor) else None))
        yield model
    finally:
        for h in handles:
            h.remove()


class CalibrationLoss:
    """The loss on each calibration batch (see the module docstring); ``len()`` is the number of batches."""

    def __init__(self, model: nn.Module, batches, plan: qt.Plan, *, online: Mapping | None = None):
        if not takes(model, "labels"):
            raise ValueError(f"{type(model).__name__} computes no loss from labels (its forward takes no `labels`): "
                             "learning rotations needs a language model's loss, e.g. a ...ForCausalLM")
        self.model, self.plan, self.online = model, plan, dict(online or {})
        self.batches = list(batches)
        if not self.batches:
            raise ValueError("calibration: no batches (the calibration data is empty or already consumed)")

    def __len__(self) -> int:
        return len(self.batches)

    def _labelled(self, i: int):
        batch = self.batches[i]
        if isinstance(batch, torch.Tensor):
            return {"input_ids": batch, "labels": batch}
        if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
            return {"labels": batch["input_ids"], **batch}
        raise TypeError(f"calibration batch {i}: learning on the model's loss needs token ids (a tensor, or a dict "
                        f"with input_ids), got {type(batch).__name__}")

    def __call__(self, params: Mapping[str, torch.Tensor], i: int, *, online: Mapping | None = None) -> torch.Tensor:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.batches):
            raise IndexError(f"calibration loss: batch {i!r} out of range [0, {len(self.batches)})")
        with evaluating(self.model), installed(self.model, {**self.online, **(online or {})}), \
                quantizing_activations(self.model, self.plan):
            out = run_batch(self.model, params, self._labelled(i))
        loss = getattr(out, "loss", None)
        if not isinstance(loss, torch.Tensor):
            raise ValueError(f"{type(self.model).__name__} returned no loss for calibration batch {i}")
        return loss

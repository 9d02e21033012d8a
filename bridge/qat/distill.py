"""Distillation from the float teacher: the quantized student's next-token distribution pulled toward the
teacher's (``learn.kl_to_teacher``), optionally each block's hidden states toward the teacher's
(``learn.hidden_mse``, relative). The losses are the core's pure tensor functions; this module reads them
off transformers' model outputs.

>>> import torch
>>> t = torch.randn(2, 5, 11)
>>> float(distill_loss(t, t))
0.0
"""

from __future__ import annotations

import torch

from qtransform import learn

__all__ = ["distill_loss"]


def _part(output, name: str, what: str):
    if name == "logits" and isinstance(output, torch.Tensor):
        return output
    value = getattr(output, name, None)
    if value is None and isinstance(output, dict):
        value = output.get(name)
    if value is None:
        raise TypeError(f"{what}: expected logits (a tensor) or a model output with .{name}"
                        + (" (call the model with output_hidden_states=True)" if name == "hidden_states" else "")
                        + f", got {type(output).__name__}")
    return value


def distill_loss(student, teacher, *, temperature: float = 1.0, mask: torch.Tensor | None = None,
                 hidden_weight: float = 0.0) -> torch.Tensor:
    """``T² · KL(teacher || student)`` of the next-token distributions, averaged over the positions ``mask``
    keeps (an attention mask ``(batch, seq)``; all by default), plus ``hidden_weight`` times the mean over
    layers of the relative hidden-state error (``learn.hidden_mse(..., normalize=True)``).

    Args:
        student: the prepared model's logits ``(..., vocab)`` or its output (``.logits``; ``.hidden_states``
            too when ``hidden_weight`` > 0).
        teacher: the float model's, computed under ``torch.no_grad()`` (a constant target).
        temperature: softmax temperature ``T``.
        mask: ``(...)`` position weights, 0 for padding.
        hidden_weight: weight of the hidden-state term (0: logits only).
    """
    if isinstance(hidden_weight, bool) or not isinstance(hidden_weight, (int, float)) or hidden_weight < 0:
        raise ValueError(f"hidden_weight must be a number >= 0, got {hidden_weight!r}")
    loss = learn.kl_to_teacher(_part(student, "logits", "student"), _part(teacher, "logits", "teacher"),
                               temperature=temperature, mask=mask)
    if hidden_weight:
        hs, ht = _part(student, "hidden_states", "student"), _part(teacher, "hidden_states", "teacher")
        if len(hs) != len(ht) or not hs:
            raise ValueError(f"student and teacher have {len(hs)} and {len(ht)} hidden states; distill a model "
                             "from its own float version")
        per_layer = [learn.hidden_mse(s, t, mask=mask, normalize=True) for s, t in zip(hs, ht)]
        loss = loss + hidden_weight * torch.stack(per_layer).mean()
    return loss

"""Losses of quantization-aware training, as pure tensor functions: a float teacher's next-token distribution
distilled into the quantized student (:func:`kl_to_teacher`), and a block's hidden states matched to the
teacher's (:func:`hidden_mse`).

Both average over *positions* (every axis but the last), optionally weighted by a ``mask`` of those axes'
shape (an attention mask: padding does not count); gradients flow to both arguments as the formulas say, so a
teacher computed under ``torch.no_grad`` is a constant target.

>>> import torch
>>> from qtransform import learn
>>> t = torch.tensor([[2.0, 0.0, -1.0]])
>>> float(learn.kl_to_teacher(t, t))
0.0
>>> round(float(learn.kl_to_teacher(torch.zeros(1, 3), t)), 4)  # KL(p_t || uniform) = log 3 - H(p_t)
0.5743
"""

from __future__ import annotations

import torch

from .._checks import check_float_tensor

__all__ = ["kl_to_teacher", "hidden_mse"]


def _pair(student: torch.Tensor, teacher: torch.Tensor, names: tuple[str, str]) -> None:
    check_float_tensor(student, name=names[0])
    check_float_tensor(teacher, name=names[1])
    if student.shape != teacher.shape:
        raise ValueError(f"{names[0]} {tuple(student.shape)} and {names[1]} {tuple(teacher.shape)} differ in shape")
    if student.dim() < 1 or student.shape[-1] < 1:
        raise ValueError(f"{names[0]}: expected (..., features) with at least one feature, got {tuple(student.shape)}")


def _mean(per_position: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean of ``per_position`` (shape = the positions' axes), weighted by ``mask`` (same shape) when given."""
    if mask is None:
        return per_position.mean()
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(per_position.shape):
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not match the positions {tuple(per_position.shape)} "
                         "(every axis of the logits but the last)")
    w = mask.to(per_position.dtype)
    return (per_position * w).sum() / w.sum().clamp(min=1)


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, temperature: float = 1.0,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """``T² · mean over positions of KL(p_teacher || p_student)`` with ``p = softmax(logits / T)`` (Hinton's
    distillation loss; ``T²`` keeps its gradient's scale independent of ``T``). Float32 math whatever the
    inputs' dtype; a scalar. Logits ``(..., vocab)``; ``mask`` ``(...)`` weights the positions (0: ignored).

    >>> import torch
    >>> s, t = torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 0.0]])
    >>> p = torch.softmax(t, -1)
    >>> bool(torch.isclose(kl_to_teacher(s, t), (p * (p.log() - torch.log_softmax(s, -1))).sum()))
    True
    """
    _pair(student_logits, teacher_logits, ("student_logits", "teacher_logits"))
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    t = float(temperature)
    log_s = torch.log_softmax(student_logits.to(torch.float32) / t, dim=-1)
    log_t = torch.log_softmax(teacher_logits.to(torch.float32) / t, dim=-1)
    kl = (log_t.exp() * (log_t - log_s)).sum(dim=-1)
    return _mean(kl, mask) * (t * t)


def hidden_mse(student: torch.Tensor, teacher: torch.Tensor, *, mask: torch.Tensor | None = None,
               normalize: bool = False) -> torch.Tensor:
    """Mean over positions of the squared error of hidden states ``(..., features)``, averaged over features
    (float32 math; a scalar). ``normalize=True``: divided by the teacher's mean square over the same positions
    (a relative error, comparable across blocks whose residual streams grow). ``mask`` ``(...)`` as in
    :func:`kl_to_teacher`.

    >>> import torch
    >>> float(hidden_mse(torch.ones(2, 4), torch.zeros(2, 4)))
    1.0
    """
    _pair(student, teacher, ("student", "teacher"))
    s, t = student.to(torch.float32), teacher.to(torch.float32)
    err = _mean((s - t).square().mean(dim=-1), mask)
    if normalize:
        err = err / _mean(t.square().mean(dim=-1), mask).clamp(min=torch.finfo(torch.float32).tiny)
    return err

"""Codes of two runs of one step (CPU and CUDA) compared up to *near-ties*.

A rounding step maps a weight ``w`` to the code ``k = round(v)`` of its pre-rounding value
``v = w / s + z`` (``s``, ``z``: the element's scale and zero point). Two devices compute ``v`` with
float32 operations whose results may differ in the last bits (reductions in another order, fused
multiply-adds); a code can then differ only where ``v`` is that close to a rounding boundary. So:

**near-tie** (of a code that differs between a reference run ``a`` and another run ``b``, judged with the
reference's ``s``, ``z``): the two codes are neighbours (``|k_a - k_b| = 1``) and ``v`` lies within
``rtol * (1 + |v| + 2|z|)`` of their midpoint ``(k_a + k_b) / 2`` (``|v| + 2|z| >= |w / s| + |z|``: the
magnitudes whose float32 rounding moves ``v``).

``rtol`` states how far the two runs' ``v`` may be apart, relative: a few float32 ulps (``2**-23`` each)
where ``v`` comes from the same weight through correctly rounded operations (RTN: ``amax`` exact, one
division correctly rounded on both devices, at most one fused multiply-add on CUDA where the CPU rounds
twice: ``1e-6``, 8 ulps); more where the parameters come through reductions of many terms (HQQ's float32
group sums over 64 elements, iterated: ``1e-5``).

Steps with error feedback or searches (GPTQ, AWQ, rotations learned by SpinQuant) are not compared code by
code: one near-tie flipped there changes what follows (the rest of that row in GPTQ), so their tests bound
the fraction of equal codes and the output error instead (see ``calibrate/test_steps_cuda.py``).
"""

from __future__ import annotations

import torch

import qtransform as qt
from qtransform.algorithms.gptq_math import _element

__all__ = ["element_params", "codes", "unexplained", "equal_fraction"]


def element_params(q: qt.QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 scale and zero point (code domain: ``k = w / s + z``) of every element of ``q``, in its shape."""
    s, z = _element(q.qparams, tuple(q.shape))
    s = s.T.reshape(q.shape)
    return s, torch.zeros_like(s) if z is None else z.T.reshape(q.shape)


def codes(q: qt.QTensor, params=None) -> torch.Tensor:
    """The integer codes of ``q`` (float32 holding integers), read from its dequantized values on the grid of
    ``params`` (default: its own; an affine format)."""
    s, z = element_params(q) if params is None else params
    return torch.round(qt.dequantize(q).to(torch.float32).cpu() / s.cpu() + z.cpu())


def unexplained(w: torch.Tensor, a: qt.QTensor, b: qt.QTensor, *, rtol: float) -> torch.Tensor:
    """Mask of the codes of ``b`` that differ from the reference ``a``'s and are no near-tie of ``w`` (see the
    module docstring); ``w`` the weight both quantized."""
    s, z = (t.cpu() for t in element_params(a))
    v = w.detach().to(torch.float32).cpu() / s + z
    ka, kb = codes(a, (s, z)), codes(b, (s, z))
    tie = ((ka - kb).abs() == 1) & ((v - (ka + kb) / 2).abs() <= rtol * (1 + v.abs() + 2 * z.abs()))
    return (ka != kb) & ~tie


def equal_fraction(qa: dict, qb: dict) -> float:
    """The fraction of equal codes over every QTensor of two trees of equal keys (each read on its own grid)."""
    same = total = 0
    for p, a in qa.items():
        if isinstance(a, qt.QTensor):
            ka, kb = codes(a), codes(qb[p])
            same += int((ka == kb).sum())
            total += ka.numel()
    return same / max(total, 1)

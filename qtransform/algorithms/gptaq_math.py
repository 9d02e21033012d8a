"""GPTAQ (Li, Yin and Panda, 2025, "GPTAQ: Efficient Finetuning-Free Quantization for Asymmetric
Calibration"; GPTQModel's ``gptaq``, first published as "GPTQ v2"): GPTQ aimed at the float model.

GPTQ fits ``Q`` to ``min ‖(Q − W) X̃‖²`` where ``X̃`` ``(n, in)`` are the layer's inputs with the earlier
blocks (and layers) already quantized: the error those made is taken as given. GPTAQ fits the float
model's outputs for the same tokens instead, ``min ‖Q X̃ − W X‖²`` with ``X`` the float model's inputs,
so each layer also works against the error that reached it. Write ``ΔX = X − X̃`` and

* ``H = X̃ᵀX̃ / n`` (GPTQ's Hessian, on the quantized path) and the cross statistic
  ``D = ΔXᵀ X̃ / n`` ``(in, in)`` (GPTQModel's ``dXXᵀ``; :func:`cross`), from the same tokens;
* when column ``i`` is quantized (``q_i`` from the current ``w_i``), what it leaves undone is
  ``(q_i − w_i) x̃_i − w_i Δx_i``: GPTQ's term and the column's own share of the asymmetry. The
  columns not yet quantized (``F``) absorb both by least squares on ``X̃_F``:
  ``W_F ← W_F − e_i U_{i,F} + α · w_i P_{i,F}`` with ``e_i = (w_i − q_i) / U_ii`` as in GPTQ and
  ``P_{i,F} = D_{i,F} (H_FF)⁻¹``;
* all rows of ``P`` from one product (:func:`asymmetric_term`): with ``U`` the upper Cholesky factor of
  ``H⁻¹`` (``H⁻¹ = UᵀU``), ``(H_FF)⁻¹ = U_FFᵀ U_FF`` for every trailing set ``F``, so
  ``P = triu(D Uᵀ, 1) · U`` (strictly upper triangular).

``α`` scales the asymmetric term: the official implementation and GPTQModel use ``α = 0.25`` (the
paper's equation has none, i.e. 1). ``α = 0`` or ``X̃ = X`` (``D = 0``) is GPTQ exactly. ``w_i`` is the
column before rounding (with every update of the columns before it); the lazy batch updates of the
solver use these values for the columns beyond each block as well, so the result does not depend on
``block_size`` (GPTQModel's lazy batch multiplies by the rounded columns there instead).

>>> import torch
>>> from qtransform.algorithms.gptaq_math import asymmetric_term, cross
>>> g = torch.Generator().manual_seed(0)
>>> x = torch.randn(64, 4, generator=g, dtype=torch.float64)
>>> xq = x + 0.1 * torch.randn(64, 4, generator=g, dtype=torch.float64)
>>> H, D = xq.T @ xq / 64, cross(x, xq) / 64
>>> U = torch.linalg.cholesky(torch.linalg.inv(H), upper=True)  # H⁻¹ = UᵀU
>>> P = asymmetric_term(D, U, alpha=1.0)
>>> row = D[0, 1:] @ torch.linalg.inv(H[1:, 1:])  # column 0 against the columns after it
>>> bool(torch.allclose(P[0, 1:].double(), row, rtol=1e-4)), bool((P.tril() == 0).all())
(True, True)
"""

from __future__ import annotations

import torch

from .._checks import check_finite, where

__all__ = ["cross", "asymmetric_term", "check_alpha", "check_cross"]


def cross(x: torch.Tensor, x_quantized: torch.Tensor) -> torch.Tensor:
    """``(x − x̃)ᵀ x̃`` ``(in, in)`` of one batch: the float path's inputs ``x`` and the quantized path's
    ``x̃`` for the same tokens, each ``(..., in)`` (flattened to rows), in the inputs' dtype (float32
    at least). Summed over batches and divided by the rows, it is GPTAQ's ``D``."""
    if not isinstance(x, torch.Tensor) or not isinstance(x_quantized, torch.Tensor):
        raise TypeError(f"gptaq: cross takes two tensors, got {type(x).__name__} and {type(x_quantized).__name__}")
    if x.shape != x_quantized.shape or x.dim() < 1:
        raise ValueError(f"gptaq: the float and quantized inputs must have one shape (the same tokens), got "
                         f"{tuple(x.shape)} and {tuple(x_quantized.shape)}")
    dtype = torch.promote_types(torch.promote_types(x.dtype, x_quantized.dtype), torch.float32)
    xq = x_quantized.detach().reshape(-1, x.shape[-1]).to(dtype)
    return (x.detach().reshape(-1, x.shape[-1]).to(dtype) - xq).T @ xq


def check_alpha(alpha, *, path: str | None = None) -> float:
    """``alpha`` as a float: a finite number ``>= 0``."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha < float("inf"):
        raise ValueError(f"{where(path)}gptaq: alpha must be a finite number >= 0, got {alpha!r}")
    return float(alpha)


def check_cross(D, width: int, *, path: str | None = None) -> None:
    """``D`` must be a finite floating ``(width, width)`` tensor."""
    if not isinstance(D, torch.Tensor) or not D.is_floating_point() or tuple(D.shape) != (width, width):
        got = f"{tuple(D.shape)} {D.dtype}" if isinstance(D, torch.Tensor) else type(D).__name__
        raise ValueError(f"{where(path)}gptaq: cross must be a floating ({width}, {width}) tensor "
                         f"(ΔXᵀX̃ / n for the weight's inputs), got {got}")
    check_finite(D, name="cross", path=path)


def asymmetric_term(D: torch.Tensor, U: torch.Tensor, *, alpha: float = 0.25, perm: torch.Tensor | None = None,
                    dead: torch.Tensor | None = None) -> torch.Tensor:
    """``α · triu(D Uᵀ, 1) · U`` ``(in, in)`` float32: row ``i`` is ``α D_{i,F} (H_FF)⁻¹`` on the columns
    ``F`` after ``i`` (zero elsewhere), the asymmetric part of GPTAQ's update of those columns per unit of
    ``w_i``.

    Args:
        D: ``(in, in)`` cross statistic ``ΔXᵀX̃ / n`` in the inputs' own order (not modified).
        U: the upper Cholesky factor of the damped ``H⁻¹`` in processing order (what
            :func:`~qtransform.algorithms.gptq_math.inverse_hessian_factor` gives).
        alpha: the scale of the term (``>= 0``).
        perm: the processing order (``act_order``); ``D`` is gathered to it here.
        dead: ``(in,)`` mask of dead inputs (in the inputs' own order): their columns of ``D`` are cleared,
            as their weights are.
    """
    alpha = check_alpha(alpha)
    D = D.detach().to(torch.float64)
    if dead is not None and bool(dead.any()):
        D = D.clone()
        D[:, dead] = 0
    if perm is not None:
        D = D[perm[:, None], perm]
    U64 = U.to(torch.float64)
    return (alpha * torch.triu(D @ U64.T, diagonal=1) @ U64).to(torch.float32)

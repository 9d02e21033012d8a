"""Optimisation over orthogonal matrices: Cayley SGD with momentum (Li, Fuxin & Todorovic, ICLR 2020),
the optimiser SpinQuant learns its rotations with.

One step from an orthogonal ``X`` with Euclidean gradient ``G`` and momentum ``M``::

    M ← β M − G
    Ŵ = M Xᵀ − ½ X (Xᵀ M Xᵀ),   W = Ŵ − Ŵᵀ          (skew-symmetric: a tangent direction)
    M ← W X                                          (momentum kept in the tangent space)
    α = min(lr, 2q / (‖W‖ + ε))
    X ← (I − α/2 W)⁻¹ (I + α/2 W) X                  (the Cayley transform: exactly orthogonal)

Batched over leading axes (one step for a stack of matrices), pure (returns the new ``X`` and ``M``).

>>> import torch
>>> X = torch.eye(3, dtype=torch.float64)
>>> G = torch.tensor([[0.0, 1.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
>>> Y, M = cayley_sgd_step(X, G, torch.zeros_like(X), lr=0.1)
>>> bool(torch.allclose(Y @ Y.T, torch.eye(3, dtype=torch.float64))), bool((Y * G).sum() < (X * G).sum())
(True, True)
"""

from __future__ import annotations

import torch

__all__ = ["cayley_sgd_step", "skew_gradient"]


def skew_gradient(X: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """The skew-symmetric ``W = Ŵ − Ŵᵀ``, ``Ŵ = M Xᵀ − ½ X (Xᵀ M Xᵀ)``: ``W X`` is ``M`` projected on the
    tangent space of the orthogonal matrices at ``X``."""
    XT = X.transpose(-1, -2)
    W_hat = M @ XT - 0.5 * X @ (XT @ M @ XT)
    return W_hat - W_hat.transpose(-1, -2)


def cayley_sgd_step(X: torch.Tensor, G: torch.Tensor, M: torch.Tensor, *, lr: float, momentum: float = 0.0,
                    q: float = 0.5, eps: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """One Cayley SGD step (see the module docstring): ``(new X, new momentum)``. ``X`` orthogonal
    ``(..., n, n)``, ``G`` the loss's gradient at ``X``, ``M`` the momentum (zeros to start)."""
    if X.shape != G.shape or X.shape != M.shape or X.dim() < 2 or X.shape[-1] != X.shape[-2]:
        raise ValueError(f"cayley_sgd_step: X, G and M must be square matrices of one shape, got "
                         f"{tuple(X.shape)}, {tuple(G.shape)}, {tuple(M.shape)}")
    if not lr > 0 or not 0 <= momentum < 1:
        raise ValueError(f"cayley_sgd_step: lr must be > 0 and momentum in [0, 1), got {lr!r}, {momentum!r}")
    M = momentum * M - G.to(M.dtype)
    W = skew_gradient(X, M)
    M = W @ X
    norm = torch.linalg.matrix_norm(W).reshape(*W.shape[:-2], 1, 1)
    alpha = torch.clamp(2 * q / (norm + eps), max=lr)
    eye = torch.eye(X.shape[-1], dtype=X.dtype, device=X.device)
    Y = torch.linalg.solve(eye - alpha / 2 * W, (eye + alpha / 2 * W) @ X)
    return Y, M

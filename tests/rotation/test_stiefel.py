"""Cayley SGD keeps matrices exactly orthogonal and reaches the orthogonal Procrustes optimum, whose
closed form (U Vᵀ from the SVD of B Aᵀ) is the independent expected value."""

import pytest
import torch

from qtransform.rotation.stiefel import cayley_sgd_step, skew_gradient


def _procrustes(seed, n=16):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(n, 64, generator=g, dtype=torch.float64)
    Rt = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]
    if torch.linalg.det(Rt) < 0:  # the Cayley transform stays in SO(n), where it starts (the identity)
        Rt[:, 0] *= -1
    B = Rt @ A + 0.1 * torch.randn(n, 64, generator=g, dtype=torch.float64)
    U, _, Vh = torch.linalg.svd(B @ A.T)
    return A, B, U @ Vh


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_cayley_sgd_reaches_the_procrustes_optimum(momentum):
    A, B, best = _procrustes(0)
    X = torch.eye(16, dtype=torch.float64)
    M = torch.zeros_like(X)
    grad = torch.func.grad(lambda R: (R @ A - B).pow(2).sum())
    for _ in range(400):
        X, M = cayley_sgd_step(X, grad(X), M, lr=0.001, momentum=momentum)
        assert torch.allclose(X @ X.T, torch.eye(16, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(X, best, atol=1e-4)


def test_a_stack_takes_one_step_per_matrix():
    X = torch.stack([torch.linalg.qr(torch.randn(8, 8, dtype=torch.float64))[0] for _ in range(3)])
    G, M = torch.randn(3, 8, 8, dtype=torch.float64), torch.randn(3, 8, 8, dtype=torch.float64)
    Y, N = cayley_sgd_step(X, G, M, lr=0.05, momentum=0.5)
    for i in range(3):
        y, n = cayley_sgd_step(X[i], G[i], M[i], lr=0.05, momentum=0.5)
        assert torch.allclose(Y[i], y, atol=1e-12) and torch.allclose(N[i], n, atol=1e-12)


def test_the_step_is_skew_and_descends():
    X = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64))[0]
    G = torch.randn(6, 6, dtype=torch.float64)
    W = skew_gradient(X, -G)
    assert torch.allclose(W, -W.T)
    Y, _ = cayley_sgd_step(X, G, torch.zeros_like(X), lr=1e-4)
    assert (G * (Y - X)).sum() < 0  # first order: the linear loss <G, X> decreases


def test_bad_arguments_are_named():
    X = torch.eye(3)
    with pytest.raises(ValueError, match="square matrices of one shape"):
        cayley_sgd_step(X, torch.zeros(3, 4), X, lr=0.1)
    with pytest.raises(ValueError, match="lr must be > 0 and momentum in"):
        cayley_sgd_step(X, X, X, lr=0.0)

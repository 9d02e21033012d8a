"""Orthogonal matrices for rotations: randomised Hadamard matrices, and a fast fallback for orders
no Hadamard construction reaches.

* :func:`random_hadamard` ``(n, seed)``: ``diag(s) · H / sqrt(n)`` with random signs ``s`` (QuaRot's
  randomised Hadamard: the same outlier spreading, a different matrix per seed);
* :func:`orthogonal` ``(n, seed)``: that matrix when ``n`` has a Hadamard matrix, else
  ``H_a ⊗ Q_b`` with ``a`` the largest divisor of ``n`` that has one and ``Q_b`` a random orthogonal
  ``b x b`` block (QR of a Gaussian matrix, signs fixed): orthogonal, applied in ``O(n (log a + b))``;
  :func:`orthogonal_construction` names what was used.

>>> import torch
>>> R = orthogonal(156, seed=0)  # 156 = 4 · 39: no construction here
>>> bool(torch.allclose(R @ R.T, torch.eye(156), atol=1e-5)), orthogonal_construction(156)
(True, 'Hadamard 52 (Paley II (q=25)) x random orthogonal 3')
"""

from __future__ import annotations

import torch

from .constructions import hadamard, hadamard_construction, has_hadamard

__all__ = ["random_signs", "random_hadamard", "orthogonal", "orthogonal_construction", "random_orthogonal"]


def _generator(seed) -> torch.Generator:
    if isinstance(seed, torch.Generator):
        return seed
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int or a torch.Generator, got {type(seed).__name__}")
    return torch.Generator().manual_seed(seed)


def random_signs(n: int, seed=0, *, dtype=torch.float32) -> torch.Tensor:
    """``n`` random ±1 values (seeded)."""
    g = _generator(seed)
    return (torch.randint(0, 2, (n,), generator=g, device=g.device) * 2 - 1).to(dtype)


def random_hadamard(n: int, seed=0, *, dtype=torch.float32) -> torch.Tensor:
    """``diag(s) · hadamard(n)`` with random signs ``s``: orthogonal."""
    s = random_signs(n, seed, dtype=dtype)
    return s[:, None] * hadamard(n, dtype=dtype, device=s.device)


def random_orthogonal(n: int, seed=0, *, dtype=torch.float32) -> torch.Tensor:
    """A random orthogonal ``n x n`` matrix (Haar: QR of a Gaussian matrix, R's diagonal made positive)."""
    g = _generator(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64, device=g.device))
    d = torch.diagonal(r)
    return (q * torch.where(d < 0, -1.0, 1.0).to(q.dtype)).to(dtype).contiguous()


def _split(n: int) -> tuple[int, int]:
    """``(a, b)``: ``a`` the largest divisor of ``n`` with a Hadamard matrix, ``b = n / a``."""
    a = max(d for d in range(1, n + 1) if n % d == 0 and has_hadamard(d))
    return a, n // a


def orthogonal_construction(n: int) -> str:
    """What :func:`orthogonal` builds for order ``n``."""
    if has_hadamard(n):
        return f"randomised Hadamard ({hadamard_construction(n).construction})"
    a, b = _split(n)
    return f"Hadamard {a} ({hadamard_construction(a).construction}) x random orthogonal {b}"


def orthogonal(n: int, seed=0, *, dtype=torch.float32) -> torch.Tensor:
    """An orthogonal ``n x n`` matrix that spreads outliers: :func:`random_hadamard` where ``n`` has a
    Hadamard matrix, else ``random_hadamard(a) ⊗ random_orthogonal(b)`` (see the module docstring)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"orthogonal: n must be a positive int, got {n!r}")
    g = _generator(seed)
    if has_hadamard(n):
        return random_hadamard(n, g, dtype=dtype)
    a, b = _split(n)
    return torch.kron(random_hadamard(a, g, dtype=dtype), random_orthogonal(b, g, dtype=dtype))

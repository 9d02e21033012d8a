"""Hadamard matrices: for any order the constructions cover (drawn up to 4096), the normalised
matrix is orthogonal (HᵀH = I to 1e-5 on rows drawn at random, all of them up to 1024), and the fast
transform is linear, norm-preserving and equal to the product with the matrix."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from qtransform.rotation import hadamard, hadamard_transform, has_hadamard

COVERED = [n for n in range(1, 4097) if has_hadamard(n)]


@given(st.sampled_from(COVERED), st.integers(0, 2 ** 31 - 1))
def test_orthogonal(n, seed):
    g = torch.Generator().manual_seed(seed)
    H = hadamard(n)
    if n <= 1024:
        assert torch.allclose(H.T @ H, torch.eye(n), atol=1e-5)
    else:  # rows drawn at random against every row: the rows of the identity they are
        pick = torch.randperm(n, generator=g)[:64]
        assert torch.allclose(H[pick] @ H.T, torch.eye(n)[pick], atol=1e-5)


@given(st.sampled_from(COVERED), st.integers(0, 2 ** 31 - 1), st.floats(-4, 4))
def test_the_transform(n, seed, a):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(2, n, generator=g, dtype=torch.float64)
    T = hadamard_transform
    assert torch.allclose(T(a * x + y), a * T(x) + T(y), atol=1e-9)
    assert torch.allclose(T(x).norm(), x.norm(), rtol=1e-12)
    assert torch.allclose(T(x), x @ hadamard(n, dtype=torch.float64), atol=1e-9)

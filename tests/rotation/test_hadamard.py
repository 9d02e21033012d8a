"""Hadamard matrices of every order the constructions reach: entries ±1 and H Hᵀ = n I (checked
exactly, the integer identity being independent of how H was built), the fast transform equal to the
matrix product, and the fallback for orders no construction reaches."""

import math

import pytest
import torch

import qtransform as qt
from qtransform.rotation import (hadamard, hadamard_construction, hadamard_transform, has_hadamard, orthogonal,
                                 orthogonal_construction, random_hadamard)

#: hidden and intermediate widths of real models (SmolLM2, Qwen2 0.5B-72B, Llama 2/3, Mistral, Phi-3...)
WIDTHS = (576, 896, 1536, 2048, 3072, 3584, 4096, 4864, 5120, 5632, 8192, 8960, 11008, 13824, 14336, 18944, 27648,
          29568)


def _exact(n):
    H = hadamard(n, normalized=False)
    assert set(H.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(H @ H.T, n * torch.eye(n)), n  # sums of ±1 below 2^24: exact in float32


def test_every_covered_order_up_to_1024_is_a_hadamard_matrix():
    covered = [n for n in range(1, 1025) if has_hadamard(n)]
    assert {1, 2, 12, 20, 28, 36, 40, 52, 60, 108, 140, 148, 576} <= set(covered)
    assert all(n in (1, 2) or n % 4 == 0 for n in covered)
    assert len(covered) > 180  # all powers of two, every Paley order and their products
    for n in covered:
        _exact(n)


@pytest.mark.long  # ~40 s: make test-long
def test_every_covered_order_up_to_4096_is_a_hadamard_matrix():
    """Entries ±1 and H (Hᵀ v) = n v for 4 random ±1 vectors v (Freivalds: a matrix with H Hᵀ != n I
    passes each with probability at most 1/2; every partial sum is an integer of at most n^2 <= 2^24,
    so float32 is exact)."""
    g = torch.Generator().manual_seed(0)
    for n in range(1028, 4097, 4):
        if not has_hadamard(n):
            continue
        H = hadamard(n, normalized=False)
        assert bool(((H == 1) | (H == -1)).all()), n
        v = torch.randint(0, 2, (n, 4), generator=g).to(torch.float32) * 2 - 1
        assert torch.equal(H @ (H.T @ v), n * v), n


@pytest.mark.parametrize("n", WIDTHS)
def test_real_model_widths(n):
    """Every width above has a construction (Quark's K·2^m list lacks 18944 = 148·128): rows sampled
    through the fast transform are orthonormal, and the transform preserves norms."""
    assert has_hadamard(n), hadamard_construction(n)
    g = torch.Generator().manual_seed(n)
    rows = torch.randperm(n, generator=g)[:16]
    unit = torch.zeros(16, n, dtype=torch.float64)
    unit[torch.arange(16), rows] = 1  # torch.eye(n)[rows] without the n x n identity (7 GB at n = 29568)
    R = hadamard_transform(unit)
    assert torch.allclose(R @ R.T, torch.eye(16, dtype=torch.float64), atol=1e-12)
    x = torch.randn(4, n, generator=g, dtype=torch.float64)
    assert torch.allclose(hadamard_transform(x).norm(dim=-1), x.norm(dim=-1), rtol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 12, 36, 40, 144, 576, 1536, 2048])
def test_the_fast_transform_is_the_matrix_product(n):
    x = torch.randn(3, 5, n, dtype=torch.float64)
    H = hadamard(n, dtype=torch.float64)
    assert torch.allclose(hadamard_transform(x), x @ H, atol=1e-12)
    assert torch.allclose(hadamard_transform(x, normalized=False), x @ (H * math.sqrt(n)), atol=1e-9)


def test_the_transform_under_vmap_and_grad():
    n = 576
    x, c = torch.randn(7, n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    assert torch.allclose(torch.func.vmap(hadamard_transform)(x), hadamard_transform(x), atol=1e-12)
    grad = torch.func.grad(lambda v: (hadamard_transform(v) * c).sum())(x[0])
    assert torch.allclose(grad, hadamard(n, dtype=torch.float64) @ c, atol=1e-12)


def test_paley_constructions_are_named():
    assert hadamard_construction(576).construction == "2^4 x Paley II (q=17)"
    assert hadamard_construction(1536).construction == "2^7 x Paley I (q=11)"
    assert hadamard_construction(14336).construction == "2^9 x Paley I (q=27)"  # GF(27): a prime power field
    assert hadamard_construction(52).construction == "Paley II (q=25)"  # GF(25)
    assert hadamard_construction(8192).construction == "2^13"


@pytest.mark.parametrize("n", [92, 116, 156, 172, 188])
def test_orders_without_a_construction(n):
    with pytest.raises(ValueError, match=rf"no construction here reaches order {n} .*nearest covered orders "
                                         r"\[\d+, \d+\].*orthogonal\(n\)"):
        hadamard(n)
    R = orthogonal(n, seed=1)
    assert torch.allclose(R @ R.T, torch.eye(n), atol=1e-5)
    assert "random orthogonal" in orthogonal_construction(n)


def test_randomised_hadamard():
    a, b = random_hadamard(36, seed=0), random_hadamard(36, seed=1)
    assert torch.allclose(a @ a.T, torch.eye(36), atol=1e-6) and not torch.equal(a, b)
    assert torch.equal(a, random_hadamard(36, seed=0))
    assert torch.equal(a.abs(), hadamard(36).abs())
    assert torch.equal(orthogonal(36, seed=0), a)
    assert qt.hadamard is hadamard and qt.orthogonal is orthogonal


@pytest.mark.parametrize("bad", [0, -4, 2.0, True, "8"])
def test_bad_orders(bad):
    with pytest.raises(ValueError, match="n must be a positive int"):
        hadamard(bad)
    with pytest.raises(TypeError, match="floating point"):
        hadamard_transform(torch.ones(4, dtype=torch.int64))

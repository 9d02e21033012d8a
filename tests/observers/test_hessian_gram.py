"""The Hessian observer's Gram product: the blocked upper-triangle form equals ``xᵀx``."""

import pytest
import torch

import qtransform as qt
from qtransform.observers.hessian import gram


@pytest.mark.parametrize("d,split", [(7, 4), (1030, 1024), (64, 1024), (9, 1)])
def test_gram_equals_the_full_product(d, split):
    x = torch.randn(50, d, generator=torch.Generator().manual_seed(d), dtype=torch.float64)
    g = gram(x, split=split)
    assert g.shape == (d, d) and torch.allclose(g, x.T @ x, rtol=1e-12, atol=1e-10)


def test_wide_hessians_fold_batches_like_one():
    x = torch.randn(3, 40, 1100, generator=torch.Generator().manual_seed(0))
    s = qt.init_stats(observer="hessian")
    for b in x:
        s = qt.observe(s, b)
    flat = x.reshape(-1, 1100).double()
    assert int(s.count) == 120
    assert torch.allclose(qt.finalize_stats(s).double(), flat.T @ flat / 120, rtol=1e-4, atol=1e-4)

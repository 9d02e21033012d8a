"""Online rotations in the core: the block Hadamard transform equals a product with a dense block-diagonal
matrix, sizes fall back to the largest divisor with a Hadamard matrix, and steps' records combine."""

import pytest
import torch

import qtransform as qt
from qtransform.rotation import OnlineRotation, apply_online, check_online, online_hadamard


@pytest.mark.parametrize("n,size", [(1536, 1536), (18944, 18944), (100, 100), (196, 196), (156, 52), (6, 2),
                                    (7, 1), (576, 576)])
def test_the_online_size_is_the_whole_axis_or_its_largest_hadamard_divisor(n, size):
    assert online_hadamard(n) == OnlineRotation(size)


@pytest.mark.parametrize("n", [24, 156, 196])
def test_the_transform_is_a_product_with_a_block_diagonal_hadamard(n):
    rot = online_hadamard(n)
    blocks = n // rot.size
    H = torch.block_diag(*[qt.hadamard(rot.size, dtype=torch.float64)] * blocks)
    assert torch.allclose(H @ H.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    x = torch.randn(3, 5, n, dtype=torch.float64)
    assert torch.allclose(apply_online(x, rot), x @ H, atol=1e-12)
    w = torch.randn(7, n, dtype=torch.float64)  # x Wᵀ = (x H)(W H)ᵀ
    assert torch.allclose(apply_online(x, rot) @ apply_online(w, rot).T, x @ w.T, atol=1e-10)


def test_the_transform_works_under_vmap_and_grad():
    rot = online_hadamard(12)
    x = torch.randn(4, 12)
    assert torch.allclose(torch.func.vmap(lambda r: apply_online(r, rot))(x), apply_online(x, rot))
    g = torch.func.grad(lambda v: apply_online(v, rot).pow(2).sum())(x[0])
    assert torch.allclose(g, 2 * x[0], atol=1e-5)  # an orthogonal map keeps the norm


def test_bad_online_rotations_are_named():
    with pytest.raises(ValueError, match="size must be an order with a Hadamard matrix, got 6"):
        OnlineRotation.from_value({"kind": "hadamard", "size": 6})
    with pytest.raises(ValueError, match="kind must be one of"):
        OnlineRotation.from_value({"kind": "givens", "size": 4})
    with pytest.raises(ValueError, match=r"expected \{'kind'"):
        OnlineRotation.from_value([4])
    with pytest.raises(ValueError, match="here: an online rotation of size 8 does not divide the axis of width 12"):
        check_online(OnlineRotation(8), 12, "here")
    assert OnlineRotation.from_value(OnlineRotation(8).to_dict()) == OnlineRotation(8)


def test_fits_combine_their_online_rotations_and_refuse_two_at_one_site():
    a = qt.Fit(online={qt.Site("a", "input"): OnlineRotation(4)})
    b = qt.Fit(online={qt.Site("b", "key"): OnlineRotation(8)})
    assert a.then(b).online == {qt.Site("a", "input"): OnlineRotation(4), qt.Site("b", "key"): OnlineRotation(8)}
    with pytest.raises(ValueError, match="two online rotations"):
        a.then(a)
    with pytest.raises(TypeError, match="Fit.online must map qtransform.Site to OnlineRotation"):
        qt.Fit(online={"a": OnlineRotation(4)})
    leaves, _ = torch.utils._pytree.tree_flatten(a.then(b))  # static: no leaves
    assert leaves == []

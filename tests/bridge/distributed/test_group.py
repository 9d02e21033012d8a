"""``TorchParallel`` in a real 2-process gloo group, against the one-process folds; the shares and owners."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

import qtransform as qt
from bridge.distributed import share, share_bounds

sys.path.insert(0, str(Path(__file__).parent))
from dist_util import run_ranks  # noqa: E402

SPEC = qt.QuantSpec(format="int8", granularity=qt.PerChannel(-1))


def _data():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(5 + i, 6, generator=g) * (1 + 10 * (i == 2)) for i in range(4)]


def _observers():
    return {"minmax": lambda: qt.init_stats(SPEC), "percentile": lambda: qt.init_stats(SPEC, observer="percentile"),
            "hessian": lambda: qt.init_stats(observer="hessian"), "channel": lambda: qt.init_stats(observer="channel"),
            "rows": lambda: qt.algorithms.smoothquant_math.sample_stats(2)}


def _fold(make, xs):
    s = make()
    for x in xs:
        s = qt.observe(s, x)
    return s


def _bits(value):
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), value)


def _job(rank, world):
    from bridge.distributed import TorchParallel

    par = TorchParallel()
    xs = _data()
    mine = xs[:3] if rank == 0 else xs[3:]  # uneven shares, contiguous in rank order
    stats = {name: _fold(make, mine) for name, make in _observers().items()}
    stats["unseen"] = qt.init_stats(SPEC)  # no data on any rank: stays empty
    everywhere = par.reduce_stats(stats)
    owners = {name: i % world for i, name in enumerate(stats)}
    owned = par.reduce_stats(stats, owners)
    shared = par.share({k: torch.full((2,), 10.0 * rank + i) for i, k in enumerate("abc") if "abc".index(k) % world
                        == rank}, {k: "abc".index(k) % world for k in "abc"})
    return {"all": _bits(everywhere), "owned": _bits(owned), "shared": shared, "gather": par.gather(rank * 7),
            "sum": par.all_sum(torch.tensor([1.5, rank], dtype=torch.float64)),
            "owners": par.owners({"q": 8.0, "mlp": 20.0, "o": 5.0})}


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(2, _job)


def _same_stats(a, b, name):
    fa, sa = pytree.tree_flatten(a)
    fb, sb = pytree.tree_flatten(b)
    assert sa == sb, name
    for x, y in zip(fa, fb):
        assert x.dtype == y.dtype and torch.equal(x, y), name


def test_statistics_reduce_to_the_one_process_folds_on_every_rank(ranks):
    for name, make in _observers().items():
        expected = _fold(make, _data())
        for r in ranks:
            _same_stats(r["all"][name], expected, name)
        # and so do the results they are for
        torch.testing.assert_close(qt.finalize_stats(ranks[1]["all"][name]), qt.finalize_stats(expected), rtol=0, atol=0)
    assert qt.observers.is_empty(ranks[0]["all"]["unseen"]) and qt.observers.is_empty(ranks[1]["all"]["unseen"])


def test_owned_statistics_reach_their_owner_only(ranks):
    names = list(_observers()) + ["unseen"]
    for rank, r in enumerate(ranks):
        assert sorted(r["owned"]) == sorted(n for i, n in enumerate(names) if i % 2 == rank)
        for name in r["owned"]:
            if name != "unseen":
                _same_stats(r["owned"][name], _fold(_observers()[name], _data()), name)


def test_share_gather_sum_and_owners_are_the_same_on_every_rank(ranks):
    for r in ranks:
        assert {k: v.tolist() for k, v in r["shared"].items()} == {"a": [0.0, 0.0], "b": [11.0, 11.0], "c": [2.0, 2.0]}
        assert r["gather"] == [0, 7]
        assert r["sum"].tolist() == [3.0, 1.0]
        assert r["owners"] == {"q": 1, "mlp": 0, "o": 1}


@pytest.mark.parametrize("sizes, world", [([4] * 6, 2), ([8, 1, 1, 1, 1, 1, 1, 1, 1], 2), ([1, 9, 1, 1, 9], 3),
                                          ([5, 5, 5], 3), (list(range(1, 12)), 4)])
def test_shares_are_contiguous_balanced_and_never_empty(sizes, world):
    bounds = share_bounds(sizes, world)
    assert bounds[0] == 0 and bounds[-1] == len(sizes) and all(a < b for a, b in zip(bounds, bounds[1:]))
    parts = [share(list(range(len(sizes))), sizes, world, r) for r in range(world)]
    assert sum(parts, []) == list(range(len(sizes)))  # every batch once, in order
    # no boundary can move by one batch and bring both neighbouring loads closer to the ideal
    total = sum(sizes)
    cum = [sum(sizes[:b]) for b in bounds]
    for r in range(1, world):
        ideal = total * r / world
        for j in (bounds[r] - 1, bounds[r] + 1):
            if bounds[r - 1] < j < bounds[r + 1]:
                assert abs(cum[r] - ideal) <= abs(sum(sizes[:j]) - ideal)


def test_fewer_batches_than_ranks_names_both_counts():
    with pytest.raises(ValueError, match="2 calibration batch\\(es\\) for 3 ranks"):
        share_bounds([4, 4], 3)

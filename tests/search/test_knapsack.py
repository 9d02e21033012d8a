"""The multiple-choice knapsack against brute force: the least loss within the budget, on random small
problems (seeded), with the exact and the rounded-size tables; the front against brute force too."""

import itertools
import math
import random

import pytest
import torch

from qtransform.search import front, solve


def brute(items, budget):
    best = (math.inf, None)
    for choice in itertools.product(*[range(len(o)) for o in items]):
        size = sum(items[i][j][0] for i, j in enumerate(choice))
        loss = sum(items[i][j][1] for i, j in enumerate(choice))
        if size <= budget and loss < best[0]:
            best = (loss, choice)
    return best


def random_items(rng, *, scale=1):
    n = rng.randint(1, 5)
    return [[(scale * rng.randint(0, 40), round(rng.uniform(0, 10), 3)) for _ in range(rng.randint(1, 4))]
            for _ in range(n)]


@pytest.mark.parametrize("seed", range(60))
def test_exact_against_brute_force(seed):
    rng = random.Random(seed)
    items = random_items(rng, scale=rng.choice([1, 7, 96]))
    smallest = sum(min(s for s, _ in o) for o in items)
    budget = smallest + rng.randint(0, sum(max(s for s, _ in o) for o in items) - smallest + 5)
    s = solve(items, budget)
    want, _ = brute(items, budget)
    assert s.exact and s.bound == s.loss
    assert s.size <= budget
    assert s.size == sum(items[i][j][0] for i, j in enumerate(s.choice))
    assert s.loss == pytest.approx(want, abs=1e-9)


@pytest.mark.parametrize("seed", range(20))
def test_front_against_brute_force(seed):
    rng = random.Random(100 + seed)
    items = random_items(rng)
    top = sum(max(s for s, _ in o) for o in items)
    pts = front(solve(items, top))
    for bound, loss in pts:
        assert loss == pytest.approx(brute(items, bound)[0], abs=1e-9)
    # between two points of the front the least loss does not change
    for (b0, l0), (b1, _) in zip(pts, pts[1:]):
        assert brute(items, b1 - 1)[0] == pytest.approx(l0, abs=1e-9)


@pytest.mark.parametrize("seed", range(20))
def test_rounded_sizes_fit_the_budget(seed):
    """With a table too small for the exact sizes, sizes round up: the answer fits and is no better than exact."""
    rng = random.Random(200 + seed)
    items = random_items(rng)
    budget = sum(min(s for s, _ in o) for o in items) + rng.randint(0, 60)
    s = solve(items, budget, max_cells=4)
    want = brute(items, budget)[0]
    assert s.size <= budget
    assert s.bound - 1e-9 <= want <= s.loss + 1e-9  # the proven bracket holds the true optimum


def test_unit_is_the_gcd():
    s = solve([[(100, 3.0), (196, 1.0)], [(50, 2.0), (146, 0.5), (242, 0.0)]], 400)
    assert s.unit == 96 and s.exact and s.table.numel() == (400 - 150) // 96 + 1
    assert s.choice == (1, 1) and s.loss == 1.5


def test_budget_below_the_smallest_size_names_budget():
    with pytest.raises(ValueError, match="budget: 9 bytes is below the smallest possible size, 10 bytes"):
        solve([[(10, 1.0), (20, 0.0)]], 9)


@pytest.mark.parametrize("items, match", [([], "items"), ([[]], r"items\[0\]"), ([[(-1, 1.0)]], r"items\[0\]\[0\]"),
                                          ([[(1, float("nan"))]], "loss must be finite")])
def test_bad_items(items, match):
    with pytest.raises(ValueError, match=match):
        solve(items, 10)


def test_table_is_not_changed_by_solving_twice():
    items = [[(1, 1.0), (2, 0.0)]]
    a, b = solve(items, 2), solve(items, 2)
    assert torch.equal(a.table, b.table) and items == [[(1, 1.0), (2, 0.0)]]

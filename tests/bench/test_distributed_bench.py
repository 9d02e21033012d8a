"""bench_distributed's arithmetic (no model, no processes): the worker's exclusive timers and the projection's
cost models against the library's own (LPT owners, gptq.solve_cost)."""

import pathlib
import sys

import pytest
import torch

import qtransform as qt

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import distributed_projection as proj  # noqa: E402
import distributed_worker as worker  # noqa: E402


def test_timers_count_each_second_once(monkeypatch):
    clock = iter(range(100))
    monkeypatch.setattr(worker.time, "perf_counter", lambda: float(next(clock)))
    t = worker.Timers()
    inner = t.wrap("hessian", lambda: None)
    outer = t.wrap("forward", lambda: (inner(), inner()))
    outer()  # forward: clock 0 -> 5, hessian 1 -> 2 and 3 -> 4
    assert t.excl["hessian"] == 2.0 and t.excl["forward"] == 3.0
    assert t.calls["hessian"] == 2 and t.calls["forward"] == 1


def test_owners_and_costs_are_the_librarys():
    for cfg in (proj.SMOLLM2, proj.LLAMA3_8B):
        sets = proj.model_sets(cfg)
        costs = {s["name"]: s["cost"] for s in sets}
        for world in (1, 2, 3, 4, 8):
            assert proj.lpt_owners(list(costs.values()), world) == list(qt.parallel.lpt(costs, world).values())
    h, i, kv = 576, 1536, 192
    w = {"q": torch.empty(h, h), "k": torch.empty(kv, h), "v": torch.empty(kv, h), "down": torch.empty(h, i)}

    class Plan(dict):
        pass
    plan = Plan({p: type("M", (), {"module_type": "Linear"})() for p in w})
    from qtransform.algorithms.gptq import solve_cost
    sets = {s["name"]: s["cost"] for s in proj.model_sets(proj.SMOLLM2)}
    assert sets["q_proj+k_proj+v_proj"] == solve_cost(["q", "k", "v"], w, plan)
    assert sets["down_proj"] == solve_cost(["down"], w, plan)


def test_projection_splits_data_and_weights():
    rate = {"forward": 1e-12, "hessian": 0.0, "solve": 0.0, "init": 0.0, "comm": 0.0}
    one, four = (proj.project(rate, proj.LLAMA3_8B, 8192, n) for n in (1, 4))
    assert four["total"] == pytest.approx(one["total"] / 4)
    rate = {"forward": 0.0, "hessian": 0.0, "solve": 1e-12, "init": 0.0, "comm": 0.0}
    sets = proj.model_sets(proj.LLAMA3_8B)
    one, two = (proj.project(rate, proj.LLAMA3_8B, 8192, n) for n in (1, 2))
    down = next(s["cost"] for s in sets if s["name"] == "down_proj")
    assert two["solve_share"] == pytest.approx(down / sum(s["cost"] for s in sets))  # down_proj alone on a rank
    assert two["total"] == pytest.approx(one["total"] * two["solve_share"])
    assert proj.project({**rate, "comm": 1.0}, proj.SMOLLM2, 1, 1)["comm"] == 0.0

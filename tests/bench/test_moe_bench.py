"""bench_moe's quality measurement on a minimal Mixtral (1 layer, hidden 32, 4 experts, top 2): the routed inputs
against a hook on the experts module, the layer output error on hand-computed cases, the ratio medians, one
``measure`` run (ours only), and the peer runner's mapping of llm-compressor's per-expert Linears back to our
stacked ``(E, out, in)`` order."""

import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import bench_moe  # noqa: E402
import peer_llmcompressor_moe as peer  # noqa: E402

SHAPE = dict(layers=1, hidden=32, experts=4, inter=32, top=2)
PATH = "model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def tiny():
    model = bench_moe._model("mixtral", vocab=64, dtype=torch.float32, **SHAPE)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    return model, ids, bench_moe._routed(model, ids)


def _hooked(model, ids):
    """(hidden states, top-k expert ids) the experts module receives, from a forward pre-hook."""
    seen = {}
    experts = model.get_submodule(PATH)
    h = experts.register_forward_pre_hook(lambda m, args: seen.update(x=args[0].detach(), idx=args[1].detach()))
    with torch.no_grad():
        model(ids)
    h.remove()
    return seen["x"], seen["idx"]


def test_routed_inputs_are_the_tokens_the_router_sends(tiny):
    model, ids, routed = tiny
    x, idx = _hooked(model, ids)
    experts = model.get_submodule(PATH)
    total = 0
    for e in range(SHAPE["experts"]):
        xe = x[(idx == e).any(-1)]
        gate, up = (xe @ experts.gate_up_proj[e].detach().T).chunk(2, dim=-1)
        down_in = F.silu(gate) * up  # Mixtral's act: silu(gate) * up
        got_up, got_down = routed[PATH][e]
        total += got_up.shape[0]
        assert got_up.shape == xe.shape and got_down.shape == down_in.shape
        # the same rows in another order: compare the Gram matrices
        torch.testing.assert_close(got_up.T @ got_up, xe.T @ xe, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_down.T @ got_down, down_in.T @ down_in, rtol=1e-5, atol=1e-5)
    assert total == ids.numel() * SHAPE["top"]


def test_error_is_zero_for_float_weights_and_c_squared_for_a_scaled_expert(tiny):
    model, _, routed = tiny
    params = dict(model.named_parameters())
    same = {f"{PATH}.{p}": params[f"{PATH}.{p}"].detach().clone() for p in bench_moe.PROJS}
    errs = bench_moe.errors_of(model, same, routed)
    assert all(v == 0.0 for vs in errs.values() for v in vs)
    c = 0.1
    scaled = {k: v.clone() for k, v in same.items()}
    for k in scaled:
        scaled[k][0] *= 1 + c  # ||X (W - (1+c) W)^T||^2 / ||X W^T||^2 = c^2 for expert 0, the others exact
    errs = bench_moe.errors_of(model, scaled, routed)
    for k, vs in errs.items():
        assert vs[0] == pytest.approx(c * c, rel=1e-4), k
        assert vs[1:] == [0.0] * (SHAPE["experts"] - 1)
    with pytest.raises(ValueError, match="gate_up_proj"):
        bench_moe.errors_of(model, {**same, f"{PATH}.gate_up_proj": same[f"{PATH}.gate_up_proj"][:, :8]}, routed)


def test_error_of_one_perturbed_column_by_hand(tiny):
    model, ids, routed = tiny
    x, idx = _hooked(model, ids)
    w = model.get_submodule(PATH).down_proj.detach()
    e, k, d = 2, 5, 0.25
    q = w.clone()
    q[e, :, k] += d  # W - Q has one nonzero column k, all d: ||X_e (W-Q)^T||^2 = out * d^2 * sum_t x_tk^2
    got_x = routed[PATH][e][1]
    expected = w.shape[1] * d * d * float((got_x[:, k] ** 2).sum()) / float(((got_x @ w[e].T) ** 2).sum())
    errs = bench_moe.errors_of(model, {f"{PATH}.gate_up_proj": model.get_submodule(PATH).gate_up_proj.detach(),
                                       f"{PATH}.down_proj": q}, routed)
    assert errs[f"{PATH}.down_proj"][e] == pytest.approx(expected, rel=1e-4)
    assert [v for i, v in enumerate(errs[f"{PATH}.down_proj"]) if i != e] == [0.0] * 3


def test_median_ratio_skips_unmeasured_experts():
    assert bench_moe.median_ratio([0.02, None, 0.03, 0.04], [0.01, 0.01, 0.0, 0.01]) == (3.0, 4.0)
    with pytest.raises(ValueError):
        bench_moe.median_ratio([None, 0.1], [0.1, 0.0])


def test_measure_rows_on_a_minimal_model():
    rows = bench_moe.measure("mixtral", SHAPE, n_cal=2, n_eval=2, vocab=64, seq=32, threads=1)
    assert [r["tensor"] for r in rows] == [f"{PATH}.gate_up_proj", f"{PATH}.down_proj"]
    for r in rows:
        assert r["experts"] == 4 and r["tokens_min"] <= r["tokens_median"] <= r["tokens_max"]
        assert r["tokens_max"] <= 2 * 32  # an expert sees each calibration token at most once
        assert set(r["seconds"]) == {"rtn", "gptq", "gptq_all", "gptq_minmax", "gptq_minmax_all"}
        for k in ("rtn", "gptq", "gptq_all", "gptq_minmax", "gptq_minmax_all"):
            assert 0 < r[f"{k}_error_median"] < 0.1  # int4 g32 on random weights: a few percent at most
        assert r["gptq_over_rtn_median"] <= r["gptq_over_rtn_worst"]


def test_peer_stacks_llmcompressor_linears_gate_rows_first():
    inter, hidden, n = 3, 4, 2
    mods = torch.nn.Module()
    experts = torch.nn.ModuleList()
    for e in range(n):
        m = torch.nn.Module()
        m.gate_proj, m.up_proj = torch.nn.Linear(hidden, inter), torch.nn.Linear(hidden, inter)
        m.down_proj = torch.nn.Linear(inter, hidden)
        experts.append(m)
    mods.mlp = torch.nn.Module()
    mods.mlp.experts = experts
    linears = peer.expert_linears(mods)
    assert list(linears) == ["mlp.experts"]
    out = peer.stacked(linears)
    gu, down = out["mlp.experts.gate_up_proj"], out["mlp.experts.down_proj"]
    assert gu.shape == (n, 2 * inter, hidden) and down.shape == (n, hidden, inter)
    for e in range(n):
        assert torch.equal(gu[e, :inter], experts[e].gate_proj.weight) and torch.equal(gu[e, inter:], experts[e].up_proj.weight)
        assert torch.equal(down[e], experts[e].down_proj.weight)


def test_peer_grid_error_is_zero_on_the_int4_grid():
    lin = torch.nn.Linear(8, 2, bias=False)
    q = torch.tensor([[-8.0, -3, 0, 7, 1, 2, 3, 4], [5, 6, 7, -1, -2, -8, 0, 1]])
    scale = torch.tensor([[0.5, 0.25], [2.0, 0.125]])
    with torch.no_grad():
        lin.weight.copy_(q * scale.repeat_interleave(4, dim=1))
    lin.weight_scale = scale
    assert peer.grid_error({"x": [(lin, lin, lin)]}, 4) == (0.0, 8.0)
    with torch.no_grad():
        lin.weight[0, 0] += 0.25  # half a step of scale 0.5
    assert peer.grid_error({"x": [(lin, lin, lin)]}, 4)[0] == pytest.approx(0.5)

"""Smoothing groups with stacked experts weights and float routers (mixture-of-experts MLPs).

A hand-written MoE MLP (norm, router, per-expert gated MLP) computed before and after folding random scales
is the independent check; the expected tensors of the fold are written out by hand.
"""

import pytest
import torch

import qtransform as qt
from qtransform.algorithms.awq_math import search_scales
from qtransform.algorithms.smoothing import SmoothGroup, fold, input_module, weight_absmax
from qtransform.algorithms.smoothquant_math import layer_errors, sample_stats

E, C, I = 3, 8, 6
GROUP = SmoothGroup.from_value({"prev": "n", "linears": ["router", "experts.gate_up_proj"],
                                "stacked": ["experts.gate_up_proj"], "routers": ["router"]})


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"n.weight": torch.rand(C, generator=g, dtype=torch.float64) + 0.5,
            "router.weight": torch.randn(E, C, generator=g, dtype=torch.float64),
            "experts.gate_up_proj": torch.randn(E, 2 * I, C, generator=g, dtype=torch.float64),
            "experts.down_proj": torch.randn(E, C, I, generator=g, dtype=torch.float64)}


def _moe(p, x):
    """RMSNorm, top-2 softmax routing, each expert's silu(gate) * up then down."""
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * p["n.weight"]
    logits = h @ p["router.weight"].T
    top, idx = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
    out = torch.zeros_like(x)
    for e in range(E):
        gu = h @ p["experts.gate_up_proj"][e].T
        y = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]) @ p["experts.down_proj"][e].T
        weight = (top * (idx == e)).sum(-1, keepdim=True)
        out = out + weight * y
    return logits, out


def test_fold_scales_every_expert_and_the_router():
    p = _params()
    s = torch.tensor([2.0, 0.5, 1.0, 4.0, 0.25, 1.5, 3.0, 0.75], dtype=torch.float64)
    new = fold(p, GROUP, s)
    assert set(new) == {"n.weight", "router.weight", "experts.gate_up_proj"}
    close = lambda a, b: torch.allclose(a, b, rtol=1e-15, atol=0)  # noqa: E731  (x * (1/s) vs x / s)
    assert close(new["n.weight"], p["n.weight"] / s)
    assert close(new["router.weight"], p["router.weight"] * s)
    for e in range(E):
        assert close(new["experts.gate_up_proj"][e], p["experts.gate_up_proj"][e] * s)


def test_fold_keeps_the_routed_output_and_the_router_logits():
    p = _params(1)
    x = torch.randn(20, C, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    s = torch.rand(C, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 8 + 0.1
    before = _moe(p, x)
    after = _moe({**p, **fold(p, GROUP, s)}, x)
    assert torch.allclose(after[0], before[0], atol=1e-12) and torch.allclose(after[1], before[1], atol=1e-12)


def test_weight_maxima_span_every_expert_and_leave_routers_out():
    p = _params()
    p["router.weight"] = p["router.weight"] * 1000  # a router's range never decides the scales
    want = torch.stack([p["experts.gate_up_proj"][e].abs().amax(0) for e in range(E)]).amax(0).float()
    assert torch.equal(weight_absmax(p, GROUP), want)
    assert input_module(GROUP) == "router"  # the router sees every token; an expert only its own


@pytest.mark.parametrize("bad, match", [
    ({"stacked": ["nope"]}, "'stacked' must be a list of members"),
    ({"routers": ["router", "experts.gate_up_proj"], "stacked": []}, "all routers"),
    ({"linears": ["experts.gate_up_proj"], "routers": []}, "all stacked experts weights"),
    ({"routers": ["experts.gate_up_proj"]}, "not a stacked experts weight"),
])
def test_bad_groups_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        SmoothGroup.from_value({**GROUP.to_dict(), **bad}, where="groups[0]")


def test_a_group_round_trips_through_its_dict():
    assert SmoothGroup.from_value(GROUP.to_dict()) == GROUP
    assert GROUP.to_dict()["stacked"] == ["experts.gate_up_proj"]


def test_a_stacked_weight_of_the_wrong_rank_is_named():
    p = {**_params(), "experts.gate_up_proj": torch.randn(2 * I, C, dtype=torch.float64)}
    with pytest.raises(ValueError, match="experts.gate_up_proj: a stacked experts weight must be 3-D"):
        fold(p, GROUP, torch.ones(C, dtype=torch.float64))


def test_searches_score_the_experts_and_not_the_router():
    p = {k: v.float() for k, v in _params(4).items()}
    x = torch.randn(64, C, generator=torch.Generator().manual_seed(5))
    x[:, 2] *= 30  # a salient channel
    spec = qt.stacked_spec(qt.QuantSpec(format="uint3", granularity=qt.PerChannel(0), symmetric=False),
                           (E, 2 * I, C))
    specs = {"experts.gate_up_proj": spec}
    run = lambda t: [_moe({**p, **t}, x)[1]]  # noqa: E731
    choice = search_scales(run, p, GROUP, x.abs().mean(0), specs=specs, grid=8)
    assert choice.index > 0 and bool(choice.errors[choice.index] < choice.errors[0])
    sample = qt.finalize_stats(qt.observe(sample_stats(1), x))
    ones = torch.ones(1, C)
    err = layer_errors(sample, p, GROUP, ones, activation=qt.QuantSpec(format="int8"), weight_specs=specs)
    huge = {**p, "router.weight": p["router.weight"] * 1e6}  # no router term: the error does not move
    assert torch.equal(layer_errors(sample, huge, GROUP, ones, activation=qt.QuantSpec(format="int8"),
                                    weight_specs=specs), err)

"""Calibration sees every expert: the statistics of a stacked experts weight are one per expert, folded from
the tokens routed to it (or from every token with all_experts, the layer's output unchanged).

Expected values are computed by hand from the router's own choice (its ``top_k`` over the router logits) and
the float experts' weights, not through the bridge's routed forward."""

import pytest
import torch
import transformers as tf

import bridge
import qtransform as qt
from bridge.calibrate import ModelCalibrator


def _mixtral(seed=0):
    torch.manual_seed(seed)
    cfg = tf.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    return tf.MixtralForCausalLM(cfg).eval()


def _routed_inputs(model, ids):
    """Per expert: the MoE block's input rows routed to it, and the inputs of its down projection."""
    seen = {}
    block = model.model.layers[0].mlp
    h = block.register_forward_pre_hook(lambda m, a: seen.update(x=a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        model(ids)
    h.remove()
    x = seen["x"]
    logits = x @ block.gate.weight.T
    top = torch.topk(torch.softmax(logits.float(), -1), 2, dim=-1).indices  # the router's choice, by hand
    w1, experts = block.experts.gate_up_proj.detach(), []
    for e in range(4):
        rows = x[(top == e).any(-1)]
        g, u = (rows @ w1[e].T).chunk(2, dim=-1)
        experts.append((rows, torch.nn.functional.silu(g) * u))
    return x, experts


def test_each_expert_folds_only_its_routed_tokens():
    model = _mixtral()
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(3))
    x, experts = _routed_inputs(model, ids)
    sites = {qt.Site("model.layers.0.mlp.experts.gate_up_proj"): qt.init_stats(observer="hessian"),
             qt.Site("model.layers.0.mlp.experts.down_proj"): qt.init_stats(observer="hessian")}
    stats = ModelCalibrator(model, [ids]).site_stats(bridge.extract(model), sites)
    up, down = stats[qt.Site("model.layers.0.mlp.experts.gate_up_proj")], stats[qt.Site("model.layers.0.mlp.experts.down_proj")]
    assert len(up) == len(down) == 4
    assert sum(int(s.count) for s in up) == x.shape[0] * 2  # every token reaches top_k = 2 experts
    for e, (rows, inter) in enumerate(experts):
        assert int(up[e].count) == rows.shape[0]
        torch.testing.assert_close(up[e].xtx, (rows.double().T @ rows.double()), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(down[e].xtx, (inter.double().T @ inter.double()), rtol=1e-4, atol=1e-5)


def test_all_experts_sees_every_token_and_keeps_the_routed_output():
    model = _mixtral()
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(ids).logits
    out = {}
    h = model.lm_head.register_forward_hook(lambda m, a, o: out.update(logits=o))
    site = qt.Site("model.layers.0.mlp.experts.gate_up_proj")
    stats = ModelCalibrator(model, [ids], all_experts=True).site_stats(
        bridge.extract(model), {site: qt.init_stats(observer="hessian")})[site]
    h.remove()
    x, _ = _routed_inputs(model, ids)
    for s in stats:
        assert int(s.count) == x.shape[0]
        torch.testing.assert_close(s.xtx, x.double().T @ x.double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["logits"], want, rtol=1e-5, atol=1e-6)


def test_experts_with_too_few_tokens_fall_back_and_are_reported():
    torch.manual_seed(0)
    cfg = tf.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=16, num_experts_per_tok=2)
    model = tf.MixtralForCausalLM(cfg).eval()
    cal = [torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    recipe = qt.Recipe(type_rules={"Linear": qt.QuantSpec(format="int4", granularity=qt.PerGroup(16))},
                       exclude=["lm_head*"], steps=["gptq"])
    r = bridge.quantize_params(model, recipe, calibration=cal)
    path = "model.layers.0.mlp.experts.gate_up_proj"
    info = r.info[path]["experts"]
    tokens = info["tokens"]
    assert sum(tokens) == 24 * 2 and len(tokens) == 16
    low = [e for e, n in enumerate(tokens) if n < 8]
    assert 0 in tokens and low  # 24 tokens over 16 experts: some get none
    assert info["fallback"]["rtn"] == low and sorted(info["fitted"] + low) == list(range(16))
    w = bridge.extract(model)[path]
    spec = qt.matrix_spec(r.plan.specs[path], tuple(w.shape))
    for e in low:  # a fallen-back expert is exactly round to nearest of its matrix
        want = qt.dequantize(qt.quantize(w[e], qt.choose_qparams(w[e], spec)))
        assert torch.equal(qt.dequantize(qt.stacked.matrix(r.qtree[path], e)), want)
    for e in info["fitted"]:  # GPTQ moved the fitted ones off round to nearest
        rtn = qt.dequantize(qt.quantize(w[e], qt.choose_qparams(w[e], spec)))
        assert not torch.equal(qt.dequantize(qt.stacked.matrix(r.qtree[path], e)), rtn)


def test_experts_sites_take_inputs_only():
    model = _mixtral()
    with pytest.raises(ValueError, match="of its input"):
        ModelCalibrator(model, [torch.zeros(1, 4, dtype=torch.long)]).site_stats(
            bridge.extract(model), {qt.Site("model.layers.0.mlp.experts.down_proj", "output"): qt.init_stats(observer="hessian")})

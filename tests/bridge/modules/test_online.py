"""QuaRot's online rotations (R4 before each down projection, R3 on queries and keys after RoPE):
the rotated model computes the original function with them and not without them; calibration
after a rotate step sees the rotated activations; quantizers see rotated inputs and keys (expected
values from the float model's own activations times a dense Hadamard matrix); checkpoints record
the rotations and both loaders rebuild them."""

import json

import pytest
import torch
import transformers as tf
from bridge_util import decode, tiny_with_outliers

import bridge
import qtransform as qt
from bridge.arch import residual_layout
from bridge.checkpoint.metadata import CheckpointError
from bridge.modules import online

ROTATABLE = ("llama", "mistral", "qwen2", "phi3")
W8 = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
W4 = qt.QuantSpec(format="int4", granularity=qt.PerGroup(16))
A4 = qt.QuantSpec(format="int4", granularity=qt.PerChannel(0), dynamic=True)
FP8 = qt.QuantSpec(format="fp8_e4m3")
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def _cal(n=3):
    return [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(10 + i)) for i in range(n)]


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def _rotated(model, **options):
    """The rotate step alone on ``model``'s tree: (changed tree, online rotations)."""
    p = bridge.plan(model, qt.Recipe(type_rules={"Linear": W8},
                                     steps=[qt.Step("rotate", layout=residual_layout(model).to_dict(), **options)]))
    fit = qt.run_steps(bridge.extract(model), p)
    return qt.apply_fit(bridge.extract(model), fit), fit.online


@pytest.mark.parametrize("arch", ROTATABLE)
def test_online_rotations_keep_the_function_and_are_needed(arch):
    model = tiny_with_outliers(arch).double()
    tree, rotations = _rotated(model, r3=True)
    layers = model.config.num_hidden_layers
    assert sorted(s.role for s in rotations) == ["input"] * layers + ["key"] * layers
    ref = _logits(model)
    with_online = bridge.to_module(model, bridge.Quantized(bridge.extract(model), tree, online=rotations))
    assert torch.allclose(_logits(with_online), ref, atol=1e-5, rtol=1e-5)
    without = bridge.to_module(model, tree)  # the down weights hold W H: without x H the function changes
    assert (_logits(without) - ref).abs().max() > 0.1
    assert online.online_rotations(with_online) == rotations and not online.online_rotations(model)


def test_the_down_weight_holds_w_times_a_dense_hadamard():
    model = tiny_with_outliers("llama").double()
    plain, _ = _rotated(model, r4=False)
    tree, rotations = _rotated(model)
    path = "model.layers.1.mlp.down_proj.weight"
    n = model.config.intermediate_size
    assert rotations[qt.Site("model.layers.1.mlp.down_proj", "input")] == qt.OnlineRotation(n)
    H = qt.hadamard(n, normalized=False, dtype=torch.float64) / n ** 0.5
    assert torch.allclose(tree[path], plain[path] @ H, atol=1e-12)
    assert not [s for s in rotations if s.role == "key"]  # r3 defaults to off without a key quantizer


def _down_inputs(model, batches):
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: seen.setdefault(n, []).append(a[0].reshape(-1, a[0].shape[-1])))
             for n, m in model.named_modules() if n.endswith("mlp.down_proj")]
    with torch.no_grad():
        for b in batches:
            model(b)
    for h in hooks:
        h.remove()
    return {n: torch.cat(v) for n, v in seen.items()}


def test_static_input_scales_after_rotate_are_measured_on_rotated_inputs():
    """A static per-tensor int8 input quantizer of the first down_proj (the one quantized layer) after
    ``rotate``: its scale is the one chosen for x H (all calibration rows at once), x the float model's
    down_proj inputs (the rotation of the stream leaves them unchanged), not the one for x."""
    model = tiny_with_outliers("llama")
    batches = _cal()
    name = "model.layers.0.mlp.down_proj"
    recipe = qt.Recipe(rules=[(name + ".weight", W8)], input=qt.QuantSpec(format="int8"), steps=["rotate", "rtn"])
    q = bridge.quantize(model, recipe, calibration=batches)
    H = qt.hadamard(model.config.intermediate_size, dtype=torch.float64)
    x = _down_inputs(model, batches)[name].double()
    got = q.get_submodule(name).input_scale.reshape(())
    spec = qt.QuantSpec(format="int8")
    assert torch.allclose(got, qt.choose_qparams((x @ H).float(), spec).scale, rtol=1e-5)
    assert not torch.allclose(got, qt.choose_qparams(x.float(), spec).scale, rtol=1e-2)


def test_gptq_after_rotate_sees_rotated_down_inputs():
    """GPTQ's Hessian for a down projection is built from x H: a GPTQ step after ``rotate`` reaches a far
    lower layer loss than the same GPTQ fed the rotated weight and unrotated inputs would (checked via the
    function: the quantized rotated model stays close to the float one)."""
    model = tiny_with_outliers("llama")
    recipe = qt.Recipe(type_rules={"Linear": W4}, exclude=["lm_head*"], steps=["rotate", "gptq"])
    q = bridge.quantize(model, recipe, calibration=_cal())
    rtn = bridge.quantize(model, qt.Recipe(type_rules={"Linear": W4}, exclude=["lm_head*"], steps=["rotate", "rtn"]))
    ref = _logits(model)
    assert (_logits(q) - ref).pow(2).mean() < (_logits(rtn) - ref).pow(2).mean()


def test_r3_rotates_the_keys_the_cache_quantizer_sees():
    """With an fp8 key cache, ``rotate`` adds R3: k_scale is max|k H| / 448 over the calibration data, k the
    float model's keys after RoPE (recorded by an attention function of the test), not max|k| / 448."""
    from modules.test_kvcache import _amax_of_keys_and_values, _TestAttention

    model = tiny_with_outliers("llama")
    batches = _cal()
    recipe = qt.Recipe(rules=[("model.layers.1.mlp.down_proj.weight", W8)], kv_cache=FP8, steps=["rotate", "rtn"])
    q = bridge.quantize(model, recipe, calibration=batches)  # the one quantized weight comes after every key
    head = model.config.hidden_size // model.config.num_attention_heads
    H = qt.hadamard(head, dtype=torch.float32)
    rotated = {}

    def record(module, k, v):
        rotated[module] = max(rotated.get(module, 0.0), float((k @ H).abs().max()))
        return k, v

    with _TestAttention(model, record, name="kv_test_r3"):
        for b in batches:
            _logits(model, b)
    plain = _amax_of_keys_and_values(model, batches)
    for name, m in model.named_modules():
        if m in rotated:
            assert torch.allclose(q.get_submodule(name).k_scale, torch.tensor(rotated[m] / 448), rtol=1e-4)
            assert abs(float(q.get_submodule(name).k_scale) - plain[m][0] / 448) > 1e-6
    assert len(rotated) == 2 and sorted(s.role for s in online.online_rotations(q)) == ["input", "input", "key", "key"]


@pytest.mark.parametrize("arch", ROTATABLE)
def test_rotated_checkpoints_record_and_rebuild_the_online_rotations(arch, tmp_path):
    model = tiny_with_outliers(arch)
    recipe = qt.Recipe(type_rules={"Linear": W4}, exclude=["lm_head*"], input=A4, kv_cache=FP8,
                       steps=["rotate", "rtn"])
    q = bridge.quantize(model, recipe, calibration=_cal(2))
    bridge.save(q, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg["version"] == 4
    assert cfg["online"]["model.layers.0.mlp.down_proj:input"] == {"kind": "hadamard",
                                                                   "size": model.config.intermediate_size}
    assert cfg["online"]["model.layers.1.self_attn:key"]["size"] == model.config.hidden_size // 4
    want = _logits(q)
    for loaded in (tf.AutoModelForCausalLM.from_pretrained(tmp_path), bridge.load(tmp_path, like=tiny_with_outliers(arch))):
        assert online.online_rotations(loaded) == online.online_rotations(q)
        assert torch.equal(_logits(loaded.eval()), want)


def test_decoding_through_the_cache_equals_the_full_pass():
    """The cache holds the keys as RoPE left them; each call rotates and quantizes all of them with a fixed
    scale, so decoding token by token gives the full pass's logits."""
    model = tiny_with_outliers("llama")
    recipe = qt.Recipe(type_rules={"Linear": W8}, exclude=["lm_head*"], kv_cache=FP8, steps=["rotate", "rtn"])
    q = bridge.quantize(model, recipe, calibration=_cal(2))
    with torch.no_grad():
        step = decode(q, IDS[:, 8:9], decode(q, IDS[:, :8])[1])[0][:, -1]
        assert torch.allclose(step, q(IDS[:, :9]).logits[:, -1], atol=1e-4)


def test_a_bad_online_rotation_is_named(tmp_path):
    model = tiny_with_outliers("llama")
    tree = bridge.extract(model)
    with pytest.raises(ValueError, match=r"down_proj \(input\): an online rotation of size 12 does not divide"):
        bridge.to_module(model, bridge.Quantized(tree, tree, online={qt.Site("model.layers.0.mlp.down_proj", "input"): qt.OnlineRotation(12)}))
    with pytest.raises(ValueError, match="mlp \\(key\\): LlamaMLP is not an attention module"):
        bridge.to_module(model, bridge.Quantized(tree, tree, online={qt.Site("model.layers.0.mlp", "key"): qt.OnlineRotation(16)}))
    with pytest.raises(ValueError, match="size must be an order with a Hadamard matrix"):
        qt.OnlineRotation.from_value({"kind": "hadamard", "size": 6})
    q = bridge.quantize(model, qt.Recipe(type_rules={"Linear": W8}, exclude=["lm_head*"], steps=["rotate", "rtn"]))
    bridge.save(q, tmp_path)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"]["online"]["model.layers.0.mlp.down_proj:input"]["size"] = 12
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="size 12 does not divide"):
        bridge.load(tmp_path, like=tiny_with_outliers("llama"))
    with pytest.raises(CheckpointError, match="size 12 does not divide"):
        tf.AutoModelForCausalLM.from_pretrained(tmp_path)
    cfg["quantization_config"]["online"] = {"model.layers.0.mlp.down_proj:output": {"kind": "hadamard", "size": 8}}
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"'online' key .* is not '<module>:<role>' with role in \['input', 'key'\]"):
        bridge.load(tmp_path, like=tiny_with_outliers("llama"))


def test_two_rotations_at_one_site_are_refused():
    model = tiny_with_outliers("llama")
    with pytest.raises(ValueError, match=r"steps\[1\] \(rotate\): online rotation at .* an earlier step already"):
        bridge.quantize(model, qt.Recipe(type_rules={"Linear": W8}, exclude=["lm_head*"],
                                         steps=["rotate", "rotate", "rtn"]))

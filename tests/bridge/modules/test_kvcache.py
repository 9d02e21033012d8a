"""The key/value cache quantized as the cache stores it (after rotary embeddings): one static
per-tensor ``k_scale`` and ``v_scale`` per attention layer, calibrated from data, persisted under
those names, on every architecture we name. Expected values come from an attention function the
test registers itself (it sees the keys and values transformers hands to attention)."""

import pytest
import torch
import transformers as tf
from bridge_util import decode, tiny_causal_lm
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

import bridge
import qtransform as qt
from bridge.modules import kvcache

ARCHS = ("llama", "mistral", "qwen2", "phi3", "opt", "gpt2", "bert")
WEIGHTS = {"Linear": qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))}
EXCLUDE = ["lm_head*", "cls.*"]
FP8 = qt.QuantSpec(format="fp8_e4m3")


def _recipe(kv=FP8, **kw):
    return qt.Recipe(type_rules=WEIGHTS, exclude=EXCLUDE, kv_cache=kv, **kw)


def _batches(seed=0, n=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (2, 12), generator=g) for _ in range(n)]


def _model(arch, seed=0):
    torch.manual_seed(seed)
    return tiny_causal_lm(arch).eval()


def _forward(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


class _TestAttention:
    """Registers ``fn(module, key, value) -> (key, value)`` as the attention implementation
    ``name`` (around sdpa) for the duration of a ``with`` block on ``model``."""

    def __init__(self, model, fn, name="kv_test"):
        self.model, self.name = model, name

        def attention(module, q, k, v, *args, **kwargs):
            k, v = fn(module, k, v)
            return ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, *args, **kwargs)

        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])

    def __enter__(self):
        self.before = self.model.config._attn_implementation
        self.model.config._attn_implementation = self.name

    def __exit__(self, *exc):
        self.model.config._attn_implementation = self.before


def _amax_of_keys_and_values(model, batches):
    seen = {}

    def record(module, k, v):
        a = seen.setdefault(module, [0.0, 0.0])
        a[0], a[1] = max(a[0], float(k.abs().max())), max(a[1], float(v.abs().max()))
        return k, v

    with _TestAttention(model, record):
        for b in batches:
            _forward(model, b)
    return seen


def _fp8(x, scale):
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype) * scale


@pytest.mark.parametrize("arch", ARCHS)
def test_scales_are_calibrated_on_the_cached_keys_and_values(arch):
    """k_scale = max |key| / 448 over the calibration data, the keys as attention receives them (after
    RoPE, with the quantized weights), one scalar per attention layer under the names vLLM reads."""
    model, batches = _model(arch), _batches()
    weights_only = bridge.quantize(model, _recipe(kv=None), kernel="dequant")  # the weights calibration runs
    amax = _amax_of_keys_and_values(weights_only, batches)
    q = bridge.quantize(model, _recipe(), calibration=batches)
    attention = kvcache.attention_modules(q)
    assert len(attention) == 2 and len(amax) == 2
    for path, (k, v) in zip(attention, amax.values()):
        module = q.get_submodule(path)
        assert module.k_scale.shape == () and module.v_scale.shape == ()
        assert float(module.k_scale) == pytest.approx(k / 448, rel=1e-6)
        assert float(module.v_scale) == pytest.approx(v / 448, rel=1e-6)
    names = {n for n in q.state_dict() if n.rpartition(".")[0] in attention}  # the attention modules' own tensors
    assert names == {f"{p}.{r}_scale" for p in attention for r in "kv"}


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt"])
def test_attention_reads_the_quantized_keys_and_values(arch):
    """The quantized model's logits are those of the weight-quantized model whose attention receives
    fp8(key / k_scale) * k_scale and likewise for values (a cast written here, torch's float8)."""
    model, batches = _model(arch), _batches()
    q = bridge.quantize(model, _recipe(), calibration=batches)
    weights_only = bridge.quantize(model, _recipe(kv=None))
    scales = {weights_only.get_submodule(p): q.get_submodule(p) for p in kvcache.attention_modules(q)}

    def fake(module, k, v):
        src = scales[module]
        return _fp8(k, src.k_scale), _fp8(v, src.v_scale)

    ids = _batches(seed=5, n=1)[0]
    with _TestAttention(weights_only, fake, "kv_fake"):
        expected = _forward(weights_only, ids, use_cache=False)
    assert torch.allclose(_forward(q, ids, use_cache=False), expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(_forward(weights_only, ids, use_cache=False), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_decoding_through_the_cache_gives_the_full_forward_logits(arch):
    """Quantizing with a fixed scale is idempotent: keys read back from the cache are not changed again,
    so token-by-token decoding gives the logits of one full forward pass."""
    model = _model(arch)
    q = bridge.quantize(model, _recipe(), calibration=_batches())
    ids = _batches(seed=7, n=1)[0][:1]
    full = _forward(q, ids, use_cache=False)
    with torch.no_grad():
        logits, cache = decode(q, ids[:, :4])
        steps = [logits]
        for t in range(4, ids.shape[1]):
            logits, cache = decode(q, ids[:, t:t + 1], cache)
            steps.append(logits)
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_cache_scales_survive_save_and_both_loaders(arch, tmp_path):
    model = _model(arch)
    q = bridge.quantize(model, _recipe(), calibration=_batches())
    ids = _batches(seed=3, n=1)[0]
    bridge.save(q, tmp_path)
    auto = tf.AutoModelForMaskedLM if arch == "bert" else tf.AutoModelForCausalLM
    for loaded in (bridge.load(tmp_path, like=_model(arch)), auto.from_pretrained(tmp_path)):
        loaded.eval()
        assert torch.equal(_forward(loaded, ids), _forward(q, ids))
        for p in kvcache.attention_modules(q):
            assert torch.equal(loaded.get_submodule(p).k_scale, q.get_submodule(p).k_scale)
        assert loaded.config._attn_implementation.startswith(kvcache.PREFIX_NAME)
    from bridge.app.describe import describe
    assert describe(tmp_path).splitlines()[-1] == (
        "activation quantizers: 2 key fp8_e4m3 tensor sym (static); 2 value fp8_e4m3 tensor sym (static)")


def test_eager_attention_is_quantized_too():
    torch.manual_seed(0)
    cfg = tiny_causal_lm("llama").config
    cfg._attn_implementation = "eager"
    eager = tf.LlamaForCausalLM(cfg).eval()
    sdpa = _model("llama")
    eager.load_state_dict(sdpa.state_dict())
    batches, ids = _batches(), _batches(seed=9, n=1)[0]
    qe = bridge.quantize(eager, _recipe(), calibration=batches)
    qs = bridge.quantize(sdpa, _recipe(), calibration=batches)
    assert qe.config._attn_implementation == kvcache.PREFIX_NAME + "eager"
    assert torch.equal(qe.model.layers[1].self_attn.k_scale, qs.model.layers[1].self_attn.k_scale)
    assert torch.allclose(_forward(qe, ids), _forward(qs, ids), atol=1e-5)
    assert not torch.allclose(_forward(qe, ids), _forward(bridge.quantize(eager, _recipe(kv=None)), ids), atol=1e-5)


def test_int_formats_and_rules_per_layer():
    """int8 (a scale) and uint8 asymmetric (a scale and a zero point); act_rules leave layer 0's cache
    in full precision and give layer 1's values another format."""
    model, batches = _model("llama"), _batches()
    recipe = _recipe(kv=qt.QuantSpec(format="int8"), act_rules={
        "*.layers.0.*:key": None, "*.layers.0.*:value": None,
        "*.layers.1.*:value": qt.QuantSpec(format="uint8", symmetric=False)})
    q = bridge.quantize(model, recipe, calibration=batches)
    a0, a1 = q.model.layers[0].self_attn, q.model.layers[1].self_attn
    assert getattr(a0, "key_spec", None) is None and "k_scale" not in a0._buffers
    assert a1.key_spec == qt.QuantSpec(format="int8") and a1.value_spec.format == "uint8"
    assert {n for n in q.state_dict() if ".self_attn." in n and n.rsplit(".", 1)[1][:2] in ("k_", "v_")} == {
        "model.layers.1.self_attn.k_scale", "model.layers.1.self_attn.v_scale", "model.layers.1.self_attn.v_zero_point"}
    amax = _amax_of_keys_and_values(bridge.quantize(model, _recipe(kv=None), kernel="dequant"), batches)
    k = list(amax.values())[1][0]
    assert k / 128 <= float(a1.k_scale) <= k / 127  # symmetric int8: the largest key lands on the last code


def test_calibration_leaves_the_float_model_as_it_was():
    model = _model("llama")
    before = model.config._attn_implementation
    ids = _batches(seed=1, n=1)[0]
    ref = _forward(model, ids)
    bridge.quantize(model, _recipe(), calibration=_batches())
    assert model.config._attn_implementation == before
    assert torch.equal(_forward(model, ids), ref)


def test_recipes_carry_the_kv_cache_spec():
    r = _recipe(act_rules={"*.layers.0.*:key": None})
    assert qt.Recipe.from_dict(r.to_dict()) == r
    from qtransform.pipeline import recipe_from_dict
    p = recipe_from_dict({"default": {"format": "int8"}, "kv_cache": {"format": "fp8_e4m3"}})
    assert p.recipe.kv_cache == FP8
    params = {"a.q.weight": torch.ones(4, 4), "a.k.weight": torch.ones(4, 4)}
    plan = r.plan(params, attention=["a"])
    assert plan.activations == {qt.Site("a", "key"): FP8, qt.Site("a", "value"): FP8}
    assert qt.Recipe(kv_cache=FP8, act_rules={"a:key": None, "x.*:key": None}).unmatched(plan) == ["x.*:key"]


@pytest.mark.parametrize("spec,match", [
    (qt.QuantSpec(format="fp8_e4m3", dynamic=True), "static scales per tensor"),
    (qt.QuantSpec(format="int8", granularity=qt.PerChannel(-1)), "static scales per tensor")])
def test_cache_specs_are_static_per_tensor(spec, match):
    with pytest.raises(ValueError, match=f"Recipe.kv_cache: .*{match}"):
        qt.Recipe(kv_cache=spec)
    with pytest.raises(ValueError, match=r"act_rules\['\*:value'\]"):
        qt.Recipe(act_rules={"*:value": spec})


def test_bad_uses_are_named():
    model = _model("llama")
    with pytest.raises(ValueError, match="need calibration data"):
        bridge.quantize(model, _recipe())
    net = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(ValueError, match="Recipe.kv_cache .* names no attention module of Sequential"):
        bridge.quantize(net, qt.Recipe(default=qt.QuantSpec(format="int8"), kv_cache=FP8),
                        calibration=[torch.randn(2, 8)])
    qp = qt.QParams(spec=FP8, scale=torch.tensor(1.0).reshape(1, 1, 1, 1))
    params = bridge.extract(model)
    tree = qt.quantize_tree(params, _recipe(kv=None))
    with pytest.raises(ValueError, match="is not an attention module"):
        bridge.to_module(model, bridge.Quantized(params, tree, activations={qt.Site("model.layers.0.mlp", "key"): qp}))
    with pytest.raises(ValueError, match="static QParams per tensor or per key/value head"):
        bridge.to_module(model, bridge.Quantized(params, tree, activations={qt.Site("model.layers.0.self_attn", "key"): FP8}))
    with pytest.raises(ValueError, match="not attention modules"):
        with kvcache.observing(model, {"model.layers.0.mlp": lambda k, v: None}):
            pass

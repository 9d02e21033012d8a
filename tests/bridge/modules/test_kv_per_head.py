"""Key/value cache scales per key/value head (``kv_cache=QuantSpec(..., granularity=PerChannel(1))``): one
``k_scale``/``v_scale`` value per head of the cache's ``(batch, heads, tokens, head_dim)`` layout, calibrated,
saved and loaded back by both loaders, exported to compressed-tensors as vLLM reads them (``kv_cache_scheme``
strategy ``"attn_head"``, scales of shape ``(num_key_value_heads, 1, 1)``: vLLM's
``CompressedTensorsKVCacheMethod.create_weights`` makes ``num_kv_heads`` of them and flattens what it loads),
and refused by name by Quark (per-tensor KV scales only). Expected values come from the keys and values an
attention function registered here sees."""

import json

import pytest
import torch
import transformers as tf
from bridge_util import tiny_causal_lm
from safetensors.torch import load_file
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

import bridge
import qtransform as qt
from bridge import interop
from bridge.modules import kvcache

WEIGHTS = {"Linear": qt.QuantSpec(format="fp8_e4m3", granularity=qt.PerChannel(0))}
HEAD = qt.QuantSpec(format="fp8_e4m3", granularity=qt.PerChannel(1))


def _recipe(kv=HEAD):
    return qt.Recipe(type_rules=WEIGHTS, exclude=["lm_head*"], kv_cache=kv)


def _batches(seed=0, n=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (2, 12), generator=g) for _ in range(n)]


def _model(arch="llama"):
    torch.manual_seed(0)
    return tiny_causal_lm(arch).eval()


def _head_amax(model, batches):
    """``{module: (max |key| per head, max |value| per head)}`` as attention receives them."""
    seen = {}

    def attention(module, q, k, v, *args, **kwargs):
        a = seen.setdefault(module, [torch.zeros(k.shape[1]), torch.zeros(v.shape[1])])
        a[0] = torch.maximum(a[0], k.abs().amax(dim=(0, 2, 3)))
        a[1] = torch.maximum(a[1], v.abs().amax(dim=(0, 2, 3)))
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, *args, **kwargs)

    AttentionInterface.register("kv_heads_test", attention)
    AttentionMaskInterface.register("kv_heads_test", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    before, model.config._attn_implementation = model.config._attn_implementation, "kv_heads_test"
    try:
        with torch.no_grad():
            for b in batches:
                model(b)
    finally:
        model.config._attn_implementation = before
    return list(seen.values())


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_per_head_scales_are_each_heads_absmax(arch):
    """k_scale[h] = max |key[:, h]| / 448 over the calibration data (keys after RoPE, quantized weights); the
    model's config says how many heads (Llama: 2 key/value heads of 4 query heads; GPT-2: 4)."""
    model, batches = _model(arch), _batches()
    amax = _head_amax(bridge.quantize(model, _recipe(kv=None), kernel="dequant"), batches)
    q = bridge.quantize(model, _recipe(), calibration=batches)
    heads = 2 if arch == "llama" else 4
    for path, (k, v) in zip(kvcache.attention_modules(q), amax):
        m = q.get_submodule(path)
        assert m.k_scale.shape == (heads,) and m.v_scale.shape == (heads,)
        assert torch.allclose(m.k_scale, k / 448, rtol=1e-6) and torch.allclose(m.v_scale, v / 448, rtol=1e-6)
        assert not torch.allclose(m.k_scale, m.k_scale.max().expand(heads))  # the heads differ


def test_attention_reads_keys_quantized_per_head():
    model, batches = _model(), _batches()
    q = bridge.quantize(model, _recipe(), calibration=batches)
    w = bridge.quantize(model, _recipe(kv=None))
    seen = {}

    def attention(module, qq, k, v, *args, **kwargs):
        src = q.get_submodule(seen[module])
        k = (k / src.k_scale.view(1, -1, 1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn).float() * src.k_scale.view(1, -1, 1, 1)
        v = (v / src.v_scale.view(1, -1, 1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn).float() * src.v_scale.view(1, -1, 1, 1)
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, qq, k, v, *args, **kwargs)

    seen.update({w.get_submodule(p): p for p in kvcache.attention_modules(w)})
    AttentionInterface.register("kv_heads_fake", attention)
    AttentionMaskInterface.register("kv_heads_fake", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    w.config._attn_implementation = "kv_heads_fake"
    ids = _batches(seed=5, n=1)[0]
    with torch.no_grad():
        assert torch.allclose(q(ids, use_cache=False).logits, w(ids, use_cache=False).logits, atol=1e-5, rtol=1e-5)


def test_per_head_scales_survive_save_and_both_loaders(tmp_path):
    model = _model()
    q = bridge.quantize(model, _recipe(), calibration=_batches())
    ids = _batches(seed=3, n=1)[0]
    bridge.save(q, tmp_path)
    with torch.no_grad():
        want = q(ids).logits
        for loaded in (bridge.load(tmp_path, like=_model()), tf.AutoModelForCausalLM.from_pretrained(tmp_path)):
            loaded.eval()
            assert torch.equal(loaded(ids).logits, want)
            for p in kvcache.attention_modules(q):
                assert loaded.get_submodule(p).k_scale.shape == (2,)
                assert torch.equal(loaded.get_submodule(p).v_scale, q.get_submodule(p).v_scale)


def test_compressed_tensors_export_is_attn_head_as_vllm_reads_it(tmp_path):
    """``kv_cache_scheme.strategy == "attn_head"`` (compressed-tensors' QuantizationArgs accepts it), ``k_scale``
    of shape (num_key_value_heads, 1, 1) beside each attention module, and the import gives our tree back."""
    from compressed_tensors.quantization import QuantizationArgs

    model = _model()
    q = bridge.quantize(model, _recipe(), calibration=_batches())
    bridge.save(q, tmp_path / "ckpt")
    out = interop.export(tmp_path / "ckpt", to="compressed-tensors", out=tmp_path / "ct")
    kv = json.loads((out / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
    assert kv == {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "attn_head"}
    assert QuantizationArgs.model_validate(kv).strategy == "attn_head"
    st = load_file(out / "model.safetensors")
    for p in kvcache.attention_modules(q):
        for r in "kv":
            assert st[f"{p}.{r}_scale"].shape == (2, 1, 1)
            assert torch.equal(st[f"{p}.{r}_scale"].flatten(), getattr(q.get_submodule(p), f"{r}_scale"))
    got = interop.IMPORTERS["compressed-tensors"].read(out)
    want = interop.read_source(tmp_path / "ckpt")
    assert dict(got.meta.activations) == dict(want.meta.activations)
    for p in kvcache.attention_modules(q):
        assert torch.equal(got.tree[f"{p}.k_scale"], want.tree[f"{p}.k_scale"])


def test_quark_refuses_per_head_scales_by_name(tmp_path):
    q = bridge.quantize(_model(), _recipe(), calibration=_batches())
    bridge.save(q, tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"self_attn.*channel\(axis=1\).*per tensor"):
        interop.export(tmp_path / "ckpt", to="quark", out=tmp_path / "quark")


def test_per_head_needs_the_head_count():
    from bridge.modules import actquant

    m = torch.nn.Module()
    qp = qt.QParams(spec=HEAD, scale=torch.ones(1, 3, 1, 1))
    with pytest.raises(ValueError, match="no num_key_value_heads"):
        actquant.attach(m, "key", qp)
    with pytest.raises(ValueError, match="Recipe.kv_cache: .*per key/value head"):
        qt.Recipe(kv_cache=qt.QuantSpec(format="fp8_e4m3", granularity=qt.PerChannel(2)))


def test_the_command_takes_per_head_scales():
    import argparse

    from bridge.app.quantize import UserError, recipe_of

    def args(kv):
        return argparse.Namespace(recipe="fp8-w8a8", algorithm=None, lowrank=None, calib=2, kv_cache=kv)

    recipe, label, stem = recipe_of(args("fp8_e4m3:head"))
    assert recipe.kv_cache == HEAD and stem == "fp8-w8a8-kv-fp8_e4m3-head"
    assert recipe_of(args("fp8_e4m3"))[0].kv_cache == qt.QuantSpec(format="fp8_e4m3")
    with pytest.raises(UserError, match="--kv-cache fp8_e4m3:row: .*per key/value head"):
        recipe_of(args("fp8_e4m3:row"))


def test_the_report_gives_the_widest_head_range():
    """`qtransform quantize`'s report: the range per-head scales represent is the widest head's (448 x scale)."""
    from bridge.app.report import activation_rows

    qp = qt.QParams(spec=HEAD, scale=torch.tensor([1.0, 2.0]).reshape(1, 2, 1, 1))
    assert activation_rows({qt.Site("attn", "key"): qp})[0]["range"] == [-896.0, 896.0]

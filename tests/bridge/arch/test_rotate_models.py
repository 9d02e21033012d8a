"""QuaRot's offline rotations on real architectures: the residual layout from the architecture
tables, and ``qt.rotate`` with Hadamard/orthogonal R1 and R2 keeps the logits of tiny Llama,
Mistral, Qwen2 (q/k/v biases) and Phi-3 (fused qkv and gate/up) models to float precision."""

import pytest
import torch
from bridge_util import tiny_causal_lm, tiny_with_outliers

import bridge
import qtransform as qt
from bridge.arch import residual_layout

ROTATABLE = ("llama", "mistral", "qwen2", "phi3")


def _logits(model, params, ids):
    with torch.no_grad():
        return torch.func.functional_call(model, params, (ids,), {"use_cache": False}, tie_weights=False).logits


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("arch", ROTATABLE)
def test_rotation_keeps_the_logits(arch, tied):
    model = tiny_with_outliers(arch).double()
    if tied:
        model.lm_head.weight = model.get_input_embeddings().weight
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    params = bridge.extract(model)
    layout = residual_layout(model)
    assert len(layout.norms) == 2 * 2 + 1 and len(layout.writers) == 2 * 2 and len(layout.heads) == 2
    d, hd = model.config.hidden_size, layout.heads[0].head_dim
    R1, R2 = qt.rotation.random_hadamard(d, seed=3, dtype=torch.float64), qt.hadamard(hd, dtype=torch.float64)
    rotated = qt.rotate(params, layout, R1, R2)
    before, after = _logits(model, params, ids), _logits(model, rotated, ids)
    assert torch.allclose(after, before, atol=1e-5, rtol=1e-5)  # transformers normalises in float32
    emb = layout.embeddings[0]
    assert not torch.allclose(rotated[emb], params[emb])
    # the outlier channels the norms carried are spread: the largest column of q's weight shrinks
    q = layout.norms[0].readers[0]
    fused = qt.rotation.fuse_norms(params, layout)[q]
    assert rotated[q].abs().amax(0).max() < 0.7 * fused.abs().amax(0).max()


@pytest.mark.parametrize("arch", ["opt", "gpt2"])
def test_layernorm_families_are_refused_by_name(arch):
    with pytest.raises(ValueError, match=f"\\({arch}\\) normalises with LayerNorm, which subtracts the mean"):
        residual_layout(tiny_causal_lm(arch))


def test_a_model_without_a_table_is_named():
    with pytest.raises(ValueError, match="no architecture table fits BertForMaskedLM"):
        residual_layout(tiny_causal_lm("bert"))


W4 = qt.QuantSpec(format="int4", granularity=qt.PerGroup(16))
A8 = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0), dynamic=True)
A4 = qt.QuantSpec(format="int4", granularity=qt.PerChannel(0), dynamic=True)


def _w4a8(steps):
    return qt.Recipe(type_rules={"Linear": W4}, exclude=["lm_head*"], input=A8, steps=steps)


def _w4a4(steps):
    return qt.Recipe(type_rules={"Linear": W4}, exclude=["lm_head*"], input=A4, steps=steps)


@pytest.mark.parametrize("arch", ROTATABLE)
def test_the_rotate_step_lowers_the_w4a4_error(arch):
    """A residual stream with three outlier channels (40x, from the embeddings, as trained LLMs have):
    with int4 per-token activations `["rotate", "rtn"]` moves the logits far less than `["rtn"]`."""
    torch.manual_seed(0)
    model = tiny_causal_lm(arch).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight[:, :3] *= 40
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids).logits
        err = {s: (bridge.quantize(model, _w4a4(s))(ids).logits - ref).pow(2).mean().item()
               for s in (("rtn",), ("rotate", "rtn"))}
    assert err[("rotate", "rtn")] < 0.7 * err[("rtn",)]


@pytest.mark.parametrize("rotation", ["hadamard", "random"])
def test_a_rotated_tied_model_saves_and_loads_untied(rotation, tmp_path):
    """The rotated output head differs from the embeddings: the quantized model unties them, its
    config says so, and both loaders give the in-memory logits."""
    import transformers as tf

    def tied():
        m = tiny_with_outliers("llama")
        m.config.tie_word_embeddings = True
        m.lm_head.weight = m.model.embed_tokens.weight
        return m

    model = tied()
    q = bridge.quantize(model, _w4a8([qt.Step("rotate", rotation=rotation, seed=5), "rtn"]))
    assert q.lm_head.weight is not q.model.embed_tokens.weight and not q.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.config.tie_word_embeddings
    ids = torch.randint(0, 128, (2, 12))
    bridge.save(q, tmp_path)
    with torch.no_grad():
        want = q(ids).logits
        for loaded in (tf.AutoModelForCausalLM.from_pretrained(tmp_path), bridge.load(tmp_path, like=tied())):
            assert torch.equal(loaded.eval()(ids).logits, want)
    info = bridge.load_tree(tmp_path)  # the report's rotation info is not needed to load: plain tensors
    assert "lm_head.weight" in info


def test_rotate_options_and_models_are_checked():
    model = tiny_with_outliers("llama")
    with pytest.raises(ValueError, match="rotation must be one of"):
        bridge.quantize(model, _w4a8([qt.Step("rotate", rotation="givens"), "rtn"]))
    with pytest.raises(ValueError, match="unknown option"):
        bridge.quantize(model, _w4a8([qt.Step("rotate", angle=3), "rtn"]))
    with pytest.raises(ValueError, match="normalises with LayerNorm"):
        bridge.quantize(tiny_causal_lm("opt"), _w4a8(["rotate", "rtn"]))
    with pytest.raises(ValueError, match=r"steps\[0\] \(rotate\): needs the model's residual-stream layout \(Plan.layout\)"):
        qt.quantize_tree(bridge.extract(model), _w4a8(["rotate", "rtn"]))
    layout = residual_layout(model)
    assert qt.rotation.ResidualLayout.from_value(layout.to_dict()) == layout

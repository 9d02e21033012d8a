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

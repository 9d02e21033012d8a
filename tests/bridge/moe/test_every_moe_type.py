"""Issue 32's walk: every mixture-of-experts CausalLM type transformers builds here, quantized with the
``int4-g32`` preset, has every expert weight quantized or refused by name; never a silent float expert.

The expected set of expert weights is found independently of the bridge: every parameter of 3 or more
dimensions inside a module whose class name says "Experts" or "MoE", or that holds an experts count, minus
convolutions (depthwise convs are 3-D but no experts), plus embeddings used as experts (Doge).
Where quantized, the quantized model's logits equal transformers' own forward (its experts implementation)
with the dequantized weights put back into the float model: ``QExperts``' routed forward is the model's.
"""

import copy
import re

import pytest
import torch
from torch import nn

import bridge
import qtransform as qt

from .tiny_moe import MOE_MODEL_TYPES, build_tiny_moe

_COUNT = re.compile(r"^(num_experts|num_local_experts|n_routed_experts|num_routed_experts|n_shared_experts|"
                    r"total_experts)$")


def _moe_module(m: nn.Module) -> bool:
    name = type(m).__name__
    return ("Expert" in name or "MoE" in name or "Moe" in name
            or any(_COUNT.match(k) and isinstance(v, int) for k, v in vars(m).items()))


def expert_tensors(model: nn.Module) -> set[str]:
    """Paths of the expert weights, found from the module tree alone (see the module docstring)."""
    out = set()
    for name, m in model.named_modules():
        if not _moe_module(m) or isinstance(m, nn.modules.conv._ConvNd):
            continue
        for key, p in m.named_parameters(recurse=False):
            if p.is_floating_point() and p.dim() >= 3:
                out.add(f"{name}.{key}")
        n = getattr(m, "num_experts", None)
        for child, c in m.named_children():
            if isinstance(c, nn.Embedding) and c.num_embeddings == n:
                out.add(f"{name}.{child}.weight")
    return out


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_every_expert_is_quantized_or_refused_by_name(model_type):
    model = build_tiny_moe(model_type)
    experts = expert_tensors(model)
    assert experts, f"{model_type}: no expert weight found (the tiny config builds no MoE layer)"
    recipe = qt.get_preset("int4-g32").recipe
    try:
        qmodel = bridge.quantize(model, recipe, kernel="dequant")
    except ValueError as e:
        named = [p for p in experts if p in str(e)]
        assert named and "mixture-of-experts" in str(e), f"{model_type}: refused without naming an expert: {e}"
        return
    qtree = bridge.extract(qmodel)
    floats = sorted(p for p in experts if not isinstance(qtree.get(p), qt.QTensor))
    assert not floats, f"{model_type}: experts left in float: {floats}"
    # the reference: transformers' own forward with the dequantized weights
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for path, v in qtree.items():
            if isinstance(v, qt.QTensor):
                ref.get_parameter(path).copy_(qt.dequantize(v))
        ids = _tokens(model.config.vocab_size)
        want, got = ref(ids).logits, qmodel(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    routers = [p for p, t in bridge.tree.module_types(model).items() if t == "Router"]
    assert all(not isinstance(qtree[p], qt.QTensor) for p in routers)


def test_the_walk_covers_the_families_the_issue_names():
    for t in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "olmoe"):
        assert t in MOE_MODEL_TYPES


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss", "qwen2_moe"])
def test_dequantize_gives_the_float_experts_back(model_type):
    model = build_tiny_moe(model_type)
    qmodel = bridge.quantize(model, qt.get_preset("int8-channel").recipe, kernel="dequant")
    ids = _tokens(model.config.vocab_size)
    with torch.no_grad():
        want = qmodel(ids).logits
    qtree = bridge.extract(qmodel)
    from bridge.hf.dequantize import dequantize_model

    fmodel = dequantize_model(qmodel)
    experts = [m for m in fmodel.modules() if type(m).__name__.endswith("Experts")]
    assert experts and not any(isinstance(m, bridge.QExperts) for m in fmodel.modules())
    for path, v in qtree.items():
        if isinstance(v, qt.QTensor) and path in expert_tensors(model):
            assert torch.equal(fmodel.get_parameter(path), qt.dequantize(v))
    with torch.no_grad():
        torch.testing.assert_close(fmodel(ids).logits, want, rtol=1e-4, atol=1e-5)

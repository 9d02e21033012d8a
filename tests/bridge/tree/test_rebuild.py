"""extract / to_module / quantize / plan."""

import pytest
import torch
from torch import nn

import qtransform as qt
import bridge
from bridge_util import tiny_causal_lm

SPEC = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))


def test_extract_works_with_functional_call():
    torch.manual_seed(0)
    model = tiny_causal_lm("llama").eval()
    params = bridge.extract(model)
    ids = torch.randint(0, 128, (1, 5))
    fq = qt.dequantize_tree(qt.quantize_tree(params, qt.Recipe(default=SPEC, exclude=["*embed*", "lm_head*"])))
    with torch.no_grad():
        out = torch.func.functional_call(model, fq, (ids,)).logits
        qm = bridge.quantize(model, qt.Recipe(default=SPEC, exclude=["*embed*", "lm_head*"]), kernel="dequant")
        for m in qm.modules():
            if isinstance(m, bridge.QModule):
                m.kernel = "dequant"
        assert torch.allclose(qm(ids).logits, out, atol=1e-5)
    assert bridge.module_types(model)["model.layers.0.mlp.up_proj.weight"] == "Linear"


def test_to_module_leaves_original_untouched_and_shares_unquantized_storage():
    torch.manual_seed(0)
    model = tiny_causal_lm("llama").eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = list(map(id, model.modules()))
    qm = bridge.quantize(model, qt.Recipe(default=SPEC, exclude=["*embed*", "lm_head*"]))
    assert list(map(id, model.modules())) == ids
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert type(model.model.layers[0].mlp.up_proj) is nn.Linear
    emb_new, emb_old = qm.model.embed_tokens.weight, model.model.embed_tokens.weight
    assert emb_new.data_ptr() == emb_old.data_ptr()  # shared, not copied
    assert not any(t.is_meta for t in qm.state_dict().values())
    assert qm.model.rotary_emb.inv_freq.data_ptr() != model.model.rotary_emb.inv_freq.data_ptr()


def test_to_module_inplace_and_errors():
    model = nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32))
    qtree = qt.quantize_tree(bridge.extract(model), SPEC)
    with pytest.raises(ValueError, match="only the weight of Linear.*LayerNorm.weight"):
        bridge.to_module(model, {**qtree, "1.weight": qt.quantize(torch.randn(32, 32), qt.choose_qparams(
            torch.randn(32, 32), SPEC))})
    with pytest.raises(ValueError, match="tree paths not in the model: \\['9.weight'\\]"):
        bridge.to_module(model, {"9.weight": qtree["0.weight"]})
    wrong = qt.quantize(torch.randn(16, 64), qt.choose_qparams(torch.randn(16, 64), SPEC))
    with pytest.raises(ValueError, match="0.weight: quantized tensor has shape \\(16, 64\\)"):
        bridge.to_module(model, {"0.weight": wrong})
    q_ln = qt.quantize(torch.randn(32), qt.choose_qparams(torch.randn(32), qt.QuantSpec(format="int8")))
    with pytest.raises(ValueError, match="1.weight: only the weight of Linear"):  # checked before any replacement
        bridge.to_module(model, {**qtree, "1.weight": q_ln}, inplace=True)
    assert isinstance(model[0], nn.Linear)  # nothing was converted half-way
    out = bridge.to_module(model, qtree, inplace=True)
    assert out is model and isinstance(model[0], bridge.QLinear)
    assert isinstance(bridge.extract(model)["0.weight"], qt.QTensor)


def test_plan_uses_type_rules_and_supported_modules_only():
    from transformers.pytorch_utils import Conv1D
    model = nn.ModuleDict({"fc": nn.Linear(64, 32), "c": Conv1D(32, 64), "ln": nn.LayerNorm(64),
                           "emb": nn.Embedding(10, 64)})
    recipe = qt.Recipe(default=SPEC, type_rules={"Conv1D": None, "Embedding": qt.QuantSpec(format="int8")})
    p = bridge.plan(model, recipe)
    assert set(p) == set(model.state_dict())  # the whole tree, resolved once
    assert list(p.specs) == ["fc.weight", "emb.weight"]
    assert p["c.weight"].spec is None and p["emb.weight"].rule == "type_rules[Embedding]"
    assert p["fc.bias"].spec is None and p["ln.weight"].spec is None and p["c.weight"].module_type == "Conv1D"
    with pytest.raises(ValueError, match=r"ln.weight: recipe rules\[ln.\*\] selects a tensor of a LayerNorm that is not the weight of a quantizable"):
        bridge.plan(model, qt.Recipe(rules={"ln.*": SPEC}))
    foreign = qt.Recipe(rules={"ln.weight": qt.QuantSpec(format="int8")}, min_ndim=1).plan(bridge.extract(model))
    with pytest.raises(ValueError, match=r"ln.weight: recipe rules\[ln.weight\] selects a tensor that is not the weight"):
        bridge.quantize(model, foreign, inplace=True)  # a Plan made elsewhere is checked against the model too
    assert isinstance(model["fc"], nn.Linear)
    with pytest.raises(ValueError, match="the Plan was resolved for another tree"):
        bridge.quantize(nn.Sequential(nn.Linear(64, 32)), p)
    meta = nn.Sequential(nn.Linear(64, 32, device="meta"))
    with pytest.raises(ValueError, match="0.weight: the model's tensors are on the meta device"):
        bridge.quantize(meta, SPEC)
    qm = bridge.quantize(model, SPEC)
    assert isinstance(qm["c"], bridge.QLinear) and qm["c"].transposed and isinstance(qm["ln"], nn.LayerNorm)

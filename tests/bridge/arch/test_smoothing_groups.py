"""Architecture tables: the smoothing groups of every supported family (paths, fused rows, head sizes,
layouts checked against the modules), recognition by model type or structure, and the errors for
families the tables do not cover."""

import pytest
import torch
import transformers as tf

import qtransform as qt
from bridge.arch import find_arch, smoothing_groups
from bridge.pipeline import plan
from bridge_util import tiny_causal_lm


def _model(arch):
    torch.manual_seed(0)
    return tiny_causal_lm(arch)


L = "model.layers.1"
EXPECTED_BLOCK_1 = {  # hidden 64, 4 heads of 16, 2 key/value heads (Llama, Mistral, Qwen2, Phi-3)
    "llama": [
        {"prev": f"{L}.input_layernorm", "linears": [f"{L}.self_attn.{p}_proj" for p in "qkv"],
         "inspect": f"{L}.self_attn"},
        {"prev": f"{L}.self_attn.v_proj", "linears": [f"{L}.self_attn.o_proj"], "head_dim": 16},
        {"prev": f"{L}.post_attention_layernorm", "linears": [f"{L}.mlp.gate_proj", f"{L}.mlp.up_proj"],
         "inspect": f"{L}.mlp", "local": True},
        {"prev": f"{L}.mlp.up_proj", "linears": [f"{L}.mlp.down_proj"]}],
    "phi3": [  # qkv_proj: q 64 + k 32 + v 32 rows; gate_up_proj: gate 128 + up 128 rows
        {"prev": f"{L}.input_layernorm", "linears": [f"{L}.self_attn.qkv_proj"], "inspect": f"{L}.self_attn"},
        {"prev": f"{L}.self_attn.qkv_proj", "linears": [f"{L}.self_attn.o_proj"], "rows": [96, 128], "head_dim": 16},
        {"prev": f"{L}.post_attention_layernorm", "linears": [f"{L}.mlp.gate_up_proj"], "inspect": f"{L}.mlp", "local": True},
        {"prev": f"{L}.mlp.gate_up_proj", "linears": [f"{L}.mlp.down_proj"], "rows": [128, 256]}],
    "opt": [
        {"prev": "model.decoder.layers.1.self_attn_layer_norm",
         "linears": [f"model.decoder.layers.1.self_attn.{p}_proj" for p in "qkv"],
         "inspect": "model.decoder.layers.1.self_attn"},
        {"prev": "model.decoder.layers.1.self_attn.v_proj", "linears": ["model.decoder.layers.1.self_attn.out_proj"],
         "head_dim": 16},
        {"prev": "model.decoder.layers.1.final_layer_norm", "linears": ["model.decoder.layers.1.fc1"],
         "inspect": "model.decoder.layers.1.fc1", "local": True},
        {"prev": "model.decoder.layers.1.fc1", "linears": ["model.decoder.layers.1.fc2"]}],
    "gpt2": [  # Conv1D, stored (in, out); c_attn = [q; k; v] of 64 each
        {"prev": "transformer.h.1.ln_1", "linears": ["transformer.h.1.attn.c_attn"], "transposed": True,
         "inspect": "transformer.h.1.attn"},
        {"prev": "transformer.h.1.attn.c_attn", "linears": ["transformer.h.1.attn.c_proj"], "rows": [128, 192],
         "head_dim": 16, "transposed": True},
        {"prev": "transformer.h.1.ln_2", "linears": ["transformer.h.1.mlp.c_fc"], "transposed": True,
         "inspect": "transformer.h.1.mlp.c_fc", "local": True}],
}
EXPECTED_BLOCK_1["mistral"] = EXPECTED_BLOCK_1["qwen2"] = EXPECTED_BLOCK_1["llama"]


@pytest.mark.parametrize("arch", sorted(EXPECTED_BLOCK_1))
def test_the_groups_of_every_family(arch):
    m = _model(arch)
    groups = smoothing_groups(m)
    per_block = len(EXPECTED_BLOCK_1[arch])
    assert len(groups) == 2 * per_block and groups[per_block:] == EXPECTED_BLOCK_1[arch]
    assert find_arch(m).name == arch
    norms = smoothing_groups(m, kinds=["norm"])
    assert norms == [g for g in groups if g["prev"].endswith(("norm", "ln_1", "ln_2"))]


def test_the_value_rows_of_a_fused_projection_are_the_ones_attention_reads_as_values():
    m = _model("phi3").eval()
    attn = m.model.layers[0].self_attn
    g = smoothing_groups(m)[1]
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        qkv = attn.qkv_proj(x)
        v_ref = qkv[..., attn.config.num_attention_heads * attn.head_dim + attn.num_key_value_heads * attn.head_dim:]
    torch.testing.assert_close(qkv[..., g["rows"][0]:g["rows"][1]], v_ref)


def test_opt_fc1_fc2_only_through_relu_and_only_pre_norm_opt():
    m = _model("opt")
    m.config.activation_function = "gelu"
    assert not any(g["prev"].endswith("fc1") for g in smoothing_groups(m))
    m.config.do_layer_norm_before = False  # OPT-350m: its LayerNorms feed the residual stream
    with pytest.raises(ValueError, match=r"opt: config.do_layer_norm_before must be True \(got False\)"):
        smoothing_groups(m)


def test_an_unknown_model_type_is_recognised_by_its_structure():
    m = _model("llama")
    m.config.model_type = "my-llama"
    assert find_arch(m).name == "llama" and smoothing_groups(m) == smoothing_groups(_model("llama"))


def test_an_unsupported_architecture_names_what_is_missing():
    bert = tiny_causal_lm("bert")
    with pytest.raises(ValueError, match=r"no architecture table fits BertForMaskedLM \(model_type 'bert'\); "
                                         r"supported: \[.*'gpt2'.*'phi3'.*\]\. What is missing: llama: no module "
                                         r"list 'model.layers'.*gpt2: no module list 'transformer.h'"):
        smoothing_groups(bert)
    gemma = tf.GemmaForCausalLM(tf.GemmaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=16, max_position_embeddings=64))
    with pytest.raises(ValueError, match=r"model.layers.0.input_layernorm is a GemmaRMSNorm, not a norm known to fold"):
        find_arch(gemma)
    with pytest.raises(ValueError, match=r"kinds must be some of \['norm', 'linear'\]"):
        smoothing_groups(_model("llama"), kinds=["attention"])


def test_the_plan_carries_the_model_facts_and_the_recipe_stays_as_given():
    m = _model("llama")
    spec = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
    mine = [{"prev": "model.layers.0.input_layernorm", "linears": ["model.layers.0.self_attn.q_proj"]}]
    recipe = qt.Recipe(type_rules={"Linear": spec}, exclude=["lm_head*"],
                       steps=[qt.Step("smoothquant", alpha=0.7), "rtn", qt.Step("smoothquant", groups=mine)])
    p = plan(m, recipe)
    assert p.groups == tuple(smoothing_groups(m)) and p.layout is not None
    assert p.recipe == recipe  # no option filled in: the recipe holds only the user's choices
    sub = p.restrict(["model.layers.0.self_attn.q_proj.weight"])
    assert sub.groups == p.groups and sub.layout is p.layout and sub.attention == p.attention
    assert plan(m, p).groups == p.groups  # a plan given keeps its facts
    seq = torch.nn.Sequential(torch.nn.Linear(8, 8))
    q = plan(seq, qt.Recipe(default=spec, steps=["rtn"]))  # no table fits: no facts, no error
    assert q.groups is None and q.layout is None

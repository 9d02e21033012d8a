"""Mixture-of-experts exports: compressed-tensors and Quark write one 2-D tensor per expert and projection under
the names transformers' ``save_pretrained`` and vLLM's fused-MoE loaders use, and import back into the same stacked
experts, bit for bit; what a target cannot hold is refused by path.

Facts the expected names come from (transformers 5.24 here; vLLM read at the source):

* ``save_pretrained`` of Mixtral writes ``model.layers.N.block_sparse_moe.experts.{e}.w1/.w2/.w3.weight`` and
  ``block_sparse_moe.gate.weight``; of Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V3
  ``model.layers.N.mlp.experts.{e}.gate_proj/.up_proj/.down_proj.weight`` (its conversion mapping run in reverse);
  ``from_pretrained`` fuses them into ``mlp.experts.gate_up_proj`` (gate rows, then up rows) and ``down_proj``.
  ``test_fuse_reads_what_save_pretrained_writes`` checks our reading of it against transformers itself.
* vLLM's compressed-tensors MoE method looks up the scheme of ``<experts>.0.gate_proj`` (``.0.up_proj``,
  ``.0.down_proj``) in ``config_groups`` targets, ``"Linear"`` included (FusedMoE layers take the ``Linear``
  scheme), and leaves the layer float when ``ignore`` matches them; its Quark MoE method takes the layer config that
  matches ``<experts>`` (``layer_quant_config`` patterns, else ``global_quant_config``).

Logits are compared with ``torch.equal``: the import holds the very codes and scales, and the same modules compute.
"""

import json
import re

import pytest
import torch
from bridge_util import same_bits
from safetensors import safe_open
import transformers as tf

import bridge
import qtransform as qt
from bridge import interop
from bridge.app.imported import load_imported
from bridge.interop import experts as moe

IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))


def _config(arch):
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, tie_word_embeddings=False)
    if arch == "mixtral":
        return tf.MixtralConfig(intermediate_size=64, num_local_experts=4, **common), tf.MixtralForCausalLM
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                 num_experts=4, **common), tf.Qwen2MoeForCausalLM
    return tf.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=4, head_dim=16,
                             **common), tf.Qwen3MoeForCausalLM


def _model(arch, seed=0):
    cfg, cls = _config(arch)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    model.config.architectures = [cls.__name__]
    return model


def _recipe(name):
    if name == "int4-g32-no-experts":  # experts left float: written per expert in float, ignored by name
        return qt.Recipe(type_rules={"Linear": qt.get_preset("int4-g32").recipe.type_rules[0][1]},
                         exclude=("lm_head*", "*.experts.*"))
    return qt.get_preset(name).recipe


def _export(arch, name, to, tmp_path):
    q = bridge.quantize(_model(arch), _recipe(name))
    ckpt = tmp_path / "ckpt"
    bridge.save(q, ckpt)
    return q, ckpt, interop.export(ckpt, to=to, out=tmp_path / to)


def _stored(out):
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


def _same_tree(got, want):
    assert set(got.tree) == set(want.tree)
    for path, w in want.tree.items():
        g = got.tree[path]
        if isinstance(w, qt.QTensor):
            assert isinstance(g, qt.QTensor) and g.spec == w.spec and g.shape == w.shape and g.dtype == w.dtype, path
            assert same_bits(g.codes, w.codes), path
            assert all(same_bits(g.qparams.tensors()[k], t) for k, t in w.qparams.tensors().items()), path
        else:
            assert same_bits(g, w), path
    assert got.meta.entries == want.meta.entries


def _imports_back(arch, q, ckpt, out, to):
    _same_tree(interop.IMPORTERS[to].read(out), interop.read_source(ckpt))
    loaded = bridge.load(out, like=_model(arch, seed=1))
    assert torch.equal(loaded(IDS).logits, q(IDS).logits)
    built = load_imported(out)  # the command's way: the model from the export's own config.json
    assert type(built) is type(loaded) and torch.equal(built(IDS).logits, q(IDS).logits)


# (name, shape, safetensors dtype) of layer 1, expert 3: written literally from the facts above
CT_INT4 = {
    "mixtral": {"model.layers.1.block_sparse_moe.experts.3.w1.weight_packed": ((64, 8), "I32"),
                "model.layers.1.block_sparse_moe.experts.3.w1.weight_scale": ((64, 2), "F32"),
                "model.layers.1.block_sparse_moe.experts.3.w1.weight_shape": ((2,), "I64"),
                "model.layers.1.block_sparse_moe.experts.3.w3.weight_packed": ((64, 8), "I32"),
                "model.layers.1.block_sparse_moe.experts.3.w3.weight_scale": ((64, 2), "F32"),
                "model.layers.1.block_sparse_moe.experts.3.w2.weight_packed": ((64, 8), "I32"),
                "model.layers.1.block_sparse_moe.experts.3.w2.weight_scale": ((64, 2), "F32"),
                "model.layers.1.block_sparse_moe.gate.weight": ((4, 64), "F32")},
    "qwen3_moe": {"model.layers.1.mlp.experts.3.gate_proj.weight_packed": ((32, 8), "I32"),
                  "model.layers.1.mlp.experts.3.gate_proj.weight_scale": ((32, 2), "F32"),
                  "model.layers.1.mlp.experts.3.up_proj.weight_packed": ((32, 8), "I32"),
                  "model.layers.1.mlp.experts.3.up_proj.weight_scale": ((32, 2), "F32"),
                  "model.layers.1.mlp.experts.3.down_proj.weight_packed": ((64, 4), "I32"),
                  "model.layers.1.mlp.experts.3.down_proj.weight_scale": ((64, 1), "F32"),
                  "model.layers.1.mlp.gate.weight": ((4, 64), "F32")},
    "qwen2_moe": {"model.layers.1.mlp.experts.3.gate_proj.weight_packed": ((32, 8), "I32"),
                  "model.layers.1.mlp.experts.3.up_proj.weight_packed": ((32, 8), "I32"),
                  "model.layers.1.mlp.experts.3.down_proj.weight_packed": ((64, 4), "I32"),
                  "model.layers.1.mlp.shared_expert.gate_proj.weight_packed": ((64, 8), "I32"),
                  "model.layers.1.mlp.shared_expert.down_proj.weight_scale": ((64, 2), "F32"),
                  "model.layers.1.mlp.shared_expert_gate.weight": ((1, 64), "F32"),
                  "model.layers.1.mlp.gate.weight": ((4, 64), "F32")},
}
ROUTERS = {"mixtral": ["model.layers.0.block_sparse_moe.gate"],
           "qwen3_moe": ["model.layers.0.mlp.gate"],
           "qwen2_moe": ["model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate"]}
VLLM_EXPERTS = {"mixtral": "model.layers.0.block_sparse_moe.experts", "qwen3_moe": "model.layers.0.mlp.experts",
                "qwen2_moe": "model.layers.0.mlp.experts"}


def _vllm_ignores(name, ignore):
    """vLLM's reading of ``ignore``: an exact name or a ``re:`` regex matched at the start."""
    return any(re.match(i[3:], name) if i.startswith("re:") else i == name for i in ignore)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_compressed_tensors_writes_experts_per_expert_and_reads_them_back(arch, tmp_path):
    q, ckpt, out = _export(arch, "int4-g32", "compressed-tensors", tmp_path)
    stored = _stored(out)
    for name, want in CT_INT4[arch].items():
        assert stored.get(name) == want, name
    assert not [n for n in stored if "gate_up_proj" in n or n.endswith("experts.down_proj")]
    pieces = [n for n in stored if re.search(r"experts\.\d+\..*weight_packed$", n)]
    assert len(pieces) == 2 * 4 * 3  # layers x experts x projections
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["Linear"] and group["weights"]["num_bits"] == 4
    for router in ROUTERS[arch]:
        assert router in qc["ignore"]
    for proj in ("gate_proj", "up_proj", "down_proj"):  # what vLLM's MoE method looks up: not ignored
        assert not _vllm_ignores(f"{VLLM_EXPERTS[arch]}.0.{proj}", qc["ignore"])
    _imports_back(arch, q, ckpt, out, "compressed-tensors")


def test_compressed_tensors_fp8_experts_hold_one_scale_row_per_output(tmp_path):
    q, ckpt, out = _export("qwen3_moe", "fp8", "compressed-tensors", tmp_path)
    stored = _stored(out)
    assert stored["model.layers.0.mlp.experts.2.up_proj.weight"] == ((32, 64), "F8_E4M3")
    assert stored["model.layers.0.mlp.experts.2.down_proj.weight"] == ((64, 32), "F8_E4M3")
    _imports_back("qwen3_moe", q, ckpt, out, "compressed-tensors")


def test_float_experts_are_written_per_expert_and_ignored_by_name(tmp_path):
    q, ckpt, out = _export("mixtral", "int4-g32-no-experts", "compressed-tensors", tmp_path)
    assert not any(".experts." in p for p in interop.read_source(ckpt).meta.entries)
    stored = _stored(out)
    assert stored["model.layers.0.block_sparse_moe.experts.1.w3.weight"] == ((64, 64), "F32")
    assert stored["model.layers.0.self_attn.q_proj.weight_packed"] == ((64, 8), "I32")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    for proj in ("gate_proj", "up_proj", "down_proj"):  # vLLM must not give the float experts the Linear scheme
        assert _vllm_ignores(f"model.layers.1.block_sparse_moe.experts.0.{proj}", qc["ignore"])
    _imports_back("mixtral", q, ckpt, out, "compressed-tensors")


QUARK = {
    ("mixtral", "int4-g32"): {"model.layers.1.block_sparse_moe.experts.3.w1.weight": ((64, 8), "I32"),
                              "model.layers.1.block_sparse_moe.experts.3.w1.weight_scale": ((2, 64), "F32"),
                              "model.layers.1.block_sparse_moe.experts.3.w3.weight": ((64, 8), "I32"),
                              "model.layers.1.block_sparse_moe.experts.3.w2.weight": ((64, 8), "I32")},
    ("qwen2_moe", "fp8"): {"model.layers.1.mlp.experts.3.gate_proj.weight": ((32, 64), "F8_E4M3"),
                           "model.layers.1.mlp.experts.3.up_proj.weight_scale": ((32,), "F32"),
                           "model.layers.1.mlp.experts.3.down_proj.weight": ((64, 32), "F8_E4M3"),
                           "model.layers.1.mlp.shared_expert.up_proj.weight": ((64, 64), "F8_E4M3")},
}


@pytest.mark.parametrize("arch,name", list(QUARK))
def test_quark_writes_experts_per_expert_and_reads_them_back(arch, name, tmp_path):
    q, ckpt, out = _export(arch, name, "quark", tmp_path)
    stored = _stored(out)
    for tensor, want in QUARK[(arch, name)].items():
        assert stored.get(tensor) == want, tensor
    assert not [n for n in stored if "gate_up_proj" in n]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    # vLLM resolves a FusedMoE layer's config by the experts module's name: here the global one, not excluded
    assert not any(fnmatch_any(VLLM_EXPERTS[arch], p) for p in qc["exclude"])
    assert qc["global_quant_config"]["weight"]["dtype"] == ("int4" if name == "int4-g32" else "fp8_e4m3")
    _imports_back(arch, q, ckpt, out, "quark")


def test_quark_float_experts_are_written_per_expert_and_excluded(tmp_path):
    q, ckpt, out = _export("qwen2_moe", "int4-g32-no-experts", "quark", tmp_path)
    assert _stored(out)["model.layers.0.mlp.experts.1.up_proj.weight"] == ((32, 64), "F32")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    for module in ("model.layers.0.mlp.experts", "model.layers.1.mlp.gate", "model.layers.0.mlp.shared_expert_gate"):
        assert any(fnmatch_any(module, p) for p in qc["exclude"]), module
    assert not any(fnmatch_any("model.layers.0.mlp.shared_expert.up_proj", p) for p in qc["exclude"])
    _imports_back("qwen2_moe", q, ckpt, out, "quark")


def fnmatch_any(name, pattern):
    import fnmatch

    return fnmatch.fnmatch(name, pattern) if "*" in pattern else name in pattern


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_fuse_reads_what_save_pretrained_writes(arch, tmp_path):
    """transformers' own per-expert checkpoint (save_pretrained) fused by us is the model's state dict."""
    model = _model(arch)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    tree, entries = moe.fuse(saved, {}, model.config.to_dict(), where=tmp_path)
    assert entries == {}
    state = model.state_dict()
    assert set(tree) == set(state)
    assert all(torch.equal(tree[k], state[k]) for k in state)


def test_experts_a_target_cannot_split_are_refused_by_path(tmp_path):
    """fp8 blocks of 64 rows straddle the gate/up boundary of a Qwen3-MoE expert (32 gate rows, 32 up rows)."""
    spec = qt.QuantSpec(format="fp8_e4m3", granularity=qt.PerBlock((64, 32)))
    q = bridge.quantize(_model("qwen3_moe"), qt.Recipe(rules={"*.experts.gate_up_proj": spec}))
    bridge.save(q, tmp_path / "ckpt")
    for to in ("compressed-tensors", "quark"):
        with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj"):
            interop.export(tmp_path / "ckpt", to=to, out=tmp_path / to)
        assert not (tmp_path / to).exists()


def test_onnx_refuses_mixture_of_experts_by_name(tmp_path):
    """(GGUF writes Mixtral and Qwen-MoE experts now: tests/bridge/interop/test_moe_gguf.py.)"""
    bridge.save(bridge.quantize(_model("mixtral"), qt.get_preset("int4-g32").recipe), tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj: mixture-of-experts"):
        interop.export(tmp_path / "ckpt", to="onnx", out=tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_transformers_from_pretrained_reads_the_compressed_tensors_export(arch, tmp_path):
    """transformers' compressed-tensors loader decompresses the per-expert tensors and fuses them (its conversion
    mapping; int8 layers are decompressed on load): every weight is our dequantized weight, bit for bit."""
    _, ckpt, out = _export(arch, "int8-channel", "compressed-tensors", tmp_path)
    model = tf.AutoModelForCausalLM.from_pretrained(out).eval()
    model(IDS)  # compressed-tensors decompresses the int8 layers on the first forward
    state = model.state_dict()
    for path, leaf in interop.read_source(ckpt).tree.items():
        want = qt.dequantize(leaf) if isinstance(leaf, qt.QTensor) else leaf
        assert torch.equal(state[path], want), path

"""GGUF for mixture-of-experts models: llama.cpp's expert tensors written from our stacked experts and read back.

Facts the expected values come from (llama.cpp's ``convert_hf_to_gguf.py`` ``Qwen2MoeModel``, which
``Qwen3MoeModel`` extends; Mixtral goes through ``LlamaModel``; gguf-py's ``MODEL_TENSORS`` and ``Keys.LLM``):

* a layer's experts are stacked per projection, experts outermost: torch shape ``(E, out, in)``, which
  ``GGUFReader`` reports as ggml's ``ne`` ``[in, out, E]``: ``blk.N.ffn_gate_exps`` / ``ffn_up_exps``
  ``[hidden, moe_inter, E]``, ``ffn_down_exps`` ``[moe_inter, hidden, E]``; the router ``ffn_gate_inp``
  ``[hidden, E]``; Qwen2-MoE's shared expert ``ffn_{gate,up,down}_shexp`` (2-D) and its gate
  ``ffn_gate_inp_shexp`` ``[hidden]`` (the converter squeezes the ``(1, hidden)`` weight);
* metadata ``<arch>.expert_count``, ``expert_used_count``, ``expert_feed_forward_length``,
  ``expert_shared_feed_forward_length``.

transformers' GGUF loader reads ``qwen2moe``/``qwen3moe`` tensors, but its config mapping has no
``expert_feed_forward_length`` (nor the shared size), so it is given the model's config; it reads a Mixtral file
(``llama`` with ``expert_count``) as a dense Llama, so Mixtral is checked through our importer and gguf-py only.
llama.cpp itself (llama-cpp-python) is not installed here and was not run.
"""

import json

import numpy as np
import pytest
import torch
import transformers as tf

import bridge
import qtransform as qt
from bridge import interop
from bridge.interop.gguf import arch as gguf_arch, tensors as gguf_tensors

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(5))
Q8_0, Q4_1 = gguf_tensors.IMPORT_SPECS["Q8_0"], gguf_tensors.IMPORT_SPECS["Q4_1"]
MXFP4 = qt.QuantSpec(format="mxfp4")


def _model(arch, seed=0, **over):
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, tie_word_embeddings=False)
    if arch == "mixtral":
        cfg, cls = tf.MixtralConfig(intermediate_size=64, num_local_experts=4, **common), tf.MixtralForCausalLM
    elif arch == "qwen2_moe":
        cfg, cls = tf.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                     num_experts=4, **common), tf.Qwen2MoeForCausalLM
    else:  # llama.cpp's qwen3moe renormalizes the top-k weights, as the released Qwen3-MoE configs say
        cfg, cls = tf.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=4, head_dim=16,
                                     norm_topk_prob=True, **common), tf.Qwen3MoeForCausalLM
    for k, v in over.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    model.config.architectures = [cls.__name__]
    return model


def _export(arch, spec, tmp_path, *, allow_nearest=False, **over):
    q = bridge.quantize(_model(arch, **over), qt.Recipe(type_rules={"Linear": spec, "Experts": spec},
                                                        exclude=("lm_head*",)))
    bridge.save(q, tmp_path / "ckpt")
    out = interop.export(tmp_path / "ckpt", to="gguf", out=tmp_path / "gguf", allow_nearest=allow_nearest)
    (file,) = out.glob("*.gguf")
    return q, out, file


# layer 1's tensors: (ggml ne as GGUFReader lists it, GGUF type), written from the facts above
TENSORS = {
    ("qwen2_moe", "Q8_0"): {"blk.1.ffn_gate_exps.weight": ([64, 32, 4], "Q8_0"),
                            "blk.1.ffn_up_exps.weight": ([64, 32, 4], "Q8_0"),
                            "blk.1.ffn_down_exps.weight": ([32, 64, 4], "Q8_0"),
                            "blk.1.ffn_gate_inp.weight": ([64, 4], "F32"),
                            "blk.1.ffn_gate_shexp.weight": ([64, 64], "Q8_0"),
                            "blk.1.ffn_up_shexp.weight": ([64, 64], "Q8_0"),
                            "blk.1.ffn_down_shexp.weight": ([64, 64], "Q8_0"),
                            "blk.1.ffn_gate_inp_shexp.weight": ([64], "F32")},
    ("qwen3_moe", "Q4_1"): {"blk.1.ffn_gate_exps.weight": ([64, 32, 4], "Q4_1"),
                            "blk.1.ffn_up_exps.weight": ([64, 32, 4], "Q4_1"),
                            "blk.1.ffn_down_exps.weight": ([32, 64, 4], "Q4_1"),
                            "blk.1.ffn_gate_inp.weight": ([64, 4], "F32"),
                            "blk.1.attn_q_norm.weight": ([16], "F32")},
    ("mixtral", "MXFP4"): {"blk.1.ffn_gate_exps.weight": ([64, 64, 4], "MXFP4"),
                           "blk.1.ffn_up_exps.weight": ([64, 64, 4], "MXFP4"),
                           "blk.1.ffn_down_exps.weight": ([64, 64, 4], "MXFP4"),
                           "blk.1.ffn_gate_inp.weight": ([64, 4], "F32")},
}
KEYS = {"qwen2_moe": {"general.architecture": "qwen2moe", "qwen2moe.expert_count": 4,
                      "qwen2moe.expert_used_count": 2, "qwen2moe.expert_feed_forward_length": 32,
                      "qwen2moe.expert_shared_feed_forward_length": 64},
        "qwen3_moe": {"general.architecture": "qwen3moe", "qwen3moe.expert_count": 4,
                      "qwen3moe.expert_used_count": 2, "qwen3moe.expert_feed_forward_length": 32,
                      "qwen3moe.attention.key_length": 16},
        "mixtral": {"general.architecture": "llama", "llama.expert_count": 4, "llama.expert_used_count": 2,
                    "llama.expert_feed_forward_length": 64}}
SPECS = {"Q8_0": Q8_0, "Q4_1": Q4_1, "MXFP4": MXFP4}


def _same_tree(got, want):
    assert set(got.tree) == set(want.tree)
    for path, w in want.tree.items():
        g = got.tree[path]
        if isinstance(w, qt.QTensor):
            assert isinstance(g, qt.QTensor) and g.spec == w.spec and tuple(g.shape) == tuple(w.shape), path
            assert torch.equal(g.codes, w.codes), path
            assert all(torch.equal(g.qparams.tensors()[k], t) for k, t in w.qparams.tensors().items()), path
        else:
            assert torch.equal(g, w), path


@pytest.mark.parametrize("arch,qtype", list(TENSORS))
def test_experts_are_written_as_llama_cpp_names_them_and_read_back_bit_for_bit(arch, qtype, tmp_path):
    q, out, file = _export(arch, SPECS[qtype], tmp_path)
    reader = gguf.GGUFReader(str(file))
    tensors = {t.name: t for t in reader.tensors}
    for name, (ne, kind) in TENSORS[(arch, qtype)].items():
        assert (tensors[name].shape.tolist(), tensors[name].tensor_type.name) == (ne, kind), name
    for key, want in KEYS[arch].items():
        assert reader.fields[key].contents() == want, key
    assert not [n for n in tensors if "gate_up" in n or n.startswith("blk.0.ffn_gate.")]
    # gguf-py's own dequantization of the file is our dequantized experts: gate rows, then up rows, per expert
    experts = interop.read_source(tmp_path / "ckpt").tree
    w = qt.dequantize(experts["model.layers.1.mlp.experts.gate_up_proj"]).numpy()
    half = w.shape[1] // 2
    for name, rows in (("blk.1.ffn_gate_exps.weight", slice(0, half)), ("blk.1.ffn_up_exps.weight", slice(half, None))):
        t = tensors[name]
        assert np.array_equal(gguf_dequantize(t.data, t.tensor_type).reshape(w[:, rows].shape), w[:, rows]), name
    t = tensors["blk.1.ffn_down_exps.weight"]
    down = qt.dequantize(experts["model.layers.1.mlp.experts.down_proj"]).numpy()
    assert np.array_equal(gguf_dequantize(t.data, t.tensor_type).reshape(down.shape), down)
    # our import: the same stacked codes and scales, and the same logits from the same modules
    _same_tree(interop.IMPORTERS["gguf"].read(out), interop.read_source(tmp_path / "ckpt"))
    loaded = bridge.load(out, like=_model(arch, seed=1))
    assert torch.equal(loaded(IDS).logits, q(IDS).logits)


@pytest.mark.parametrize("arch,qtype", [("qwen2_moe", "Q8_0"), ("qwen3_moe", "Q4_1")])
def test_transformers_gguf_loader_reads_our_experts(arch, qtype, tmp_path):
    """transformers dequantizes the file with gguf-py and fuses ffn_gate_exps/ffn_up_exps into gate_up_proj: every
    weight is our dequantized weight bit for bit, so a float model holding our dequantized weights gives the same
    logits exactly (tolerance 0: same class, same bits, same process and kernels)."""
    _, out, file = _export(arch, SPECS[qtype], tmp_path)
    config = _model(arch).config
    model = tf.AutoModelForCausalLM.from_pretrained(out, gguf_file=file.name, config=config, dtype=torch.float32).eval()
    tree = interop.read_source(tmp_path / "ckpt").tree
    state = model.state_dict()
    ours = {p: (qt.dequantize(v) if isinstance(v, qt.QTensor) else v) for p, v in tree.items()}
    for path, want in ours.items():
        assert torch.equal(state[path], want), path
    ref = _model(arch, seed=1)
    ref.load_state_dict(ours)
    assert torch.equal(model(IDS).logits, ref(IDS).logits)


def test_nearest_experts_are_requantized_per_row_and_reported(tmp_path):
    """int8 per channel has no GGUF block: with allow_nearest the experts become Q8_0 (dequantized first, so the
    gate/up split needs no row-block alignment), their extra error reported per GGUF tensor."""
    spec = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts.gate_up_proj: int8"):
        _export("qwen3_moe", spec, tmp_path / "refused")
    _, out, file = _export("qwen3_moe", spec, tmp_path, allow_nearest=True)
    report = json.loads((out / "gguf_export.json").read_text())["tensors"]
    entry = report["blk.0.ffn_up_exps.weight"]
    assert entry["path"] == "model.layers.0.mlp.experts.gate_up_proj" and entry["type"] == "Q8_0"
    assert entry["kind"] == "nearest" and 0 < entry["rel_rms_error"] < 0.01
    back = interop.IMPORTERS["gguf"].read(out).tree["model.layers.0.mlp.experts.gate_up_proj"]
    assert tuple(back.shape) == (4, 64, 64) and qt.matrix_spec(back.spec, (4, 64, 64)) == Q8_0


def test_what_llama_cpp_cannot_compute_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="norm_topk_prob False: llama.cpp's qwen3moe graph always renormalizes"):
        _export("qwen3_moe", Q8_0, tmp_path / "a", norm_topk_prob=False)
    assert not (tmp_path / "a" / "gguf").exists()
    with pytest.raises(ValueError, match="mlp_only_layers \\[1\\].*every layer"):
        _export("qwen2_moe", Q8_0, tmp_path / "b", mlp_only_layers=[1])
    q = bridge.quantize(_model("qwen2_moe"), qt.Recipe(rules={"*.shared_expert_gate.weight": Q8_0}))
    bridge.save(q, tmp_path / "c")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.shared_expert_gate\.weight: .*ffn_gate_inp_shexp"):
        interop.export(tmp_path / "c", to="gguf", out=tmp_path / "c-gguf", allow_nearest=True)
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=256)
    for kind, key in (("gpt_oss", "num_local_experts"), ("olmoe", "num_experts"), ("deepseek_v3", "n_routed_experts")):
        (why,) = gguf_arch.arch_problems({"model_type": kind, key: 8, **common})
        assert why.startswith(f"architecture {kind!r} is a mixture-of-experts model (8 experts): this GGUF exporter "
                              "writes expert tensors for the model types ['mixtral', 'qwen2_moe', 'qwen3_moe'] only")

"""One row per model family: a family added as one ``Arch`` row gets its smoothing groups, foldable norms,
rotatability, checkpoint expert names and GGUF facts from that row alone, and no module holds a table of
families of its own (every family named anywhere comes from ``bridge.arch.ARCHS``)."""

import ast

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from bridge.arch import ARCHS, Arch, ExpertNames, Gguf, GroupTemplate, arch_for, families, find_arch, \
    foldable_norms, residual_layout, rotatable, smoothing_groups
from bridge.interop import experts
from bridge.interop.gguf import arch as gguf_arch
from bridge.interop.gguf import families as gguf_families
from bridge.interop.gguf import moe as gguf_moe
from bridge_util import REPO, tiny_causal_lm


class ToyRMSNorm(LlamaRMSNorm):
    """A norm class no shipped row names: a model built of it fits no family until its row says it folds."""


#: The new family's row, written out here (not borrowed from a shipped row).
TOY = Arch("toy", ("toy",), "model.layers", (
    GroupTemplate("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), inspect="self_attn"),
    GroupTemplate("self_attn.v_proj", ("self_attn.o_proj",), heads=True),
    GroupTemplate("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), inspect="mlp", local=True),
    GroupTemplate("mlp.up_proj", ("mlp.down_proj",)),
), norms=("ToyRMSNorm",), rotatable=True, checkpoint_experts=ExpertNames("a", "b", "c", moe="moe"),
    gguf=Gguf("llama", permute_qk=True))


def _toy_model():
    torch.manual_seed(0)
    m = tiny_causal_lm("llama")  # hidden 64, 4 heads of 16, 2 key/value heads, 2 layers
    m.config.model_type = "toy"
    for mod in m.modules():
        if type(mod) is LlamaRMSNorm:
            mod.__class__ = ToyRMSNorm
    return m


def _expected_groups(block: str) -> list[dict]:
    return [
        {"prev": f"{block}.input_layernorm", "linears": [f"{block}.self_attn.{p}_proj" for p in "qkv"],
         "inspect": f"{block}.self_attn"},
        {"prev": f"{block}.self_attn.v_proj", "linears": [f"{block}.self_attn.o_proj"], "head_dim": 64 // 4},
        {"prev": f"{block}.post_attention_layernorm", "linears": [f"{block}.mlp.gate_proj", f"{block}.mlp.up_proj"],
         "inspect": f"{block}.mlp", "local": True},
        {"prev": f"{block}.mlp.up_proj", "linears": [f"{block}.mlp.down_proj"]}]


def _with(monkeypatch, *rows):
    monkeypatch.setattr(families, "ARCHS", families.ARCHS + rows)


def test_a_model_of_an_unknown_family_fits_no_row():
    m = _toy_model()
    assert arch_for("toy") is None and "ToyRMSNorm" not in foldable_norms()
    with pytest.raises(ValueError, match=r"model.layers.0.input_layernorm is a ToyRMSNorm, not a norm known to fold"):
        find_arch(m)
    assert gguf_arch.arch_of({"model_type": "toy"}) is None and experts.naming_of({"model_type": "toy"}) is None


def test_one_row_gives_the_family_every_fact(monkeypatch):
    _with(monkeypatch, TOY)
    m = _toy_model()
    # smoothing groups and foldable norms
    assert arch_for("toy") is TOY and find_arch(m) is TOY and "ToyRMSNorm" in foldable_norms()
    assert smoothing_groups(m) == _expected_groups("model.layers.0") + _expected_groups("model.layers.1")
    # rotations: the same stream as the Llama model it is built like (that one's layout from the llama row)
    assert "toy" in rotatable()
    assert residual_layout(m) == residual_layout(tiny_causal_lm("llama"))
    # checkpoint expert names
    assert experts.naming_of({"model_type": "toy"}) == ExpertNames("a", "b", "c", moe="moe")
    assert experts.namings()["toy"].moe == "moe"
    # GGUF: the architecture name, support, no experts, and llama's q/k row order (per head: pairs interleaved)
    config = {**m.config.to_dict(), "model_type": "toy"}
    assert gguf_arch.arch_of(config) == "llama" and gguf_families.arches()["toy"] == "llama"
    assert gguf_arch.arch_problems(config) == [] and not gguf_moe.is_moe(config)
    rows = gguf_arch.qk_rows("model.layers.0.self_attn.q_proj.weight", config, 64)
    assert rows.tolist() == [h * 16 + j // 2 + (j % 2) * 8 for h in range(4) for j in range(16)]
    assert gguf_arch.qk_rows("model.layers.0.self_attn.k_proj.weight", config, 32).tolist() == \
        [h * 16 + j // 2 + (j % 2) * 8 for h in range(2) for j in range(16)]


def test_the_row_alone_turns_the_facts_off(monkeypatch):
    plain = TOY._replace(rotatable=False, checkpoint_experts=None, gguf=Gguf("qwen2"))
    _with(monkeypatch, plain)
    m, config = _toy_model(), {"model_type": "toy"}
    assert find_arch(m) is plain and "toy" not in rotatable()
    with pytest.raises(ValueError, match=r"\(toy\) normalises with LayerNorm.*rotatable families: llama"):
        residual_layout(m)
    assert experts.naming_of(config) is None and "toy" not in experts.namings()
    assert gguf_arch.arch_of(config) == "qwen2"
    assert gguf_arch.qk_rows("model.layers.0.self_attn.q_proj.weight", config, 64) is None  # NeoX rotary: kept
    monkeypatch.setattr(families, "ARCHS", families.ARCHS[:-1] + (plain._replace(gguf=None),))
    assert gguf_arch.arch_of(config) is None and "toy" not in gguf_families.arches()
    assert gguf_arch.arch_problems({**_toy_model().config.to_dict(), "model_type": "toy"}) == \
        [f"architecture 'toy': GGUF export supports {sorted(gguf_families.arches())}"]


def test_a_row_with_experts_is_a_gguf_moe_family(monkeypatch):
    moe = Arch("toy_moe", ("toy_moe",), "model.layers", (), expert_count="toy_experts",
               gguf=Gguf("toymoe", tensors=("mlp.gate.weight",), expert_width="toy_width", norm_topk=True))
    _with(monkeypatch, moe)
    config = {"model_type": "toy_moe", "num_hidden_layers": 2, "toy_experts": 4, "num_experts_per_tok": 2}
    assert gguf_moe.is_moe(config) and gguf_families.moe_arches()["toy_moe"] == "toymoe"
    assert "toy_experts" in gguf_families.expert_counts() and gguf_families.moe_family("toymoe") is moe
    assert gguf_moe.moe_problems(config) == [
        "config.json lacks ['toy_width']",
        "norm_topk_prob None: llama.cpp's toymoe graph always renormalizes the top-k routing weights"]
    assert gguf_moe.hf_moe_names(config) == ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    # a family with no smoothing groups is known for its other facts only: never a smoothing table
    m = tiny_causal_lm("llama")
    m.config.model_type = "toy_moe"
    assert find_arch(m).name == "llama"


def test_every_family_named_in_a_view_has_a_row():
    types = {t for a in ARCHS for t in a.model_types}
    assert len(types) == sum(len(a.model_types) for a in ARCHS)  # a model type in one row only
    assert len({a.name for a in ARCHS}) == len(ARCHS)
    assert set(rotatable()) <= {a.name for a in ARCHS}
    assert set(gguf_families.arches()) <= types and set(gguf_families.moe_arches()) <= set(gguf_families.arches())
    assert set(experts.namings()) <= types
    assert set(gguf_families.expert_counts()) == {a.expert_count for a in ARCHS if a.expert_count}
    assert foldable_norms() == {n for a in ARCHS for n in a.norms}
    for a in ARCHS:  # a row's facts are plain data (no torch, no gguf objects): strings, bools, tuples of them
        for field in (a.name, a.blocks, *a.model_types, *a.norms, *a.writers):
            assert isinstance(field, str) and field, a.name
        assert a.gguf is None or all(isinstance(v, (str, bool, tuple, type(None))) for v in a.gguf), a.name


def test_shipped_rows_keep_the_facts_they_had():
    """The facts the separate tables held before they became rows (numbers written out, not derived)."""
    assert rotatable() == ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss",
                           "deepseek_v3", "phi3")
    assert gguf_families.arches() == {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "mixtral": "llama",
                                      "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
    assert [t for t in gguf_families.arches() if arch_for(t).gguf.permute_qk] == ["llama", "mistral", "mixtral"]
    assert sorted(experts.namings()) == ["deepseek_v2", "deepseek_v3", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe",
                                         "qwen3_next"]  # qwen3_next: issue 51 (its MTP checkpoints exported)
    assert gguf_families.expert_counts() == ("num_local_experts", "num_experts", "n_routed_experts")


#: Strings in bridge/ outside the rows that equal a family's model type but name something else.
NOT_FAMILIES = {("bridge/interop/gguf/arch.py", "qwen2"): "llama.cpp's pre-tokenizer name",
                ("bridge/interop/gguf/arch.py", "gpt2"): "tokenizer.ggml.model, the byte-level BPE tokenizer"}


def test_no_module_keys_anything_by_family_outside_the_rows():
    names = {t for a in ARCHS for t in a.model_types} | {n for a in ARCHS for n in a.norms}
    found = set()
    for path in sorted((REPO / "bridge").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel == "bridge/arch/families.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        found |= {(rel, n.value) for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names
                  and id(n) not in docs}
    assert found == set(NOT_FAMILIES)

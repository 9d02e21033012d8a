"""Tiny random mixture-of-experts CausalLMs for tests (issue 32).

``MOE_MODEL_TYPES``: every type in transformers' ``CONFIG_MAPPING`` whose config class has an
experts count (``num_local_experts``, ``num_experts``, ``n_routed_experts``, ``moe_num_experts``,
``n_experts`` in its signature, fields or ``attribute_map``) and a CausalLM class, computed at
import so a new transformers release adds its MoE types itself; the others (seq2seq, vision,
multimodal sub-configs) are in ``NOT_CAUSAL_LM``.

``tiny_moe_config`` sets every size field of the family's default config small by its name;
``_OVERRIDES`` has the few per-type fixes. ``build_tiny_moe``: an ``eval()`` model with
deterministic random weights, all finite and none constant.
"""

from __future__ import annotations

import inspect
import re

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

_EXPERT_COUNT = re.compile(r"^(num_local_experts|num_experts|n_routed_experts|moe_num_experts|n_experts)$")


def _config_field_names(cls) -> set[str]:
    names = set(getattr(cls, "attribute_map", None) or {}) | set(inspect.signature(cls.__init__).parameters)
    for klass in cls.__mro__[: cls.__mro__.index(PretrainedConfig)]:  # dataclass-style fields
        names |= set(getattr(klass, "__annotations__", {}))
    return names


def _moe_types() -> tuple[tuple[str, ...], dict[str, str]]:
    moe, not_causal = [], {}
    for mt in sorted(CONFIG_MAPPING.keys()):
        try:
            cls = CONFIG_MAPPING[mt]
        except Exception:  # an optional dependency missing: not ours to test
            continue
        if not any(_EXPERT_COUNT.match(n) for n in _config_field_names(cls)):
            continue
        if mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            moe.append(mt)
        else:
            not_causal[mt] = "no CausalLM class in transformers' auto mapping (vision/seq2seq/multimodal sub-config)"
    return tuple(moe), not_causal


MOE_MODEL_TYPES, NOT_CAUSAL_LM = _moe_types()

# Per-type fixes where the generic shrinking is not enough (fields given to the constructor).
_OVERRIDES: dict[str, dict] = {
    "doge": {"is_moe": True},  # MoE (product-key "CDMoE") off by default
    "dots3_note_text": {"per_layer_config": {}},  # else sliding layers get 64 heads, rank 1024
    "nemotron_h": {"layers_block_type": ["full_attention", "moe"]},  # one mixer per block
    "gemma4_text": {"enable_moe_block": True, "global_head_dim": 16},  # MoE off by default
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},  # default: all Mamba
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # default None, needed
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                       "indexer_budget": 8, "indexer_compress_ratio": 2},  # default None, needed
    "kolibri1_1": {"kv_source_layers": [0, 1],  # one source per layer (not indices of layers: not cut to [0])
                   "index_layers": [1],  # layer 1 (indexed attention) is the indexer, as the family requires
                   "index_num_heads": 2},  # at most the query heads per key head (4 // 2); default 12
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 0,  # layer 0 attention, 1 Mamba + MoE
              "expert_layer_period": 2, "expert_layer_offset": 1},
}

# Types that cannot be built or run on CPU here: {model_type: short reason (exception text)}.
# Hard-coded; empty with transformers 5.25 / torch 2.13 CPU, where all 64 types build and run (5.25's new
# kolibri1_1 with its override above; 5.24 had 60).
UNBUILDABLE: dict[str, str] = {}


_TOP_K = ("num_experts_per_tok", "top_k_experts", "moe_topk", "moe_k", "num_experts_per_token")
_SHARED = ("num_shared_experts", "n_shared_experts", "moe_num_shared_experts")


def _small_value(name: str, value, *, experts, top_k, hidden, layers, vocab, heads=None):
    """The small value for one config field, or ``value`` when the field is not a size."""
    n = name.lower()
    if isinstance(value, bool):
        return value
    if _EXPERT_COUNT.match(n):  # also where the default is None (dense by default: dots1, gemma4)
        return experts
    if n in _TOP_K:
        return top_k
    if n in _SHARED:  # one shared expert where the family has any (dots1's default is None)
        return min(value, 1) if isinstance(value, int) else 1 if value is None else value
    if "intermediate" in n or "ffn_hidden" in n or "expert_dim" in n:
        if isinstance(value, list):
            return [32] * layers
        return 32 if isinstance(value, int) or value is None and "moe" in n else value
    if n == "head_dim":
        return 16
    if value is None:
        return value
    if isinstance(value, str):  # hybrid layer patterns such as "M-M*E": the first kinds of block
        return "".join(list(dict.fromkeys(value))[:layers]) if "pattern" in n and len(value) > layers else value
    if n in ("n_group", "topk_group", "num_expert_group"):
        return 1
    if n in ("hidden_size", "d_model", "n_embd", "model_dim"):
        return hidden
    if n in ("num_hidden_layers", "n_layer", "n_layers", "num_layers"):
        return layers
    if n in ("vocab_size", "unpadded_vocab_size", "vocab_size_per_layer_input"):
        return vocab
    if n in ("first_k_dense_replace", "first_k_dense", "num_dense_layers", "n_dense_layers"):
        return 1 if value else value
    if n.endswith("num_attention_heads") or n.endswith("n_heads"):
        return 4
    if n.endswith("num_key_value_heads") or n.endswith("kv_heads"):
        return 2 if value < heads else 4  # grouped-query attention only where the family has it
    if n.endswith("head_dim") and n not in ("qk_head_dim", "qk_rope_head_dim", "qk_nope_head_dim"):
        return 16
    if n in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim"):
        return 16 if "lora" in n else 8
    if isinstance(value, int) and value > 16 and (n.endswith("window") or n.endswith("window_size")):
        return 16
    if n in ("hidden_size_per_layer_input", "mamba_dt_rank", "index_topk", "zero_expert_num"):
        return min(value, 8) if isinstance(value, int) else value
    if n in ("pad_token_id", "bos_token_id", "eos_token_id", "eod_token_id", "sep_token_id"):
        return [min(v, vocab - 1) for v in value] if isinstance(value, list) else min(value, vocab - 1)
    if isinstance(value, list) and value and n.endswith("_layers") and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):  # layer indices
        if "moe" in n or "sparse" in n:  # indices of MoE layers (llama4's moe_layers)
            return [v for v in value if v < layers] or [layers - 1]
        return [v for v in value if v < layers - 1]  # dense-layer indices: the last one is MoE
    if isinstance(value, list) and len(value) > layers and (
            n.endswith("layer_types") or n.endswith("_layers") or n.endswith("layers_block_type")):
        # the first layers of the family's pattern, with every kind of layer it has kept (the
        # hybrids' linear and full attention, dense and sparse MLPs), the later kinds last
        out = list(value[:layers])
        missing = [k for k in dict.fromkeys(value) if k not in out][: layers - 1]
        if missing:
            out[len(out) - len(missing):] = missing
        return out
    return value


def tiny_moe_config(model_type: str, *, experts: int = 4, top_k: int = 2, hidden: int = 64,
                    layers: int = 2, vocab: int = 256):
    """A config of ``model_type`` with every size small: ``experts`` experts, ``top_k`` routed per
    token, ``hidden`` wide, ``layers`` deep, a ``vocab``-token vocabulary.

    The small fields go to the config class's constructor, so the fields it derives
    (``head_dim``, ``qk_head_dim``, ``layer_types`` where unset) follow them."""
    cls = CONFIG_MAPPING[model_type]
    default = cls().to_dict()
    kw = dict(experts=experts, top_k=top_k, hidden=hidden, layers=layers, vocab=vocab)
    small = {}
    for name, value in default.items():
        if isinstance(value, dict) or name.startswith("_") or name in ("model_type", "transformers_version"):
            continue
        heads = default.get(name.replace("key_value", "attention").replace("kv_", ""), 1 << 30)
        new = _small_value(name, value, heads=heads, **kw)
        if new is not value and new != value:
            small[name] = new
    if default.get("qk_rope_head_dim"):  # MLA: head_dim is the rope part; keep the family's ratio
        ratio = (default.get("head_dim") or default["qk_rope_head_dim"]) // default["qk_rope_head_dim"]
        small["head_dim"] = small["qk_rope_head_dim"] * max(ratio, 1)
        small.pop("qk_head_dim", None)
        if "qk_head_dim" in default:
            small["qk_head_dim"] = small["qk_rope_head_dim"] + small.get("qk_nope_head_dim", 8)
    small.update(_OVERRIDES.get(model_type, {}))
    try:
        config = cls(**small)
    except Exception:  # a constructor that rejects a field: set them afterwards
        config = cls()
        for name, value in small.items():
            setattr(config, name, value)
    for name, value in small.items():  # constructors that ignore or recompute a field
        try:  # (a per-layer attribute of gemma4, dots3 raises on read: the constructor set it)
            if getattr(config, name, None) != value:
                setattr(config, name, value)
        except Exception:
            pass
    config._attn_implementation = "eager"
    return config


def finite_nonconstant(model: torch.nn.Module) -> list[str]:
    """Names of float parameters that are not finite, constant (more than one value) or a zero."""
    return [n for n, p in model.named_parameters() if p.is_floating_point() and (
        not torch.isfinite(p).all() or (p.float().std() == 0 if p.numel() > 1 else p.item() == 0))]


def _reinit(model: torch.nn.Module, seed: int) -> None:
    """Give every float parameter left empty, constant (norm weights, zero biases) or non-finite
    a small random value (around 1 for norm weights), so that every weight tells in a test."""
    g, params = torch.Generator().manual_seed(seed + 1), dict(model.named_parameters())
    with torch.no_grad():
        for name in finite_nonconstant(model):
            p = params[name]
            p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.02 + (1.0 if "norm" in name else 0.0))


def build_tiny_moe(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, **config_kw):
    """An ``eval()`` tiny ``model_type`` CausalLM with deterministic random finite weights."""
    config = tiny_moe_config(model_type, **config_kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _reinit(model, seed)
    return model.eval()


#: a layer of each kind in the two blocks of a hybrid model (the defaults' first two layers are of one kind)
HYBRID_KINDS = {"lfm2": {"layer_types": ["conv", "full_attention"]}, "bamba": {"attn_layer_indices": [1]},
                "nemotron_h": {"layers_block_type": ["linear_attention", "full_attention"]}}


def tiny_hybrid(model_type: str, attn: str = "eager", seed: int = 0):
    """A tiny ``model_type`` causal LM (:func:`tiny_moe_config`) whose two blocks are of two kinds where the
    family mixes them (:data:`HYBRID_KINDS`), with ``attn`` attention, eval mode."""
    from transformers import AutoModelForCausalLM

    config = tiny_moe_config(model_type)
    for key, value in HYBRID_KINDS.get(model_type, {}).items():
        setattr(config, key, value)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinit(model, seed)
    return model.eval()

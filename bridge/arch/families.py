"""The model families, one :class:`~.tables.Arch` row each: the one place a family's facts live.

Adding a family is adding a row to :data:`ARCHS`: its smoothing groups (:mod:`.groups`), rotatability and
residual writers (:mod:`.residual`), foldable norms, expert count key, checkpoint expert names
(``bridge.interop.experts``) and GGUF facts (``bridge.interop.gguf``) all follow from it. Every view of the
table is computed from :data:`ARCHS` when asked (:func:`arch_for`, :func:`foldable_norms`, :func:`rotatable`),
never copied into a table of its own.

>>> arch_for("mistral").gguf.arch, arch_for("qwen2").rotatable, arch_for("gpt2").rotatable, arch_for("bert")
('llama', True, False, None)
"""

from __future__ import annotations

from .tables import Arch, ExpertNames, Gguf, GroupTemplate

__all__ = ["ARCHS", "arch_for", "foldable_norms", "rotatable"]

_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")

_LLAMA_GROUPS = (
    GroupTemplate("input_layernorm", _QKV, inspect="self_attn"),
    GroupTemplate("self_attn.v_proj", ("self_attn.o_proj",), heads=True),
    GroupTemplate("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), inspect="mlp", local=True),
    GroupTemplate("mlp.up_proj", ("mlp.down_proj",)),
)

_ATTENTION = _LLAMA_GROUPS[:2]
_DENSE_MLP = tuple(t._replace(present="mlp.gate_proj") for t in _LLAMA_GROUPS[2:])
_EXPERTS = "mlp.experts.gate_up_proj"


def _moe(shared: str | None = None, gate: str | None = None, attention=_ATTENTION,
         router: str = "mlp.gate") -> tuple[GroupTemplate, ...]:
    """The groups of a mixture-of-experts block: ``attention``'s, ``router``, experts and (``shared``) a shared
    expert with (``gate``) its float gate; the dense MLP's in blocks without experts."""
    extra = (f"{shared}.gate_proj", f"{shared}.up_proj") if shared else ()
    routers = (router,) + ((gate,) if gate else ())
    groups = (GroupTemplate("post_attention_layernorm", (router, _EXPERTS, *extra, *routers[1:]), inspect="mlp",
                            local=True, present="mlp.experts", stacked=(_EXPERTS,), routers=routers),)
    if shared:
        groups += (GroupTemplate(f"{shared}.up_proj", (f"{shared}.down_proj",), present=shared),)
    return attention + groups + _DENSE_MLP


#: Multi-head latent attention (DeepSeek-V3): the norm feeds the query (low-rank or not) and the compressed
#: key/value projections; each low-rank latent has its own norm. No value -> output group: the values come out
#: of ``kv_b_proj`` mixed with the keys' no-rope part.
_MLA = (
    GroupTemplate("input_layernorm", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"), inspect="self_attn",
                  present="self_attn.q_a_proj"),
    GroupTemplate("input_layernorm", ("self_attn.q_proj", "self_attn.kv_a_proj_with_mqa"), inspect="self_attn",
                  present="self_attn.q_proj"),
    GroupTemplate("self_attn.q_a_layernorm", ("self_attn.q_b_proj",), inspect="self_attn",
                  present="self_attn.q_a_layernorm"),
    GroupTemplate("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",), inspect="self_attn"),
)

#: Hybrid blocks: a block holds one mixer of several kinds (a Mamba/Mamba-2 mixer, a short convolution, attention)
#: and the norm before it feeds that mixer's input projections: ``present`` picks the group of the kind the block
#: has. A mixer's own output projection reads a gated, normed state-space or convolution output (not linear in its
#: input projection's rows): no group; an attention's value -> output holds.
def _mixer(norm: str, mixer: str, attention: str, qkv=("q_proj", "k_proj", "v_proj"),
           out: str = "o_proj") -> tuple[GroupTemplate, ...]:
    q = tuple(f"{attention}.{n}" for n in qkv)
    return (GroupTemplate(norm, (f"{mixer}.in_proj",), inspect=f"{mixer}.in_proj", local=True,
                          present=f"{mixer}.in_proj"),
            GroupTemplate(norm, q, inspect=attention, present=q[0]),
            GroupTemplate(q[2], (f"{attention}.{out}",), heads=True, present=q[2]))


def _gated_mlp(norm: str, mlp: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj"):
    return (GroupTemplate(norm, (f"{mlp}.{gate}", f"{mlp}.{up}"), inspect=mlp, local=True, present=f"{mlp}.{up}"),
            GroupTemplate(f"{mlp}.{up}", (f"{mlp}.{down}",), present=f"{mlp}.{up}"))


#: Per-expert checkpoint names: transformers 5.24's conversion mapping (``mixtral``; ``qwen2_moe``, whose layout
#: the other families share).
_MIXTRAL_EXPERTS = ExpertNames("w1", "w3", "w2", moe="block_sparse_moe")
_QWEN_EXPERTS = ExpertNames("gate_proj", "up_proj", "down_proj")
_ROUTER = "mlp.gate.weight"


ARCHS: tuple[Arch, ...] = (
    Arch("llama", ("llama",), "model.layers", _LLAMA_GROUPS, norms=("LlamaRMSNorm",), rotatable=True,
         gguf=Gguf("llama", permute_qk=True)),
    # llama.cpp runs Mistral as llama (transformers reads it back as Llama, without a sliding window)
    Arch("mistral", ("mistral",), "model.layers", _LLAMA_GROUPS, norms=("MistralRMSNorm",), rotatable=True,
         sliding_window=True, gguf=Gguf("llama", permute_qk=True)),
    Arch("qwen2", ("qwen2",), "model.layers", _LLAMA_GROUPS,  # q/k/v biases: untouched by input scaling
         norms=("Qwen2RMSNorm",), rotatable=True, gguf=Gguf("qwen2")),  # NeoX rotary: q/k rows kept
    Arch("opt", ("opt",), "model.decoder.layers", (
        GroupTemplate("self_attn_layer_norm", _QKV, inspect="self_attn"),
        GroupTemplate("self_attn.v_proj", ("self_attn.out_proj",), heads=True),
        GroupTemplate("final_layer_norm", ("fc1",), inspect="fc1", local=True),
        GroupTemplate("fc1", ("fc2",), when=("activation_function", ("relu",))),
    ), requires=(("do_layer_norm_before", True),), norms=("LayerNorm",)),
    Arch("gpt2", ("gpt2",), "transformer.h", (  # Conv1D: weights stored (in, out)
        GroupTemplate("ln_1", ("attn.c_attn",), inspect="attn"),
        GroupTemplate("attn.c_attn", ("attn.c_proj",), rows="v", heads=True),
        GroupTemplate("ln_2", ("mlp.c_fc",), inspect="mlp.c_fc", local=True),
    ), norms=("LayerNorm",)),
    # Mixtral in GGUF: llama with expert_count (llama's dense graph; the experts' width is feed_forward_length)
    Arch("mixtral", ("mixtral",), "model.layers", _moe(), norms=("MixtralRMSNorm",), rotatable=True,
         sliding_window=True, expert_count="num_local_experts", checkpoint_experts=_MIXTRAL_EXPERTS,
         gguf=Gguf("llama", permute_qk=True, tensors=(_ROUTER,))),
    Arch("qwen2_moe", ("qwen2_moe",), "model.layers", _moe("mlp.shared_expert", "mlp.shared_expert_gate"),
         norms=("Qwen2MoeRMSNorm",), rotatable=True, expert_count="num_experts", checkpoint_experts=_QWEN_EXPERTS,
         gguf=Gguf("qwen2moe", tensors=(_ROUTER, "mlp.shared_expert.gate_proj.weight",
                                        "mlp.shared_expert.up_proj.weight", "mlp.shared_expert.down_proj.weight",
                                        "mlp.shared_expert_gate.weight"),
                   expert_width="moe_intermediate_size", norm_topk=False, shared_expert=True)),
    Arch("qwen3_moe", ("qwen3_moe",), "model.layers", _moe(), norms=("Qwen3MoeRMSNorm",), rotatable=True,
         expert_count="num_experts", checkpoint_experts=_QWEN_EXPERTS,
         gguf=Gguf("qwen3moe", key_length=True, tensors=(_ROUTER, "self_attn.q_norm.weight", "self_attn.k_norm.weight"),
                   expert_width="moe_intermediate_size", norm_topk=True)),
    Arch("olmoe", ("olmoe",), "model.layers", _moe(),  # q/k norms over whole projections: after the linears
         norms=("OlmoeRMSNorm",), rotatable=True, expert_count="num_experts", checkpoint_experts=_QWEN_EXPERTS),
    # GPT-OSS: experts stored (experts, in, out) with biases, a router with a bias, attention sinks (the
    # attention output stays a combination of value rows: v -> o holds); no per-expert checkpoint form
    Arch("gpt_oss", ("gpt_oss",), "model.layers", _moe(router="mlp.router"), norms=("GptOssRMSNorm",),
         rotatable=True, expert_count="num_local_experts"),
    Arch("deepseek_v3", ("deepseek_v3",), "model.layers", _moe("mlp.shared_experts", attention=_MLA),
         writers=("self_attn.o_proj",), norms=("DeepseekV3RMSNorm",), rotatable=True,
         expert_count="n_routed_experts", checkpoint_experts=_QWEN_EXPERTS),
    Arch("phi3", ("phi3",), "model.layers", (
        GroupTemplate("input_layernorm", ("self_attn.qkv_proj",), inspect="self_attn"),
        GroupTemplate("self_attn.qkv_proj", ("self_attn.o_proj",), rows="v", heads=True),
        GroupTemplate("post_attention_layernorm", ("mlp.gate_up_proj",), inspect="mlp", local=True),
        GroupTemplate("mlp.gate_up_proj", ("mlp.down_proj",), rows="up"),
    ), norms=("Phi3RMSNorm",), rotatable=True),
    # Nemotron-H: one mixer per block (Mamba-2, attention, a ReLU^2 MLP: no up -> down through its square)
    Arch("nemotron_h", ("nemotron_h",), "model.layers", _mixer("norm", "mixer", "mixer") + (
        GroupTemplate("norm", ("mixer.up_proj",), inspect="mixer.up_proj", local=True, present="mixer.up_proj"),),
         norms=("NemotronHRMSNorm",)),
    # Bamba: a Mamba-2 or an attention layer, then a gated MLP
    Arch("bamba", ("bamba",), "model.layers", _mixer("input_layernorm", "mamba", "self_attn")
         + _gated_mlp("pre_ff_layernorm", "feed_forward"), norms=("BambaRMSNorm",)),
    # Falcon-H1: attention and Mamba-2 side by side on one normed input (one group: the norm feeds both; scalar
    # multipliers commute with a per-channel scale), then a gated MLP
    Arch("falcon_h1", ("falcon_h1",), "model.layers", (
        GroupTemplate("input_layernorm", ("mamba.in_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        GroupTemplate("self_attn.v_proj", ("self_attn.o_proj",), heads=True),
    ) + _gated_mlp("pre_ff_layernorm", "feed_forward"), norms=("FalconH1RMSNorm",)),
    # LFM2: a short convolution (in_proj -> causal conv -> out_proj) or an attention layer, then a gated MLP
    Arch("lfm2", ("lfm2",), "model.layers", _mixer("operator_norm", "conv", "self_attn", out="out_proj")
         + _gated_mlp("ffn_norm", "feed_forward", gate="w1", up="w3", down="w2"), norms=("Lfm2RMSNorm",)),
    # DeepSeek-V2: no smoothing table yet (its norm class is not known to fold); its checkpoints' experts are named
    Arch("deepseek_v2", ("deepseek_v2",), "model.layers", (), expert_count="n_routed_experts",
         checkpoint_experts=_QWEN_EXPERTS),
    # Qwen3-Next (gated DeltaNet and gated attention): no smoothing table; its checkpoints' experts are named as
    # qwen2_moe's (transformers' conversion mapping), what compressed-tensors and Quark exports write
    Arch("qwen3_next", ("qwen3_next",), "model.layers", (), expert_count="num_experts",
         checkpoint_experts=_QWEN_EXPERTS),
)


def arch_for(model_type: str | None) -> Arch | None:
    """The row of ``model_type`` (``config.model_type``), ``None`` when no family has it (or for ``None``)."""
    if model_type is not None and not isinstance(model_type, str):
        raise TypeError(f"model_type must be a str or None, got {type(model_type).__name__}")
    return next((a for a in ARCHS if model_type in a.model_types), None)


def foldable_norms() -> frozenset[str]:
    """Norm classes computing ``weight * normalized(x) (+ bias)``: every row's ``norms``."""
    return frozenset(n for a in ARCHS for n in a.norms)


def rotatable() -> tuple[str, ...]:
    """Names of the families whose residual stream can be rotated (pre-norm with RMSNorm), in table order."""
    return tuple(a.name for a in ARCHS if a.rotatable)

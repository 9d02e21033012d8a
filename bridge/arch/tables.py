"""Model-family tables: a decoder's repeated blocks and, inside each, which norm or linear feeds which linears.

Plain data (named tuples of strings), read by :mod:`.groups` to give SmoothQuant's (and AWQ's)
smoothing groups for a model. Paths are relative to a block (``model.layers.3``). A group's
``prev`` is a norm or a linear whose output the ``linears`` read, through nothing or through an
operation that commutes with a positive per-channel scale:

* norm -> the linears it feeds (the norm's weight, and bias, absorb ``1/s``). Only pre-norm
  blocks qualify: a post-norm block's LayerNorm also feeds the residual stream;
* value projection -> output projection (attention mixes value rows with weights summing to 1,
  so the bias passes too; grouped-query heads are handled by ``head_dim``);
* ``up`` -> ``down`` of a gated MLP (``act(gate) * up`` is linear in ``up``), and ``fc1`` -> ``fc2``
  through a ReLU (``relu(x / s) = relu(x) / s`` for ``s > 0``); not through GELU (GPT-2).

``rows`` names a slice of a fused producer: ``"v"`` is the value part of ``[q; k; v]`` (its last
``(out - n_q) / 2`` rows, ``n_q`` being the output projection's input width), ``"up"`` the second
half of ``[gate; up]`` (Phi-3). ``inspect`` is the module whose output a search over the whole
sub-layer would measure (AWQ); ``local`` says it computes each token's output from that token alone (an MLP, a
linear: a search may sample its rows; attention may not); ``when`` a config attribute and the values for which
the group exists, and ``present`` a module (relative to the block) without which the block has no such group:
a model mixing dense and mixture-of-experts blocks (DeepSeek-V3's first layers, Qwen-MoE's ``mlp_only_layers``)
gets, per block, the groups of the MLP it has.

Mixture-of-experts blocks: the norm before the MLP feeds the router, the stacked experts weights and the shared
experts. ``stacked`` names the linears that are stacked experts weights (tree paths of the 3-D tensors
themselves, ``mlp.experts.gate_up_proj``), ``routers`` the float linears reading the same input (a router
``(experts, hidden)``, Qwen2-MoE's ``shared_expert_gate``): scaled exactly, never quantized. The experts' down
projections are in no group (each expert's hidden activation is its own; they are not smoothed).

Norm classes the groups may fold into compute ``weight * normalized(x) (+ bias)``
(:data:`FOLDABLE_NORMS`); Gemma's ``(1 + weight)`` RMSNorm, for one, does not.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["GroupTemplate", "Arch", "ARCHS", "FOLDABLE_NORMS"]


class GroupTemplate(NamedTuple):
    """One smoothing group of a block (paths relative to the block; see the module docstring)."""

    prev: str
    linears: tuple[str, ...]
    inspect: str | None = None
    rows: str | None = None
    heads: bool = False
    when: tuple[str, tuple] | None = None
    local: bool = False
    present: str | None = None
    stacked: tuple[str, ...] = ()
    routers: tuple[str, ...] = ()


class Arch(NamedTuple):
    """A model family: ``model_types`` (``config.model_type``), the ``blocks`` ``nn.ModuleList`` path,
    its smoothing ``groups`` and ``requires``, config attributes that must hold (``(name, value)``);
    ``writers``: linears writing the residual stream that no group names as a value -> output pair (rotations)."""

    name: str
    model_types: tuple[str, ...]
    blocks: str
    groups: tuple[GroupTemplate, ...]
    requires: tuple[tuple[str, Any], ...] = ()
    writers: tuple[str, ...] = ()


#: Norm classes computing ``weight * normalized(x) (+ bias)``: a scale folds into their weight and bias.
FOLDABLE_NORMS = frozenset({"LayerNorm", "LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Phi3RMSNorm",
                            "MixtralRMSNorm", "Qwen2MoeRMSNorm", "Qwen3MoeRMSNorm", "OlmoeRMSNorm",
                            "DeepseekV3RMSNorm", "GptOssRMSNorm"})

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


ARCHS: tuple[Arch, ...] = (
    Arch("llama", ("llama",), "model.layers", _LLAMA_GROUPS),
    Arch("mistral", ("mistral",), "model.layers", _LLAMA_GROUPS),
    Arch("qwen2", ("qwen2",), "model.layers", _LLAMA_GROUPS),  # q/k/v biases: untouched by input scaling
    Arch("opt", ("opt",), "model.decoder.layers", (
        GroupTemplate("self_attn_layer_norm", _QKV, inspect="self_attn"),
        GroupTemplate("self_attn.v_proj", ("self_attn.out_proj",), heads=True),
        GroupTemplate("final_layer_norm", ("fc1",), inspect="fc1", local=True),
        GroupTemplate("fc1", ("fc2",), when=("activation_function", ("relu",))),
    ), requires=(("do_layer_norm_before", True),)),
    Arch("gpt2", ("gpt2",), "transformer.h", (  # Conv1D: weights stored (in, out)
        GroupTemplate("ln_1", ("attn.c_attn",), inspect="attn"),
        GroupTemplate("attn.c_attn", ("attn.c_proj",), rows="v", heads=True),
        GroupTemplate("ln_2", ("mlp.c_fc",), inspect="mlp.c_fc", local=True),
    )),
    Arch("mixtral", ("mixtral",), "model.layers", _moe()),
    Arch("qwen2_moe", ("qwen2_moe",), "model.layers", _moe("mlp.shared_expert", "mlp.shared_expert_gate")),
    Arch("qwen3_moe", ("qwen3_moe",), "model.layers", _moe()),
    Arch("olmoe", ("olmoe",), "model.layers", _moe()),  # q/k norms over whole projections: after the linears
    # GPT-OSS: experts stored (experts, in, out) with biases, a router with a bias, attention sinks (the
    # attention output stays a combination of value rows: v -> o holds)
    Arch("gpt_oss", ("gpt_oss",), "model.layers", _moe(router="mlp.router")),
    Arch("deepseek_v3", ("deepseek_v3",), "model.layers", _moe("mlp.shared_experts", attention=_MLA),
         writers=("self_attn.o_proj",)),
    Arch("phi3", ("phi3",), "model.layers", (
        GroupTemplate("input_layernorm", ("self_attn.qkv_proj",), inspect="self_attn"),
        GroupTemplate("self_attn.qkv_proj", ("self_attn.o_proj",), rows="v", heads=True),
        GroupTemplate("post_attention_layernorm", ("mlp.gate_up_proj",), inspect="mlp", local=True),
        GroupTemplate("mlp.gate_up_proj", ("mlp.down_proj",), rows="up"),
    )),
)

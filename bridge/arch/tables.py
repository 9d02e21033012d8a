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
the group exists.

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


class Arch(NamedTuple):
    """A model family: ``model_types`` (``config.model_type``), the ``blocks`` ``nn.ModuleList`` path,
    its smoothing ``groups`` and ``requires``, config attributes that must hold (``(name, value)``)."""

    name: str
    model_types: tuple[str, ...]
    blocks: str
    groups: tuple[GroupTemplate, ...]
    requires: tuple[tuple[str, Any], ...] = ()


#: Norm classes computing ``weight * normalized(x) (+ bias)``: a scale folds into their weight and bias.
FOLDABLE_NORMS = frozenset({"LayerNorm", "LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Phi3RMSNorm"})

_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")

_LLAMA_GROUPS = (
    GroupTemplate("input_layernorm", _QKV, inspect="self_attn"),
    GroupTemplate("self_attn.v_proj", ("self_attn.o_proj",), heads=True),
    GroupTemplate("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), inspect="mlp", local=True),
    GroupTemplate("mlp.up_proj", ("mlp.down_proj",)),
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
    Arch("phi3", ("phi3",), "model.layers", (
        GroupTemplate("input_layernorm", ("self_attn.qkv_proj",), inspect="self_attn"),
        GroupTemplate("self_attn.qkv_proj", ("self_attn.o_proj",), rows="v", heads=True),
        GroupTemplate("post_attention_layernorm", ("mlp.gate_up_proj",), inspect="mlp", local=True),
        GroupTemplate("mlp.gate_up_proj", ("mlp.down_proj",), rows="up"),
    )),
)

"""The types of the model-family table: one :class:`Arch` row per family (the rows are in :mod:`.families`).

A row holds every fact the bridge keys by ``config.model_type``, as plain data (named tuples of strings and
bools): the decoder's repeated blocks and, inside each, which norm or linear feeds which linears (read by
:mod:`.groups` to give SmoothQuant's and AWQ's smoothing groups), the norm classes that fold a scale, whether
the residual stream rotates (:mod:`.residual`), how the family's original checkpoints name experts
(:class:`ExpertNames`, read by ``bridge.interop.experts``) and its GGUF facts (:class:`Gguf`, read by
``bridge.interop.gguf``).

Smoothing groups: paths are relative to a block (``model.layers.3``). A group's ``prev`` is a norm or a linear
whose output the ``linears`` read, through nothing or through an operation that commutes with a positive
per-channel scale:

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

Norm classes the groups may fold into compute ``weight * normalized(x) (+ bias)`` (each row's ``norms``;
:func:`~.families.foldable_norms`); Gemma's ``(1 + weight)`` RMSNorm, for one, does not.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["GroupTemplate", "ExpertNames", "Gguf", "Arch"]


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


class ExpertNames(NamedTuple):
    """How a family's original checkpoints (and vLLM) name a layer's experts, one 2-D tensor per expert:
    ``<moe>.experts.{e}.<gate|up|down>`` (``bridge.interop.experts``)."""

    gate: str
    up: str
    down: str
    moe: str = "mlp"  # the name of the layer's mixture-of-experts module in checkpoints ("block_sparse_moe")


class Gguf(NamedTuple):
    """A family's GGUF facts (``bridge.interop.gguf``): llama.cpp's architecture and what its converter and
    graph fix for it.

    ``arch``: ``general.architecture``; ``permute_qk``: the converter reorders ``q_proj``/``k_proj`` rows per head
    (llama's interleaved rotary pairs); ``key_length``: ``<arch>.attention.key_length`` is always written (not only
    when ``head_dim * heads != hidden``); ``tensors``: per-layer transformers tensors beyond the dense Llama ones
    (a router, a shared expert, q/k norms). Mixture-of-experts families: ``expert_width``, the config key of one
    expert's intermediate size (``intermediate_size``: the experts run in llama's dense graph, Mixtral; any other
    key: an MoE graph of its own, with experts in every layer); ``norm_topk``: the ``norm_topk_prob`` that graph
    hard-codes (``None``: none); ``shared_expert``: ``expert_shared_feed_forward_length`` is written and read.
    """

    arch: str
    permute_qk: bool = False
    key_length: bool = False
    tensors: tuple[str, ...] = ()
    expert_width: str = "intermediate_size"
    norm_topk: bool | None = None
    shared_expert: bool = False


class Arch(NamedTuple):
    """A model family: every fact the bridge keys by ``config.model_type``.

    ``model_types`` (``config.model_type``), the ``blocks`` ``nn.ModuleList`` path, its smoothing ``groups``
    (``()``: a family known for its other facts only, which :func:`~.groups.find_arch` skips) and ``requires``,
    config attributes that must hold (``(name, value)``); ``writers``: linears writing the residual stream that no
    group names as a value -> output pair (rotations); ``norms``: its norm classes computing ``weight *
    normalized(x) (+ bias)``, into which a smoothing scale folds; ``rotatable``: pre-norm with RMSNorm, so its
    residual stream can be rotated; ``sliding_window``: its attention honours ``config.sliding_window``;
    ``expert_count``: the config key of the routed-expert count (``None``: a dense family);
    ``checkpoint_experts``: how its original checkpoints name experts (``None``: no per-expert form);
    ``gguf``: its GGUF facts (``None``: no GGUF export).
    """

    name: str
    model_types: tuple[str, ...]
    blocks: str
    groups: tuple[GroupTemplate, ...]
    requires: tuple[tuple[str, Any], ...] = ()
    writers: tuple[str, ...] = ()
    norms: tuple[str, ...] = ()
    rotatable: bool = False
    sliding_window: bool = False
    expert_count: str | None = None
    checkpoint_experts: ExpertNames | None = None
    gguf: Gguf | None = None

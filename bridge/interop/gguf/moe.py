"""GGUF's mixture-of-experts tensors and metadata (llama.cpp's ``qwen2moe``, ``qwen3moe`` and Mixtral as ``llama``).

llama.cpp's converter (``convert_hf_to_gguf.py``, ``Qwen2MoeModel`` / ``Qwen3MoeModel`` / Mixtral through
``LlamaModel``) stacks a layer's experts into one 3-D tensor per projection, experts the outermost axis:
torch/numpy shape ``(experts, out, in)``, i.e. ggml ``ne = {in, out, experts}``:

==============================================  ===============================================================
our tree path (layer ``N``)                     GGUF tensor
==============================================  ===============================================================
``model.layers.N.mlp.experts.gate_up_proj``     ``blk.N.ffn_gate_exps.weight`` (rows ``:inter``) and
``(E, 2·inter, hidden)``                        ``blk.N.ffn_up_exps.weight`` (rows ``inter:``), each
                                                ``(E, inter, hidden)``
``model.layers.N.mlp.experts.down_proj``        ``blk.N.ffn_down_exps.weight`` ``(E, hidden, inter)``
``model.layers.N.mlp.gate.weight`` (router)     ``blk.N.ffn_gate_inp.weight`` ``(E, hidden)``
``mlp.shared_expert.{gate,up,down}_proj``       ``blk.N.ffn_{gate,up,down}_shexp.weight`` (Qwen2-MoE)
``mlp.shared_expert_gate.weight`` ``(1, H)``    ``blk.N.ffn_gate_inp_shexp.weight`` ``(H,)`` (the converter squeezes it)
==============================================  ===============================================================

Quantized experts are written expert by expert with the dense path's block types (each expert's matrix is an
ordinary 2-D QTensor, :func:`qtransform.stacked.matrix`), so the file holds our codes and scales as they are;
:func:`fuse` reads them back into the stacked tree. Metadata: ``<arch>.expert_count``, ``expert_used_count``,
``expert_feed_forward_length`` and (Qwen2-MoE) ``expert_shared_feed_forward_length`` (``gguf.Keys.LLM``).

What llama.cpp computes is fixed per architecture, so configs that differ are refused by name
(:func:`moe_problems`): ``qwen3moe`` always renormalizes the top-k routing weights (``norm_topk_prob`` must be
true), ``qwen2moe`` never does (false); both have a mixture-of-experts block in every layer
(``decoder_sparse_step`` 1, no ``mlp_only_layers``). Other mixture-of-experts model types (GPT-OSS, whose experts
are stored transposed, OLMoE, DeepSeek...) are refused in :func:`~.arch.arch_problems`. These facts are the
family's (its row's ``gguf``: ``expert_width``, ``norm_topk``, ``shared_expert``, ``tensors``; :mod:`.families`).
"""

from __future__ import annotations

import re

import torch

import qtransform as qt

from ...checkpoint.metadata import CheckpointError
from .. import experts as moe
from .families import family, moe_arches, moe_family

__all__ = ["is_moe", "moe_problems", "write_moe_arch", "expert_pieces", "take_expert_rows", "moe_config", "fuse",
           "hf_moe_names"]

_EXPERTS_PATH = re.compile(r"^model\.layers\.(?P<bid>\d+)\.mlp\.experts\.(?P<w>gate_up_proj|up_proj|down_proj)$")
_EXPS = re.compile(r"^blk\.(?P<bid>\d+)\.ffn_(?P<w>gate|up|down)_exps\.weight$")


def is_moe(config: dict) -> bool:
    """Whether ``config``'s family is a mixture-of-experts one with GGUF facts (:func:`~.families.moe_arches`)."""
    arch = family(config)
    return arch is not None and arch.expert_count is not None


def expert_count(config: dict) -> int:
    return int(config.get("num_local_experts") or config.get("num_experts"))


def moe_problems(config: dict) -> list[str]:
    """Why the mixture-of-experts ``config`` does not compute what llama.cpp's graph of its architecture does."""
    g = family(config).gguf
    own = g.expert_width != "intermediate_size"  # an MoE graph of its own (not llama's dense one, as Mixtral)
    out = []
    missing = [k for k in ("num_experts_per_tok",) + ((g.expert_width,) if own else ()) if not config.get(k)]
    if missing:
        out.append(f"config.json lacks {missing}")
    if g.norm_topk is not None and bool(config.get("norm_topk_prob", False)) != g.norm_topk:
        out.append(f"norm_topk_prob {config.get('norm_topk_prob')!r}: llama.cpp's {g.arch} graph "
                   f"{'always' if g.norm_topk else 'never'} renormalizes the top-k routing weights")
    if own and (config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1):
        out.append(f"mlp_only_layers {config.get('mlp_only_layers')!r} / decoder_sparse_step "
                   f"{config.get('decoder_sparse_step')!r}: llama.cpp's {g.arch} has experts in every layer")
    return out


def write_moe_arch(writer, config: dict) -> None:
    """The expert keys of ``config`` (checked by :func:`moe_problems`)."""
    writer.add_expert_count(expert_count(config))
    writer.add_expert_used_count(int(config["num_experts_per_tok"]))
    writer.add_expert_feed_forward_length(int(config.get("moe_intermediate_size") or config["intermediate_size"]))
    if family(config).gguf.shared_expert and config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(int(config["shared_expert_intermediate_size"]))


def take_expert_rows(leaf, rows: slice | None, path: str):
    """Rows ``rows`` of every expert of the stacked ``leaf`` (a float tensor or a stacked QTensor whose row blocks
    the cut must not straddle); ``None``: all of them."""
    if rows is None:
        return leaf
    if not isinstance(leaf, qt.QTensor):
        return leaf[:, rows]
    mats = [moe.take_rows(qt.stacked.matrix(leaf, e), rows.start, rows.stop, where=path) for e in range(leaf.shape[0])]
    return qt.stacked.stack(mats)


def expert_pieces(path: str, leaf) -> list[tuple[str, slice | None]] | None:
    """``[(GGUF name, rows of each expert or None for all)]`` of the stacked experts weight at tree ``path``;
    ``None``: ``path`` is not one. A fused ``gate_up_proj`` gives gate rows, then up rows."""
    m = _EXPERTS_PATH.match(path)
    if m is None:
        return None
    bid, w = m["bid"], m["w"]
    if w != "gate_up_proj":
        return [(f"blk.{bid}.ffn_{w[:-5]}_exps.weight", None)]
    rows = leaf.shape[1]
    if rows % 2:
        raise ValueError(f"{path}: {rows} rows of shape {tuple(leaf.shape)} do not split into gate and up halves")
    half = rows // 2
    return [(f"blk.{bid}.ffn_gate_exps.weight", slice(0, half)), (f"blk.{bid}.ffn_up_exps.weight", slice(half, rows))]


def hf_moe_names(config: dict) -> list[str]:
    """The per-layer transformers paths (other than the experts) of a mixture-of-experts model of ``config``: its
    row's ``gguf.tensors`` (the router, a shared expert, q/k norms) in every layer."""
    per_layer = family(config).gguf.tensors
    return [f"model.layers.{i}.{n}" for i in range(int(config["num_hidden_layers"])) for n in per_layer]


def _int(reader, key: str) -> int | None:
    field = reader.fields.get(key)
    return None if field is None else int(field.contents())


def moe_config(reader, config: dict, path) -> dict:
    """transformers' config of a GGUF file (``load_gguf_checkpoint``) completed with what its GGUF mapping leaves
    out: Mixtral (``llama`` with ``expert_count``) as ``mixtral``; the expert and shared-expert sizes, the key
    length (``head_dim``) and llama.cpp's fixed ``norm_topk_prob``. Dense files come back unchanged."""
    arch = str(reader.fields["general.architecture"].contents())
    count = _int(reader, f"{arch}.expert_count")
    if not count:
        return config
    out = dict(config)
    row = moe_family(arch)
    if row is None:
        raise CheckpointError(f"{path}: architecture {arch!r} with {count} experts: GGUF import reads "
                              f"mixture-of-experts files of {sorted(set(moe_arches().values()))} only")
    kind, g = row.model_types[0], row.gguf
    used = _int(reader, f"{arch}.expert_used_count")
    if not used:
        raise CheckpointError(f"{path}: metadata key '{arch}.expert_used_count' is missing")
    out["model_type"] = kind
    out["num_experts_per_tok"] = used
    if row.expert_count != "num_experts":  # transformers' GGUF mapping's name: the family's own key instead
        out.pop("num_experts", None)
    out[row.expert_count] = count
    if g.expert_width == "intermediate_size":  # llama's dense graph (Mixtral): feed_forward_length is the width
        return out
    ff = _int(reader, f"{arch}.expert_feed_forward_length")
    if not ff:
        raise CheckpointError(f"{path}: metadata key '{arch}.expert_feed_forward_length' is missing")
    out[g.expert_width] = ff
    if g.norm_topk is not None:
        out["norm_topk_prob"] = g.norm_topk
    shared = _int(reader, f"{arch}.expert_shared_feed_forward_length")
    if g.shared_expert:
        out["shared_expert_intermediate_size"] = shared or 0
    key_length = _int(reader, f"{arch}.attention.key_length")
    if key_length:
        out["head_dim"] = key_length
    return out


def fuse(parts: dict[str, object], path) -> dict[str, object]:
    """``{GGUF expert tensor name: 3-D leaf}`` -> our tree's ``<experts>.gate_up_proj`` (gate rows then up rows of
    each expert) and ``down_proj``; :class:`CheckpointError` naming the file for a half that is missing or differs."""
    layers: dict[str, dict[str, object]] = {}
    for name, leaf in parts.items():
        m = _EXPS.match(name)
        layers.setdefault(m["bid"], {})[m["w"]] = leaf
    out = {}
    for bid, ws in sorted(layers.items(), key=lambda kv: int(kv[0])):
        base = f"model.layers.{bid}.mlp.experts"
        if "down" not in ws or "up" not in ws:
            raise CheckpointError(f"{path}: layer {bid}: expert tensors {sorted(ws)} lack "
                                  f"{sorted({'up', 'down'} - set(ws))}")
        out[f"{base}.down_proj"] = ws["down"]
        if "gate" not in ws:
            out[f"{base}.up_proj"] = ws["up"]
            continue
        gate, up = ws["gate"], ws["up"]
        if tuple(gate.shape) != tuple(up.shape):
            raise CheckpointError(f"{path}: blk.{bid}.ffn_gate_exps {tuple(gate.shape)} and ffn_up_exps "
                                  f"{tuple(up.shape)} differ in shape")
        if isinstance(gate, qt.QTensor) != isinstance(up, qt.QTensor):
            raise CheckpointError(f"{path}: blk.{bid}: one of ffn_gate_exps / ffn_up_exps is quantized, the other not")
        if isinstance(gate, qt.QTensor):
            where = f"{path}: blk.{bid}"
            mats = [moe.cat_rows([qt.stacked.matrix(gate, e), qt.stacked.matrix(up, e)], where=where)
                    for e in range(gate.shape[0])]
            out[f"{base}.gate_up_proj"] = qt.stacked.stack(mats)
        else:
            if gate.dtype != up.dtype:
                raise CheckpointError(f"{path}: blk.{bid}: ffn_gate_exps {gate.dtype} and ffn_up_exps {up.dtype}")
            out[f"{base}.gate_up_proj"] = torch.cat([gate, up], dim=1)
    return out


def is_expert_tensor(name: str) -> bool:
    return _EXPS.match(name) is not None

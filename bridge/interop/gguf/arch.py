"""GGUF's side of a transformers model: architecture metadata, tensor names, the llama Q/K row
order, and the tokenizer.

* **Architectures**: transformers ``model_type`` -> GGUF ``general.architecture``, each family's row's
  ``gguf`` (``bridge.arch.ARCHS``, viewed by :mod:`.families`): ``llama``, ``mistral`` (llama.cpp runs
  Mistral as ``llama``; transformers then reads it back as Llama, the same computation without a sliding
  window) and ``qwen2``. The hyper-parameters are the keys
  transformers' GGUF loader and llama.cpp read: ``<arch>.context_length``, ``embedding_length``,
  ``block_count``, ``feed_forward_length``, ``attention.head_count(_kv)``,
  ``attention.layer_norm_rms_epsilon``, ``rope.freq_base``, ``rope.dimension_count``, ``vocab_size``.
  Mixture-of-experts models: Qwen2-MoE (``qwen2moe``), Qwen3-MoE (``qwen3moe``) and Mixtral (``llama`` with
  ``expert_count``), their 3-D ``blk.N.ffn_{gate,up,down}_exps`` tensors and expert keys in :mod:`.moe`; other
  models with an expert count (GPT-OSS, OLMoE, DeepSeek...) are refused by name.
* **Names**: the ``gguf`` package's tensor-name map (``model.layers.3.self_attn.q_proj.weight`` ->
  ``blk.3.attn_q.weight``), as transformers uses it to load GGUF files.
* **Q/K rows**: llama.cpp's ``llama`` architecture applies rotary embeddings to interleaved pairs,
  so its converter reorders the rows of ``q_proj``/``k_proj`` per head (``(heads, 2, d/2)`` ->
  ``(heads, d/2, 2)``); transformers undoes it on load. Whole rows move, so quantized rows (codes,
  scales and zero points of groups along the row) move losslessly. Qwen2 (NeoX rotary) keeps them
  (the row's ``gguf.permute_qk``).
* **Tokenizer**: a byte-level BPE ``tokenizer.json`` (GPT-2 style, what SmolLM2, Llama 3 and Qwen2
  ship) -> ``tokenizer.ggml.model = "gpt2"``, the pre-tokenizer's llama.cpp name (``smollm``,
  ``gpt-2``, ``llama-bpe``, ``qwen2``), tokens, types (special added tokens CONTROL), merges, special
  token ids, ``add_bos_token`` and the chat template, through the ``gguf`` package's vocabulary
  readers. A checkpoint made from a GGUF model carries the tokenizer ``bridge.save(...,
  tokenizer=)`` wrote (``qtransform quantize`` passes it).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import qtransform as qt

from . import moe as gguf_moe
from .families import arches, expert_counts, family, moe_arches

__all__ = ["arches", "arch_of", "arch_problems", "write_arch", "tensor_name_map", "qk_rows", "reorder_rows",
           "write_tokenizer", "hf_names", "HF_PRE_TOKENIZERS", "pre_tokenizer_name"]


def arch_of(config: dict) -> str | None:
    """The GGUF architecture of ``config``'s family (``None``: no GGUF export)."""
    arch = family(config)
    return None if arch is None else arch.gguf.arch


def _rope(config: dict) -> tuple[float, str]:
    """``(rope_theta, rope_type)`` from a transformers 4 or 5 config."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) if params else "default"
    return float(theta), kind


def _head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def arch_problems(config: dict) -> list[str]:
    """Why a model of transformers ``config`` cannot become a GGUF file here (empty: it can)."""
    kind = config.get("model_type")
    experts = next((config[k] for k in expert_counts() if config.get(k)), None)
    if experts is not None and not gguf_moe.is_moe(config):
        return [f"architecture {kind!r} is a mixture-of-experts model ({experts} experts): this GGUF exporter writes "
                f"expert tensors for the model types {sorted(moe_arches())} only (llama.cpp's "
                "blk.N.ffn_gate_exps / ffn_up_exps / ffn_down_exps); export it to compressed-tensors or quark"]
    arch = family(config)
    if arch is None:
        return [f"architecture {kind!r}: GGUF export supports {sorted(arches())}"]
    out = []
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if k not in config]
    if missing:
        out.append(f"config.json lacks {missing}")
    _, rope = _rope(config)
    if rope != "default":
        out.append(f"rope scaling {rope!r}: this exporter writes unscaled rotary embeddings only")
    if gguf_moe.is_moe(config):
        out += gguf_moe.moe_problems(config)
    window = config.get("sliding_window")
    if arch.sliding_window and window is not None and window < config.get("max_position_embeddings", 0):
        out.append(f"sliding_window {window} below the context length: llama.cpp's llama architecture has none")
    return out


def write_arch(writer, config: dict, name: str) -> None:
    """The ``general.*`` and ``<arch>.*`` keys of ``config`` (checked by :func:`arch_problems`)."""
    heads = int(config["num_attention_heads"])
    theta, _ = _rope(config)
    writer.add_name(name)
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or heads))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_rope_freq_base(theta)
    head_dim = _head_dim(config)
    writer.add_rope_dimension_count(head_dim)
    arch = family(config)
    if head_dim * heads != int(config["hidden_size"]) or (arch is not None and arch.gguf.key_length):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(int(config["vocab_size"]))
    if gguf_moe.is_moe(config):
        gguf_moe.write_moe_arch(writer, config)


def tensor_name_map(arch: str, blocks: int):
    """The ``gguf`` package's HF -> GGUF tensor-name map of ``arch``."""
    import gguf

    key = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    return gguf.get_tensor_name_map(key, blocks)


def hf_names(names, arch: str, blocks: int) -> dict[str, str | None]:
    """``{HF tensor path: GGUF name or None}`` for tree paths ``names``."""
    m = tensor_name_map(arch, blocks)
    out = {}
    for path in names:
        stem, dot, suffix = path.rpartition(".")
        base = m.get_name(stem) if suffix in ("weight", "bias") else None
        out[path] = None if base is None else f"{base}.{suffix}"
    return out


def qk_rows(path: str, config: dict, rows: int, *, inverse: bool = False) -> torch.Tensor | None:
    """Row order llama.cpp's converter gives ``q_proj``/``k_proj`` of ``config``'s llama-family model
    (``new = old[index]``; ``inverse``: back to transformers' order), ``None`` for other tensors."""
    arch = family(config)
    if arch is None or not arch.gguf.permute_qk or not path.endswith(".weight"):
        return None
    if ".self_attn.q_proj." in path:
        heads = int(config["num_attention_heads"])
    elif ".self_attn.k_proj." in path:
        heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    else:
        return None
    if rows % (2 * heads):
        raise ValueError(f"{path}: {rows} rows do not split into {heads} heads of pairs")
    index = torch.arange(rows).reshape(heads, 2, rows // heads // 2).transpose(1, 2).reshape(rows)
    return torch.argsort(index) if inverse else index


def reorder_rows(leaf, index: torch.Tensor | None):
    """``leaf`` (a tensor or a :class:`~qtransform.QTensor`) with its rows taken in ``index`` order
    (:func:`qk_rows`); a QTensor's codes, scales and zero points of groups along the rows move with them."""
    if index is None:
        return leaf
    if not isinstance(leaf, qt.QTensor):
        return leaf.index_select(0, index)
    qp = leaf.qparams
    fields = {k: (v.index_select(0, index) if v.dim() and v.shape[0] == leaf.shape[0] else v)
              for k, v in qp.tensors().items()}
    return qt.QTensor(codes=leaf.codes.index_select(0, index), qparams=qt.QParams(spec=qp.spec, **fields),
                      width=leaf.width, dtype=leaf.dtype)


#: Pre-tokenizer split patterns of byte-level BPE tokenizers -> llama.cpp's ``tokenizer.ggml.pre`` names.
_SPLITS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+": "qwen2",
}

#: llama.cpp pre-tokenizer names -> the ``tokenizer.json`` pre-tokenizer that splits text the same way
#: (GPT-2's regex inside ``ByteLevel``; ``smollm``: every digit on its own first, as SmolLM2's
#: ``tokenizer.json`` does). transformers reads GGUF tokenizers as plain ``ByteLevel``.
HF_PRE_TOKENIZERS = {
    "gpt-2": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    "smollm": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
}


def _steps(pre: dict) -> list[dict]:
    return list(pre.get("pretokenizers", [pre])) if pre else []


def _byte_level_regex(step: dict) -> bool:
    return step.get("type") == "ByteLevel" and step.get("use_regex", True)


def pre_tokenizer_name(pre: dict | None) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` name of a ``tokenizer.json`` ``pre_tokenizer`` entry: Llama 3's
    and Qwen2's split patterns are named; single digits then GPT-2's regex (SmolLM2) is ``smollm``;
    GPT-2's regex alone (a ``ByteLevel`` step that splits) is ``gpt-2``; anything else ``default``.

    >>> pre_tokenizer_name(HF_PRE_TOKENIZERS["smollm"]), pre_tokenizer_name({"type": "ByteLevel"})
    ('smollm', 'gpt-2')
    """
    steps = _steps(pre or {})
    splits = [st.get("pattern", {}).get("Regex") for st in steps if st.get("type") == "Split"]
    if splits:
        return _SPLITS.get(splits[0], "default")
    if len(steps) == 2 and steps[0] == {"type": "Digits", "individual_digits": True} and _byte_level_regex(steps[1]):
        return "smollm"
    return "gpt-2" if len(steps) == 1 and _byte_level_regex(steps[0]) else "default"


def _tokenizer_json(directory: Path) -> dict:
    path = directory / "tokenizer.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_types(tok_json: dict, types: list) -> list:
    """Added tokens typed as llama.cpp's converter types them: special ones CONTROL (parsed as special
    tokens, never split), the others USER_DEFINED; the rest of ``types`` as given."""
    import gguf

    out = list(types)
    for added in tok_json.get("added_tokens", []):
        i = int(added["id"])
        if i < len(out):
            out[i] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    return out


def write_tokenizer(writer, directory: Path, vocab_size: int) -> str | None:
    """Tokenizer keys from the files in ``directory``; the reason when there is none to write."""
    import gguf
    from gguf.vocab import BpeVocab, SpecialVocab

    if not (directory / "tokenizer.json").is_file() and not (directory / "vocab.json").is_file():
        return ("no tokenizer files beside the checkpoint: the GGUF file has no tokenizer (llama.cpp needs one; "
                "save the checkpoint with bridge.save(..., tokenizer=tokenizer))")
    try:
        vocab = BpeVocab(directory)
    except (FileNotFoundError, ValueError, KeyError) as e:
        return f"tokenizer not written: only byte-level BPE tokenizers are supported ({e})"
    tokens, types = [], []
    for text, _, kind in vocab.all_tokens():
        tokens.append(text)
        types.append(kind)
    tok_json = _tokenizer_json(directory)
    types = _token_types(tok_json, types)
    pad = range(len(tokens), vocab_size)  # rows of the embedding beyond the tokenizer: padding tokens
    tokens += [f"[PAD{i}]" for i in pad]
    types += [gguf.TokenType.UNUSED] * len(pad)
    pre = tok_json.get("pre_tokenizer") if tok_json else {"type": "ByteLevel"}  # vocab.json + merges.txt: GPT-2
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(pre))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = SpecialVocab(directory, load_merges=True, n_vocab=len(tokens))
    special.add_to_gguf(writer, quiet=True)
    if "bos" not in special.add_special_token:  # said explicitly: llama.cpp's default differs by model
        writer.add_add_bos_token(False)
    writer.add_add_space_prefix(any(st.get("add_prefix_space", False) for st in _steps(pre or {})
                                    if st.get("type") == "ByteLevel"))
    return None

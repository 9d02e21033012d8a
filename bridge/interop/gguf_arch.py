"""GGUF's side of a transformers model: architecture metadata, tensor names, the llama Q/K row
order, and the tokenizer.

* **Architectures**: transformers ``model_type`` -> GGUF ``general.architecture``: ``llama``,
  ``mistral`` (llama.cpp runs Mistral as ``llama``; transformers then reads it back as Llama,
  the same computation without a sliding window) and ``qwen2``. The hyper-parameters are the keys
  transformers' GGUF loader and llama.cpp read: ``<arch>.context_length``, ``embedding_length``,
  ``block_count``, ``feed_forward_length``, ``attention.head_count(_kv)``,
  ``attention.layer_norm_rms_epsilon``, ``rope.freq_base``, ``rope.dimension_count``, ``vocab_size``.
* **Names**: the ``gguf`` package's tensor-name map (``model.layers.3.self_attn.q_proj.weight`` ->
  ``blk.3.attn_q.weight``), as transformers uses it to load GGUF files.
* **Q/K rows**: llama.cpp's ``llama`` architecture applies rotary embeddings to interleaved pairs,
  so its converter reorders the rows of ``q_proj``/``k_proj`` per head (``(heads, 2, d/2)`` ->
  ``(heads, d/2, 2)``); transformers undoes it on load. Whole rows move, so quantized rows (codes,
  scales and zero points of groups along the row) move losslessly. Qwen2 (NeoX rotary) keeps them.
* **Tokenizer**: a byte-level BPE ``tokenizer.json`` (GPT-2 style, what SmolLM2, Llama 3 and Qwen2
  ship) -> ``tokenizer.ggml.model = "gpt2"``, tokens, types, merges, special token ids and the chat
  template, through the ``gguf`` package's vocabulary readers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["ARCHES", "arch_of", "arch_problems", "write_arch", "tensor_name_map", "qk_rows", "write_tokenizer",
           "hf_names"]

#: transformers ``model_type`` -> GGUF architecture.
ARCHES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
#: Architectures whose Q/K rows llama.cpp's converter permutes.
_PERMUTED = ("llama",)


def arch_of(config: dict) -> str | None:
    return ARCHES.get(config.get("model_type"))


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
    if kind not in ARCHES:
        return [f"architecture {kind!r}: GGUF export supports {sorted(ARCHES)}"]
    out = []
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if k not in config]
    if missing:
        out.append(f"config.json lacks {missing}")
    _, rope = _rope(config)
    if rope != "default":
        out.append(f"rope scaling {rope!r}: this exporter writes unscaled rotary embeddings only")
    window = config.get("sliding_window")
    if kind == "mistral" and window is not None and window < config.get("max_position_embeddings", 0):
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
    if head_dim * heads != int(config["hidden_size"]):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(int(config["vocab_size"]))


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
    if ARCHES.get(config.get("model_type")) not in _PERMUTED or not path.endswith(".weight"):
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


#: Pre-tokenizer split patterns of byte-level BPE tokenizers -> llama.cpp's ``tokenizer.ggml.pre`` names.
_SPLITS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+": "qwen2",
}


def _pre_tokenizer(directory: Path) -> str:
    """llama.cpp's name for the pre-tokenizer of ``tokenizer.json``: GPT-2's own regex (a ``ByteLevel``
    step that splits) is ``gpt-2``; Llama 3's and Qwen2's split patterns are named; else ``default``."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return "gpt-2"  # vocab.json + merges.txt: GPT-2's byte-level BPE
    pre = json.loads(path.read_text(encoding="utf-8")).get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    splits = [st.get("pattern", {}).get("Regex") for st in steps if st.get("type") == "Split"]
    if splits:
        return _SPLITS.get(splits[0], "default")
    return "gpt-2" if any(st.get("type") == "ByteLevel" and st.get("use_regex", True) for st in steps) else "default"


def write_tokenizer(writer, directory: Path, vocab_size: int) -> str | None:
    """Tokenizer keys from the files in ``directory``; the reason when there is none to write."""
    import gguf
    from gguf.vocab import BpeVocab, SpecialVocab

    if not (directory / "tokenizer.json").is_file() and not (directory / "vocab.json").is_file():
        return "no tokenizer files beside the checkpoint: the GGUF file has no tokenizer (llama.cpp needs one)"
    try:
        vocab = BpeVocab(directory)
    except (FileNotFoundError, ValueError, KeyError) as e:
        return f"tokenizer not written: only byte-level BPE tokenizers are supported ({e})"
    tokens, types = [], []
    for text, _, kind in vocab.all_tokens():
        tokens.append(text)
        types.append(kind)
    if len(tokens) < vocab_size:  # rows of the embedding beyond the tokenizer: padding tokens
        for i in range(len(tokens), vocab_size):
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(directory))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    SpecialVocab(directory, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    return None

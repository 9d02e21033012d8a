"""Checkpoints: ``save`` / ``load`` as safetensors shards + JSON (never pickle).

A checkpoint directory holds ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors``
shards and ``model.safetensors.index.json``), ``config.json`` with the
``quantization_config`` of :mod:`bridge.metadata` (the full transformers config for a
transformers model, whose tokenizer and generation files are written alongside), so
``AutoModelForCausalLM.from_pretrained(directory)`` reads it too. Quantized tensors are
stored as their parts (:mod:`bridge.qstate`); a tensor tied to another is stored once
(``aliases``). Saving writes a temporary directory and renames it at the end; loading
checks every name, shape and dtype against the model before reading data, and rebuilds
only the allow-listed quantized modules.

>>> import tempfile, torch, qtransform as qt
>>> import bridge
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 32))
>>> qmodel = bridge.quantize(model, qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)))
>>> d = tempfile.mkdtemp() + "/ckpt"
>>> bridge.save(qmodel, d)
>>> back = bridge.load(d, like=model)
>>> torch.equal(back[0].weight, qmodel[0].weight), type(back[0]).__name__
(True, 'QLinear')
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from qtransform.qtypes import QTensor

from . import metadata
from .extract import extract
from .metadata import CheckpointError
from .qstate import abstract_qtensor, dtype_name, from_named, named_tensors
from .rebuild import flatten_tree, to_module

__all__ = ["save", "load", "CheckpointError", "parse_size"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json", "chat_template.jinja")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size) -> int:
    """``"2GB"`` -> 2_000_000_000 bytes (ints pass through; KiB/MiB/GiB are powers of two)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if m is None or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"max_shard_size must be a positive int or a size like '2GB', got {size!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


# ----------------------------------------------------------------------------- save
def _groups(tree: dict) -> tuple[list[dict[str, torch.Tensor]], dict[str, str]]:
    """Tensors to write, grouped (a QTensor's parts together), and aliases of tied tensors."""
    groups, seen, aliases, names = [], {}, {}, set()
    for path, leaf in tree.items():
        if isinstance(leaf, QTensor):
            group = named_tensors(path, leaf)
        elif isinstance(leaf, torch.Tensor):
            key = (leaf.untyped_storage().data_ptr(), leaf.storage_offset(), tuple(leaf.shape),
                   tuple(leaf.stride()), leaf.dtype, leaf.device)
            if leaf.numel() and key in seen:
                aliases[path] = seen[key]
                continue
            seen[key] = path
            group = {path: leaf}
        else:
            raise TypeError(f"{path}: tree leaves must be tensors or QTensors, got {type(leaf).__name__}")
        clash = names & set(group)
        if clash:
            raise ValueError(f"{path}: stored name(s) {sorted(clash)} clash with another tensor of the tree")
        names |= set(group)
        groups.append({n: t.detach().to("cpu").contiguous() for n, t in group.items()})
    return groups, aliases


def _shards(groups, limit: int) -> list[dict[str, torch.Tensor]]:
    shards, cur, size = [], {}, 0
    for g in groups:
        n = sum(t.numel() * t.element_size() for t in g.values())
        if cur and size + n > limit:
            shards.append(cur)
            cur, size = {}, 0
        cur.update(g)
        size += n
    if cur or not shards:
        shards.append(cur)
    return shards


def _write_extras(model, tmp: Path, qconfig: dict, tokenizer) -> None:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        d = json.loads(config.to_json_string(use_diff=False))
        d["quantization_config"] = qconfig
        if hasattr(model, "can_generate") and model.can_generate() and getattr(model, "generation_config", None):
            model.generation_config.save_pretrained(tmp)
        source = getattr(config, "_name_or_path", "") or ""
        if tokenizer is None and source and os.path.isdir(source):
            for name in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(source, name)):
                    shutil.copy2(os.path.join(source, name), tmp / name)
    else:
        d = {"quantization_config": qconfig}
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    (tmp / CONFIG).write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")


def save(model_or_qtree, directory, *, max_shard_size="2GB", overwrite: bool = False, recipe=None,
         tokenizer=None, info: dict | None = None) -> None:
    """Write a quantized model (or quantized tree) to ``directory`` as a qtransform checkpoint.

    Args:
        model_or_qtree: a model with quantized modules (from :func:`bridge.quantize` or
            :func:`bridge.to_module`) or a tree ``{path: Tensor | QTensor}``.
        directory: target directory; must not exist or be empty unless ``overwrite``.
        max_shard_size: bytes per shard (``"2GB"``, ``"500MiB"`` or an int).
        overwrite: replace an existing non-empty directory.
        recipe: the :class:`~qtransform.Recipe` used, recorded in the metadata.
        tokenizer: a tokenizer to save alongside (``save_pretrained``).
        info: extra JSON-able fields for the metadata (e.g. ``{"algorithm": "hqq", "rules": {...}}``).
    """
    limit = parse_size(max_shard_size)
    target = Path(directory)
    if target.exists() and (not target.is_dir() or (any(target.iterdir()) and not overwrite)):
        raise FileExistsError(f"{target} exists and is not an empty directory; pass overwrite=True to replace it")
    model = model_or_qtree if isinstance(model_or_qtree, nn.Module) else None
    tree = extract(model) if model is not None else flatten_tree(model_or_qtree)
    groups, aliases = _groups(tree)
    quantized = {p: q for p, q in tree.items() if isinstance(q, QTensor)}
    extra = {"aliases": aliases} if aliases else {}
    cfg = getattr(getattr(model, "config", None), "quantization_config", None)
    if recipe is None and getattr(cfg, "recipe", None) is not None:
        recipe = cfg.recipe
    if recipe is not None:
        from qtransform import as_recipe
        extra["recipe"] = as_recipe(recipe).to_dict()
    qconfig = metadata.encode(metadata.entries_of(quantized), **{**(info or {}), **extra})

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        shards = _shards(groups, limit)
        file_meta = {"format": "pt", "quant_method": metadata.QUANT_METHOD, "version": str(metadata.VERSION)}
        names = [SINGLE] if len(shards) == 1 else \
            [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for name, shard in zip(names, shards):
            save_file(shard, str(tmp / name), metadata=file_meta)
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for s in shards for t in s.values()),
                                  "quant_method": metadata.QUANT_METHOD},
                     "weight_map": {n: f for f, s in zip(names, shards) for n in s}}
            (tmp / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        _write_extras(model, tmp, qconfig, tokenizer)
        if target.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.rename(target, trash / "old")
            os.rename(tmp, target)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------- load
def _read_json(path: Path, what: str):
    if not path.is_file():
        raise CheckpointError(f"{path}: missing ({what})")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: malformed JSON ({e})") from None


def _open_shards(root: Path) -> tuple[dict[str, str], dict[str, object]]:
    """``{tensor name: file}`` and open handles, validating the index against the files."""
    if (root / INDEX).is_file():
        index = _read_json(root / INDEX, "shard index")
        wmap = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise CheckpointError(f"{root / INDEX}: needs a 'weight_map' object of tensor name -> file name")
        files = sorted(set(wmap.values()))
    elif (root / SINGLE).is_file():
        wmap, files = None, [SINGLE]
    else:
        raise CheckpointError(f"{root}: no {SINGLE} and no {INDEX}")
    handles, located = {}, {}
    for f in files:
        if "/" in f or "\\" in f or f.startswith("."):
            raise CheckpointError(f"{root / INDEX}: shard name {f!r} is not a plain file name")
        path = root / f
        if not path.is_file():
            raise CheckpointError(f"{path}: shard listed in the index is missing")
        try:
            h = safe_open(str(path), framework="pt", device="cpu")
            keys = list(h.keys())
        except Exception as e:  # safetensors raises its own error types for truncated/garbled files
            raise CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
        handles[f] = h
        for k in keys:
            if k in located:
                raise CheckpointError(f"{path}: tensor {k!r} is also stored in {located[k]}")
            located[k] = f
    if wmap is not None:
        for k, f in wmap.items():
            if located.get(k) != f:
                raise CheckpointError(f"{root / INDEX}: tensor {k!r} is mapped to {f}, but "
                                      + (f"it is stored in {located[k]}" if k in located else "no shard holds it"))
    return located, handles


def _expected(like: nn.Module, entries, aliases) -> tuple[dict, dict]:
    """``{stored name: (shape, dtype)}`` the checkpoint must hold, and the reference tree."""
    ref = extract(like)
    for path in list(entries) + list(aliases):
        if path not in ref:
            raise CheckpointError(f"{CONFIG}: tensor {path!r} is not a tensor of {type(like).__name__}")
    for path, target in aliases.items():
        if target not in ref or target in aliases or path in entries:
            raise CheckpointError(f"{CONFIG}: alias {path!r} -> {target!r} does not name a stored tensor")
    expected = {}
    for path, leaf in ref.items():
        if path in aliases:
            continue
        if path in entries:
            e = entries[path]
            if tuple(leaf.shape) != e.shape:
                raise CheckpointError(f"{CONFIG}: quantized tensor {path!r} has shape {list(e.shape)}, "
                                      f"the model's is {list(leaf.shape)}")
            try:
                parts = named_tensors(path, abstract_qtensor(e.shape, e.dtype, e.spec))
            except ValueError as err:
                raise CheckpointError(f"{CONFIG}: {path}: {err}") from None
        elif isinstance(leaf, QTensor):
            raise CheckpointError(f"{CONFIG}: {path!r} is quantized in the model but not in the checkpoint")
        else:
            parts = {path: leaf}
        expected.update({n: (tuple(t.shape), t.dtype) for n, t in parts.items()})
    return expected, ref


def load(directory, *, like: nn.Module, kernel: str = "auto") -> nn.Module:
    """Rebuild the quantized model saved in ``directory``.

    ``like`` gives the structure: the float model (or a skeleton of it, e.g. built from its
    config) with the same parameter names. Returns a new model (``like`` is untouched) with
    quantized modules holding the stored codes and qparams bit for bit. Raises
    :class:`CheckpointError` naming the file and tensor for any missing, extra, truncated or
    mistyped tensor and for malformed, unknown-version or unknown-format metadata.
    """
    if not isinstance(like, nn.Module):
        raise TypeError(f"like must be a torch.nn.Module, got {type(like).__name__}")
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    config = _read_json(root / CONFIG, "checkpoint config")
    if not isinstance(config, dict) or "quantization_config" not in config:
        raise CheckpointError(f"{root / CONFIG}: no quantization_config")
    qcfg = config["quantization_config"]
    entries = metadata.decode(qcfg, where=str(root / CONFIG))
    aliases = qcfg.get("aliases", {})
    if not isinstance(aliases, dict):
        raise CheckpointError(f"{root / CONFIG}: quantization_config 'aliases' must be an object")
    located, handles = _open_shards(root)
    expected, ref = _expected(like, entries, aliases)
    missing = sorted(set(expected) - set(located))
    extra = sorted(set(located) - set(expected))
    if missing:
        raise CheckpointError(f"{root}: missing tensor(s) {missing[:5]}" + (" ..." if len(missing) > 5 else ""))
    if extra:
        raise CheckpointError(f"{root / located[extra[0]]}: unexpected tensor(s) {extra[:5]} (not in the model "
                              "or its quantization_config)")
    for name, (shape, dtype) in expected.items():
        sl = handles[located[name]].get_slice(name)
        got_shape, got_dtype = tuple(sl.get_shape()), sl.get_dtype()
        want_dtype = _ST_DTYPES.get(dtype, dtype_name(dtype))
        if got_shape != shape or got_dtype != want_dtype:
            raise CheckpointError(f"{root / located[name]}: tensor {name!r} has shape {list(got_shape)} and dtype "
                                  f"{got_dtype}, expected {list(shape)} and {want_dtype}")
    tensors = {}
    for name in expected:
        try:
            tensors[name] = handles[located[name]].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{root / located[name]}: cannot read tensor {name!r} ({e})") from None
    tree = {}
    for path in ref:
        if path in aliases:
            continue
        if path in entries:
            e = entries[path]
            tree[path] = from_named(path, tensors, spec=e.spec, width=e.shape[-1], dtype=e.dtype)
        else:
            tree[path] = tensors[path]
    for path, target in aliases.items():
        tree[path] = tree[target]
    model = to_module(like, tree, kernel=kernel)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(f"{root}: {left[:5]} have no value (not in the checkpoint; build `like` on a real "
                              "device so that non-persistent buffers are initialized)")
    return model


_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
              torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ"}

"""Damage for the import fuzzing test (``test_import_fuzz.py``): seeded mutations of a Quark or
compressed-tensors export (``model.safetensors`` + ``config.json``), and the classification of one load.

Every mutation is ``fn(directory, rng) -> str``: it damages the copy in ``directory`` in place, drawing
every choice from ``rng`` (a ``random.Random``), and says what it did in a few words. The GGUF
mutations are in :mod:`interop.fuzz_gguf`."""

from __future__ import annotations

import copy
import hashlib
import json
import struct
import traceback
from pathlib import Path

import torch

import bridge
import qtransform as qt

ST = "model.safetensors"
CFG = "config.json"
ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
            "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
SAME_SIZE = {"F32": ["I32", "U32"], "I32": ["F32", "U32"], "I8": ["U8", "F8_E4M3", "BOOL"], "U8": ["I8", "F8_E4M3"],
             "F8_E4M3": ["I8", "U8", "F8_E5M2"], "I64": ["F64", "U64"], "F16": ["BF16", "I16"], "BF16": ["F16"]}
QPARAM_SUFFIXES = ("weight_scale", "weight_zero_point", "input_scale", "weight_shape", "k_scale", "v_scale",
                   "output_scale", "input_zero_point")


# ------------------------------------------------------------------------------------------ safetensors
def read_st(d: Path):
    """``(header, data, header_length)`` of ``d/model.safetensors`` (``header`` keeps ``__metadata__``)."""
    b = (d / ST).read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    return json.loads(b[8:8 + n]), b[8 + n:], n


def write_raw(d: Path, header: dict, data: bytes):
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    (d / ST).write_bytes(struct.pack("<Q", len(h)) + h + data)


def tensors_of(header: dict, data: bytes) -> dict:
    """``{name: [dtype, shape, bytes]}`` in file order."""
    return {k: [v["dtype"], list(v["shape"]), data[v["data_offsets"][0]:v["data_offsets"][1]]]
            for k, v in header.items() if k != "__metadata__"}


def write_tensors(d: Path, meta: dict | None, tensors: dict):
    """A well-formed file of ``tensors`` (contiguous offsets, in the given order)."""
    header, chunks, at = ({"__metadata__": meta} if meta is not None else {}), [], 0
    for k, (dtype, shape, raw) in tensors.items():
        header[k] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(raw)]}
        chunks.append(raw)
        at += len(raw)
    write_raw(d, header, b"".join(chunks))


def _names(header):
    return [k for k in header if k != "__metadata__"]


def _flip(b: bytes, pos: int, bit: int) -> bytes:
    return b[:pos] + bytes([b[pos] ^ (1 << bit)]) + b[pos + 1:]


def st_truncate(d, rng):
    b = (d / ST).read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    where = rng.choice(["in the length", "in the header", "in the data", "last byte"])
    cut = {"in the length": rng.randrange(0, 8), "in the header": rng.randrange(8, 8 + n),
           "in the data": rng.randrange(8 + n, len(b) - 1), "last byte": len(b) - 1}[where]
    (d / ST).write_bytes(b[:cut])
    return f"truncated {where} at {cut}/{len(b)}"


def st_flip_data(d, rng):
    header, data, n = read_st(d)
    name = rng.choice(_names(header))
    lo, hi = header[name]["data_offsets"]
    pos, bit = rng.randrange(lo, hi), rng.randrange(8)
    write_raw_bytes = (d / ST).read_bytes()
    (d / ST).write_bytes(_flip(write_raw_bytes, 8 + n + pos, bit))
    return f"bit {bit} of byte {pos - lo} of {name}"


def st_flip_header(d, rng):
    b = (d / ST).read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    pos, bit = rng.randrange(8, 8 + n), rng.randrange(7)
    ctx = b[max(8, pos - 12):pos + 4].decode("latin-1")
    (d / ST).write_bytes(_flip(b, pos, bit))
    return f"header bit {bit} at {pos} ({ctx!r})"


def st_dtype(d, rng):
    header, data, _ = read_st(d)
    name = rng.choice(_names(header))
    old = header[name]["dtype"]
    new = rng.choice(SAME_SIZE.get(old, ["F32"]) if rng.random() < 0.75 else sorted(set(ITEMSIZE) - {old}))
    header[name]["dtype"] = new
    write_raw(d, header, data)
    return f"{name} dtype {old}->{new}"


def st_shape(d, rng):
    header, data, _ = read_st(d)
    name = rng.choice([k for k in _names(header) if len(header[k]["shape"]) == 2] or _names(header))
    old = list(header[name]["shape"])
    numel = 1
    for s in old:
        numel *= s
    options = [old[::-1], [numel], [1, numel], [old[0] + 1] + old[1:], [max(old[0] // 2, 1)] + old[1:]]
    if len(old) == 2 and old[0] % 2 == 0:
        options.append([old[0] // 2, old[1] * 2])
    new = rng.choice([o for o in options if o != old])
    header[name]["shape"] = new
    write_raw(d, header, data)
    return f"{name} shape {old}->{new}"


def st_offsets(d, rng):
    header, data, _ = read_st(d)
    name = rng.choice(_names(header))
    lo, hi = header[name]["data_offsets"]
    step = ITEMSIZE.get(header[name]["dtype"], 1) * rng.choice([1, -1])
    which = rng.choice(["both", "end"])
    header[name]["data_offsets"] = [lo + step, hi + step] if which == "both" else [lo, hi + step]
    write_raw(d, header, data)
    return f"{name} data_offsets {which} by {step:+d}"


def st_delete(d, rng, qparams_only=False):
    header, data, _ = read_st(d)
    names = _names(header)
    if qparams_only:
        names = [k for k in names if k.endswith(QPARAM_SUFFIXES)] or names
    name = rng.choice(names)
    ts = tensors_of(header, data)
    del ts[name]
    write_tensors(d, header.get("__metadata__"), ts)
    return f"deleted {name}"


def st_delete_qparam(d, rng):
    return st_delete(d, rng, qparams_only=True)


def st_rename(d, rng):
    header, data, _ = read_st(d)
    name = rng.choice(_names(header))
    how = rng.choice(["suffix", "layer", "scale", "dup"])
    if how == "suffix":
        new = name + "_x"
    elif how == "layer":
        new = name.replace("layers.0.", "layers.7.").replace("layers.1.", "layers.0.") if "layers." in name \
            else "model.extra." + name
    elif how == "scale":
        new = name.replace("weight", "wieght", 1)
    else:  # onto another existing name: the two collide, one of them is lost
        new = rng.choice([k for k in _names(header) if k != name])
    ts = tensors_of(header, data)
    ts = {(new if k == name else k): v for k, v in ts.items() if not (how == "dup" and k == new)}
    write_tensors(d, header.get("__metadata__"), ts)
    return f"renamed {name}->{new}"


def st_swap(d, rng):
    header, data, _ = read_st(d)
    ts = tensors_of(header, data)
    groups = {}
    for k, (dtype, shape, raw) in ts.items():
        if raw and len(raw) > 4:
            groups.setdefault((dtype, tuple(shape)), []).append(k)
    pairs = [g for g in groups.values() if len(g) > 1 and any(ts[a][2] != ts[g[0]][2] for a in g)]
    g = rng.choice(pairs)
    a, b = rng.sample([x for x in g], 2)
    while ts[a][2] == ts[b][2]:
        a, b = rng.sample(g, 2)
    ts[a][2], ts[b][2] = ts[b][2], ts[a][2]
    write_tensors(d, header.get("__metadata__"), ts)
    return f"swapped {a}<->{b}"


def st_metadata(d, rng):
    header, data, _ = read_st(d)
    meta = header.setdefault("__metadata__", {})
    keys = sorted(meta)
    how = rng.choice(["drop checksums", "wrong digest", "bad json", "drop key", "edit key"])
    if how == "drop checksums":
        meta.pop("checksums", None)
        meta.pop("checksum", None)
    elif how == "wrong digest" and "checksums" in meta:
        sums = json.loads(meta["checksums"])
        k = rng.choice(sorted(sums))
        sums[k] = hashlib.sha256(b"other").hexdigest()
        meta["checksums"] = json.dumps(sums)
        how += f" of {k}"
    elif how in ("bad json", "edit key") and keys:
        k = rng.choice([k for k in keys if meta[k].startswith(("{", "["))] or keys)
        meta[k] = meta[k][:len(meta[k]) // 2] if how == "bad json" else rng.choice(["", "null", "[]", "{}", "x"])
        how += f" {k}"
    elif keys:
        k = rng.choice(keys)
        del meta[k]
        how += f" {k}"
    write_raw(d, header, data)
    return f"__metadata__: {how}"


# ------------------------------------------------------------------------------------------ config.json
def _leaves(obj, path=()):
    if isinstance(obj, dict) and obj:
        for k, v in obj.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(obj, list) and obj:
        for i, v in enumerate(obj):
            yield from _leaves(v, path + (i,))
    else:
        yield path


def _get(obj, path):
    for p in path:
        obj = obj[p]
    return obj


def other_value(rng, old):
    if isinstance(old, bool):
        return rng.choice([not old, None, "yes", 1])
    if isinstance(old, int):
        return rng.choice([old + 1, old - 1, old * 2, 0, -1, 3, None, str(old), float(old) + 0.5])
    if isinstance(old, float):
        return rng.choice([old * 2, -old, 0.0, None, "x"])
    if isinstance(old, str):
        return rng.choice([old + "x", "", "int4", "uint4", "fp8_e4m3", "float", "int", "group", "channel", None, 4])
    if isinstance(old, list):
        return rng.choice([[], None, {}, old[:1]])
    return rng.choice([None, 1, "x", [], {}])


def edit_config(d: Path, rng, targeted: list, root=("quantization_config",)):
    """Set one key of ``config.json`` (a targeted ``(path, values)`` or any leaf under ``root``) to another value,
    or delete it."""
    cfg = json.loads((d / CFG).read_text())
    present = [(p, v) for p, v in targeted if _has(cfg, p)]
    for _ in range(20):  # until the edit changes something
        if present and rng.random() < 0.6:
            path, values = rng.choice(present)
            new = rng.choice(values)
        else:
            path = root + tuple(rng.choice([p for p in _leaves(_get(cfg, root)) if p]))
            new = "<delete>" if rng.random() < 0.25 else other_value(rng, _get(cfg, path))
        if new != _get(cfg, path) or type(new) is not type(_get(cfg, path)):
            break
    parent, key = _get(cfg, path[:-1]), path[-1]
    old = parent[key]
    if new == "<delete>":
        parent.pop(key)
    else:
        parent[key] = new
    (d / CFG).write_text(json.dumps(cfg, indent=1))
    return f"config {'.'.join(map(str, path))}: {old!r}->{new!r}"[:160]


def _has(cfg, path):
    try:
        _get(cfg, path)
        return True
    except (KeyError, IndexError, TypeError):
        return False


MODEL_EDITS = [(("hidden_size",), [32, 128, "<delete>"]), (("num_attention_heads",), [2, 8, 0, "<delete>"]),
               (("num_key_value_heads",), [1, 4, 3, "<delete>"]), (("num_hidden_layers",), [1, 3, 0]),
               (("vocab_size",), [64, 256]), (("intermediate_size",), [64, 256]), (("head_dim",), [8, 32]),
               (("model_type",), ["qwen2", "gpt2", "bogus", "<delete>"]),
               (("architectures",), [["Qwen2ForCausalLM"], ["Bogus"], None])]


def cfg_model(d, rng):
    return edit_config(d, rng, MODEL_EDITS, root=())


def cfg_broken(d, rng):
    how = rng.choice(["truncated", "not a dict", "no quantization_config", "removed", "quant_method"])
    text = (d / CFG).read_text()
    if how == "truncated":
        (d / CFG).write_text(text[:rng.randrange(1, len(text))])
    elif how == "not a dict":
        (d / CFG).write_text(rng.choice(["[]", "null", "3", '"x"']))
    elif how == "removed":
        (d / CFG).unlink()
    else:
        cfg = json.loads(text)
        if how == "quant_method":
            cfg["quantization_config"]["quant_method"] = rng.choice(["quark", "compressed-tensors", "gptq", None])
            how += f"={cfg['quantization_config']['quant_method']}"
        else:
            del cfg["quantization_config"]
        (d / CFG).write_text(json.dumps(cfg))
    return f"config.json {how}"


SAFETENSORS_MUTATIONS = [st_truncate, st_flip_data, st_flip_header, st_dtype, st_shape, st_offsets, st_delete,
                         st_delete_qparam, st_rename, st_swap, st_metadata, cfg_model, cfg_broken]


# ------------------------------------------------------------------------------------------ outcomes
OK_ERRORS = (ValueError, TypeError, OSError)  # CheckpointError is a ValueError


def fingerprint(model: torch.nn.Module) -> str:
    """A digest of everything a forward pass reads: module types and reprs, every tensor of the state and of
    the extracted tree (specs and qparams too), the config. Equal digests give equal logits."""
    h = hashlib.sha256()
    for name, m in model.named_modules():
        h.update(f"{name}|{type(m).__name__}|{m.extra_repr()}\n".encode())
    for k, v in model.state_dict().items():
        h.update(f"{k}|{v.dtype}|{tuple(v.shape)}".encode())
        h.update(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    for path, leaf in bridge.extract(model).items():
        if isinstance(leaf, qt.QTensor):
            h.update(f"{path}|{leaf.spec!r}|{leaf.width}|{leaf.dtype}".encode())
            for k, t in sorted(leaf.qparams.tensors().items()):
                h.update(k.encode() + t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    return h.hexdigest()


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def classify(directory: Path, like: torch.nn.Module, ref: dict, names: set) -> tuple[str, str]:
    """``(outcome, detail)`` of loading the damaged ``directory``: ``error`` (a clear one), ``same`` (the
    undamaged logits) or a failure: ``crash`` (another exception type), ``vague`` (an accepted type, but longer
    than two lines or naming no file, tensor or key) or ``wrong`` (loads, other logits)."""
    try:
        model = bridge.load(directory, like=copy.deepcopy(like))
        if fingerprint(model) == ref["fingerprint"]:
            return "same", ""
        out = logits(model, ref["ids"])
    except OK_ERRORS as e:
        msg = str(e)
        if len(msg.strip().splitlines()) > 2:
            return "vague", f"{type(e).__name__} at {_where(e)}: {len(msg.splitlines())} lines: {msg[:100]!r}"
        if not any(n in msg for n in names | {str(directory), directory.name}):
            return "vague", f"{type(e).__name__} at {_where(e)} names nothing: {msg[:120]!r}"
        return "error", f"{type(e).__name__}: {msg[:120]}"
    except Exception as e:  # noqa: BLE001 - every other type is what the test looks for
        return "crash", f"{type(e).__name__} at {_where(e)}: {str(e)[:120]!r}"
    if out.shape == ref["logits"].shape and torch.equal(out, ref["logits"]):
        return "same", "(other state, same logits)"
    diff = (out - ref["logits"]).abs().max().item() if out.shape == ref["logits"].shape else float("nan")
    return "wrong", f"loaded, logits differ (max |diff| {diff:.3g})"


def _where(e: BaseException) -> str:
    """The innermost frame of ours (``bridge/``) the exception went through: ``importer.py:123``."""
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if "/bridge/" in f.filename and "/tests/" not in f.filename] or frames
    return f"{Path(ours[-1].filename).parent.name}/{Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else "?"


def names_of(directory: Path, extra=()) -> set:
    """What an error message may name: the files, the directory, every tensor and module path, every config key
    with an ``_`` or ``.`` in it (``num_bits``, ``llama.attention.head_count``)."""
    out = {str(directory), directory.name, *extra}
    for f in directory.iterdir():
        out.add(f.name)
    if (directory / ST).exists():
        header, _, _ = read_st(directory)
        for k in _names(header):
            out.update({k, k.rsplit(".", 1)[0]})
    if (directory / CFG).exists():
        for p in _leaves(json.loads((directory / CFG).read_text())):
            out.update(str(k) for k in p if isinstance(k, str) and ("_" in k or "." in k))
    return {n for n in out if n}

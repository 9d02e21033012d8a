"""A quantized tree in a checkpoint directory, without modules: the tensors to write (a QTensor's
parts grouped, tied tensors stored once) and :func:`load_tree`, which reads a tree back with every
quantized tensor checked against the metadata from the headers before any data is read.

>>> import tempfile, torch, qtransform as qt
>>> import bridge
>>> qtree = qt.quantize_tree({"fc.weight": torch.randn(8, 64), "fc.bias": torch.zeros(8)}, qt.QuantSpec(format="int8"))
>>> d = tempfile.mkdtemp() + "/ckpt"
>>> bridge.save(qtree, d)
>>> sorted((p, type(v).__name__) for p, v in load_tree(d).items())
[('fc.bias', 'Tensor'), ('fc.weight', 'QTensor')]
"""

from __future__ import annotations

from pathlib import Path

import torch

import qtransform as qt

from . import checksum, metadata, store
from .layout import LAYOUTS
from .metadata import CheckpointError, Metadata

__all__ = ["CONFIG", "TOKENIZER_FILES", "tensor_groups", "read_metadata", "quantized_parts", "check_aliases",
           "verify_checksums", "read_tree", "load_tree"]

CONFIG = "config.json"
#: A tokenizer's files, as transformers saves them beside a checkpoint (chat template included): what
#: :func:`bridge.save` copies from the model's directory and the exporters copy beside their output.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json", "chat_template.jinja")


def tensor_groups(tree: dict, layout) -> tuple[list[dict[str, torch.Tensor]], dict[str, str]]:
    """Tensors to write, grouped (a QTensor's parts together), and aliases of tied tensors."""
    groups, seen, aliases, names = [], {}, {}, set()
    for path, leaf in tree.items():
        if isinstance(leaf, qt.QTensor):
            group = layout.parts(path, leaf)
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
        groups.append(group)
    return groups, aliases


def read_metadata(directory) -> Metadata:
    """The decoded ``quantization_config`` of a checkpoint directory (version 1 or 2)."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    config = store.read_json(root / CONFIG, "checkpoint config")
    if not isinstance(config, dict) or "quantization_config" not in config:
        raise CheckpointError(f"{root / CONFIG}: no quantization_config")
    return metadata.decode(config["quantization_config"], where=str(root / CONFIG))


def quantized_parts(meta: Metadata) -> dict[str, dict[str, tuple]]:
    """``{path: {stored name: (shape, dtype)}}`` of every quantized tensor, from the metadata alone."""
    layout = LAYOUTS[meta.layout]
    out = {}
    for path, e in meta.entries.items():
        try:
            out[path] = layout.expected(path, e.spec, e.shape, e.dtype)
        except ValueError as err:
            raise CheckpointError(f"{CONFIG}: {path}: {err}") from None
    return out


def read_tree(root: Path, meta: Metadata, located, handles, expected: dict, paths) -> dict:
    """Read the checked tensors and assemble the tree in ``paths`` order (aliases resolved)."""
    tensors = {}
    for name in expected:
        try:
            tensors[name] = handles[located[name]].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{root / located[name]}: cannot read tensor {name!r} ({e})") from None
    layout = LAYOUTS[meta.layout]
    tree = {}
    for path in paths:
        if path in meta.aliases:
            continue
        if path in meta.entries:
            e = meta.entries[path]
            tree[path] = layout.assemble(path, tensors, spec=e.spec, width=e.shape[-1], dtype=e.dtype)
        else:
            tree[path] = tensors[path]
    for path, target in meta.aliases.items():
        tree[path] = tree[target]
    return {p: tree[p] for p in paths}


def check_aliases(meta: Metadata, stored_paths) -> None:
    for path, target in meta.aliases.items():
        if target not in stored_paths or target in meta.aliases or path in meta.entries:
            raise CheckpointError(f"{CONFIG}: alias {path!r} -> {target!r} does not name a stored tensor")


def verify_checksums(root: Path, located, *, verify: bool) -> None:
    """Check the shards' checksums (:mod:`bridge.checkpoint.checksum`), unless ``verify`` is false."""
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be True or False, got {verify!r}")
    if verify:
        checksum.verify_files(root / f for f in sorted(set(located.values())))


def load_tree(directory, *, verify: bool = True) -> dict:
    """The checkpoint's tree ``{path: Tensor | QTensor}``, without a model (quantized tensors bit for bit).

    Every quantized tensor's parts are checked against the metadata (names, shapes, dtypes) from the
    headers before any data is read, then every tensor against the checksum written with it
    (``verify=False`` skips that); raises :class:`CheckpointError` naming the file and tensor.
    """
    if not isinstance(verify, bool):  # bad arguments fail before any file is opened
        raise TypeError(f"load_tree: verify must be True or False, got {verify!r}")
    root = Path(directory)
    meta = read_metadata(root)
    located, handles = store.open_shards(root)
    parts = quantized_parts(meta)
    claimed = {n for group in parts.values() for n in group}
    plain = [n for n in located if n not in claimed]
    check_aliases(meta, set(plain) | set(meta.entries))
    expected = {n: s for group in parts.values() for n, s in group.items()}
    for name in plain:
        sl = handles[located[name]].get_slice(name)
        expected[name] = (tuple(sl.get_shape()), _dtype_of(sl.get_dtype(), root / located[name], name))
    store.check_headers(root, located, handles, expected)
    verify_checksums(root, located, verify=verify)
    return read_tree(root, meta, located, handles, expected, list(meta.entries) + plain + list(meta.aliases))


def _dtype_of(st_name: str, file: Path, name: str) -> torch.dtype:
    for dtype, n in store.ST_DTYPES.items():
        if n == st_name:
            return dtype
    raise CheckpointError(f"{file}: tensor {name!r} has dtype {st_name}, which qtransform does not read")

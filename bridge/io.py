"""Checkpoints of models: ``save`` (a model or a quantized tree) and ``load`` (into a model's structure),
as safetensors shards + JSON (never pickle).

A checkpoint directory holds ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` shards
and ``model.safetensors.index.json``) and ``config.json`` with the ``quantization_config`` of
:mod:`bridge.checkpoint.metadata` (the full transformers config for a transformers model, whose
tokenizer and generation files are written alongside), so
``AutoModelForCausalLM.from_pretrained(directory)`` reads it too. Quantized tensors are stored by
a layout (:mod:`bridge.checkpoint.layout`); a tensor tied to another is stored once (``aliases``).
Saving writes a temporary directory and renames it at the end (:mod:`bridge.checkpoint.store`);
loading checks every name, shape and dtype against the model before reading data.
:func:`bridge.load_tree` reads the tree without a model.

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
import shutil
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Callable

import torch
from torch import nn

import qtransform as qt

from .arch.embeddings import head_apart
from .checkpoint import metadata, store
from .checkpoint.layout import LAYOUTS, dtype_name
from .checkpoint.metadata import CheckpointError
from .checkpoint.tree_io import (CONFIG, TOKENIZER_FILES, check_aliases, quantized_parts, read_metadata, read_tree,
                                 tensor_groups, verify_checksums)
from .io_parts import activation_parts, model_of, stored_float, tied_aliases
from .modules.actquant import PREFIX, activation_specs
from .step_outputs import output_parts, output_tensors, read_outputs, records, take_outputs
from .modules.online import check as check_online, online_rotations
from .tree import Quantized, extract, to_module

__all__ = ["save", "checkpoint_writer", "write_extras", "cast_dtypes", "config_dtype", "cast_leaf", "load",
           "imported_format", "from_source", "TOKENIZER_FILES"]


def write_extras(model, tmp: Path, qconfig: dict, tokenizer, *, dtype: torch.dtype | None = None,
                 generation_config=None) -> None:
    """``config.json`` (``model``'s config with ``qconfig``, and ``dtype`` recorded when given), the
    generation config (``generation_config``, else the model's) and the tokenizer's files (``tokenizer``'s,
    else copied from the directory the model came from) into ``tmp``."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        d = json.loads(config.to_json_string(use_diff=False))
        d["quantization_config"] = qconfig
        if d.get("tie_word_embeddings") and head_apart(model, qconfig):
            d["tie_word_embeddings"] = False
        if dtype is not None:
            d["dtype"] = dtype_name(dtype)
        generation_config = generation_config or getattr(model, "generation_config", None)
        if hasattr(model, "can_generate") and model.can_generate() and generation_config:
            generation_config.save_pretrained(tmp)
        source = getattr(config, "_name_or_path", "") or ""
        if tokenizer is None and source and os.path.isdir(source):
            for name in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(source, name)):
                    shutil.copy2(os.path.join(source, name), tmp / name)
    else:
        d = {"quantization_config": qconfig}
    if tokenizer is not None:
        try:
            tokenizer.save_pretrained(tmp)
        except OSError:
            raise
        except Exception as e:  # the tokenizers library raises a bare Exception on a full disk
            raise OSError(f"saving the tokenizer failed: {str(e).strip() or type(e).__name__}") from e
    (tmp / CONFIG).write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")


def save(model_or_qtree, directory, *, max_shard_size="2GB", overwrite: bool = False, recipe=None,
         recipe_name: str | None = None, rules: dict | None = None, tokenizer=None, dtypes=None,
         carried: Mapping | None = None) -> None:
    """Write a quantized model (or quantized tree, or the pipeline's result) to ``directory`` as a
    qtransform checkpoint.

    Args:
        model_or_qtree: a model with quantized modules (from :func:`bridge.quantize` or
            :func:`bridge.to_module`), a tree ``{path: Tensor | QTensor}``, or a
            :class:`~bridge.tree.Quantized` result of :func:`bridge.quantize_params` (its tree with its
            recipe, rules, dynamic activation specs and online rotations; static activation scales
            live in modules: save the model of the result, ``bridge.to_module(model, result)``).
        directory: target directory; must not exist or be empty unless ``overwrite``.
        max_shard_size: bytes per shard (``"2GB"``, ``"500MiB"`` or an int).
        overwrite: replace an existing non-empty directory.
        recipe: the :class:`~qtransform.Recipe` used, recorded in the metadata (a transformers model
            quantized by :func:`bridge.quantize`, and a ``Quantized`` result, record their own).
        recipe_name: the preset or recipe file it came from, for people.
        rules: ``{path: rule}``, the recipe rule that chose each quantized tensor's spec.
        tokenizer: a tokenizer to save alongside (``save_pretrained``).
        dtypes: the dtype to store the float tensors in (a ``torch.dtype``, or ``{path: dtype}`` for some
            of them): the tensors left unquantized are cast to it and the quantized ones dequantize to it
            (a bf16 model's checkpoint stays bf16: ``dtypes=torch.bfloat16``). The config records the
            dtype (the most common one of a dict). Default: as the model holds them.
        carried: ``{name: tensor}`` written as they are besides the model's: the input checkpoint's tensors the
            model does not load (multi-token-prediction layers; :mod:`bridge.stream.inventory`).
    """
    store.parse_size(max_shard_size)  # bad arguments fail before anything is written
    if not isinstance(overwrite, bool):
        raise TypeError(f"save: overwrite must be True or False, got {overwrite!r}")
    write = checkpoint_writer(model_or_qtree, max_shard_size=max_shard_size, recipe=recipe, recipe_name=recipe_name,
                              rules=rules, tokenizer=tokenizer, dtypes=dtypes, carried=carried)
    with store.atomic_directory(directory, overwrite=overwrite) as tmp:
        write(tmp)


def checkpoint_writer(model_or_qtree, *, max_shard_size="2GB", recipe=None, recipe_name: str | None = None,
                      rules: dict | None = None, tokenizer=None, dtypes=None,
                      carried: Mapping | None = None) -> Callable[[Path], None]:
    """Everything :func:`save` checks, checked now; returns ``write(directory)``, which writes the
    checkpoint's files into an existing empty ``directory``: the temporary directory of a
    :func:`bridge.checkpoint.store.atomic_directory` that the caller fills with more (the
    ``qtransform`` command adds its report) before it appears whole. Arguments as :func:`save`'s.
    """
    store.parse_size(max_shard_size)  # bad arguments fail before anything is written
    result = model_or_qtree if isinstance(model_or_qtree, Quantized) else None
    if result is not None and result.written is not None:
        raise ValueError(f"save: this result of a streamed run is already written to {result.written.directory}")
    if result is not None:
        static = [str(s) for s, q in result.activations.items() if not (isinstance(q, qt.QuantSpec) and q.dynamic)]
        if static:
            raise ValueError(f"save: the static activation quantizers of a Quantized result ({static[:3]}) are "
                             "buffers of their modules: save its model, bridge.save(bridge.to_module(model, result), "
                             "directory)")
        if result.plan is not None:
            recipe = result.plan.recipe if recipe is None else recipe
            if rules is None:
                rules = {p: result.plan[p].rule for p, v in result.qtree.items()
                         if isinstance(v, qt.QTensor) and p in result.plan}
        model_or_qtree = result.qtree
    if rules is not None and not isinstance(rules, Mapping):
        raise TypeError(f"save: rules must be a dict of tensor path -> rule, got {type(rules).__name__}")
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(f"save: tokenizer must have a save_pretrained method (a transformers tokenizer), got "
                        f"{type(tokenizer).__name__}")
    model = model_or_qtree if isinstance(model_or_qtree, nn.Module) else None
    if model is None and not isinstance(model_or_qtree, (Mapping, list, tuple)):
        raise TypeError(f"save: model_or_qtree must be a module or a tree of tensors and QTensors, got "
                        f"{type(model_or_qtree).__name__}")
    outputs = read_outputs(model) if model is not None else dict(result.outputs) if result else {}
    tree = extract(model) if model is not None else {**qt.flatten_tree(model_or_qtree), **output_tensors(
        outputs)}  # a model's step outputs are its modules' buffers
    if model is not None:
        activations, online = activation_specs(model), online_rotations(model)
    else:  # a tree: what a Quantized result carries with it
        activations, online = (dict(result.activations) or None, dict(result.online) or None) if result else (None, None)
    layout = LAYOUTS["native"]
    groups, aliases = tensor_groups(tree, layout)  # ties found on the tensors as they are, before any cast
    targets, recorded_dtype = cast_dtypes(tree, dtypes)
    if targets:
        tree = {p: cast_leaf(v, targets[p]) if p in targets else v for p, v in tree.items()}
        groups = [{n: cast_leaf(t, targets[n]) if n in targets else t for n, t in g.items()} for g in groups]
    clash = sorted(set(carried or ()) & {n for g in groups for n in g})
    if clash or not all(isinstance(t, torch.Tensor) for t in (carried or {}).values()):
        raise ValueError(f"save: carried must be a dict of name -> tensor, none of them the model's: {clash[:5]}")
    groups = groups + [{n: t} for n, t in (carried or {}).items()]
    quantized = {p: q for p, q in tree.items() if isinstance(q, qt.QTensor)}
    cfg = getattr(getattr(model, "config", None), "quantization_config", None)  # duck-typed: no transformers import
    recipe = getattr(cfg, "recipe", None) if recipe is None else qt.as_recipe(recipe)
    try:  # what is written must read back: checked before anything is written
        qconfig = metadata.checkpoint_config(
            quantized, recipe=recipe, recipe_name=recipe_name or getattr(cfg, "recipe_name", None),
            rules=rules if rules is not None else getattr(cfg, "rules", None), aliases=aliases,
            skip_modules=getattr(cfg, "skip_modules", None), activations=activations, online=online,
            outputs=records(outputs), carried=tuple(carried or ()), where="bridge.save")
    except metadata.CheckpointError as e:
        raise ValueError(f"{e} (check the recipe_name= and rules= arguments)") from None

    def write(directory: Path) -> None:
        directory = Path(directory)
        store.write_shards(directory, groups, max_shard_size=max_shard_size,
                           file_metadata={"format": "pt", "quant_method": metadata.QUANT_METHOD,
                                          "version": str(metadata.VERSION)},
                           index_metadata={"quant_method": metadata.QUANT_METHOD})
        write_extras(model, directory, qconfig, tokenizer, dtype=recorded_dtype)

    return write


def cast_dtypes(tree: Mapping, dtypes) -> tuple[dict, torch.dtype | None]:
    """``({path: dtype}, config dtype)`` of ``save(dtypes=...)`` for the float leaves of ``tree`` (see :func:`save`)."""
    if dtypes is None:
        return {}, None
    if isinstance(dtypes, torch.dtype):
        dtypes = {p: dtypes for p in tree}
    if not isinstance(dtypes, Mapping):
        raise TypeError(f"save: dtypes must be a torch.dtype or a dict of path -> dtype, got {type(dtypes).__name__}")
    out = {}
    for p, dt in dtypes.items():
        if not isinstance(dt, torch.dtype) or dt not in store.FLOAT_DTYPES:
            raise TypeError(f"save: dtypes[{p!r}] must be a float torch.dtype ({store.FLOAT_DTYPES}), got {dt!r}")
        leaf = tree.get(p)
        if leaf is not None and (isinstance(leaf, qt.QTensor) or leaf.dtype in store.FLOAT_DTYPES):
            out[p] = dt
    unknown = sorted(set(dtypes) - set(tree))
    if unknown:
        raise ValueError(f"save: dtypes names paths that are not tensors of the tree: {unknown[:5]}")
    return out, config_dtype(out)


def config_dtype(dtypes: Mapping[str, torch.dtype]) -> torch.dtype | None:
    """The dtype a checkpoint's config records for ``{path: stored dtype}``: the most common one."""
    counts = Counter(dtypes.values())
    return counts.most_common(1)[0][0] if counts else None


def cast_leaf(leaf, dtype: torch.dtype):
    """A float tensor cast to ``dtype``; a QTensor that dequantizes to ``dtype`` (its codes and scales as they are)."""
    if isinstance(leaf, qt.QTensor):
        return leaf if leaf.dtype == dtype else qt.QTensor(codes=leaf.codes, qparams=leaf.qparams, width=leaf.width,
                                                           dtype=dtype)
    return leaf if leaf.dtype == dtype or leaf.dtype not in store.FLOAT_DTYPES else leaf.to(dtype)


def load(directory, *, like, kernel: str = "auto", verify: bool = True) -> nn.Module:
    """Rebuild the quantized model saved in ``directory``.

    ``like`` gives the structure: the float model (or a skeleton of it, e.g. built from its
    config) with the same parameter names, or a zero-argument callable that builds one (the model's class,
    ``lambda: Net(width=64)``), called once. Returns a new model (``like`` is untouched) with
    quantized modules holding the stored codes and qparams bit for bit. Raises
    :class:`CheckpointError` naming the file and tensor for any missing, extra, truncated or
    mistyped tensor and for malformed, unknown-version or unknown-format metadata, before any
    data is read; then checks every tensor against the checksum written with it (a changed
    byte, tensors swapped by name or offset, an edited header), unless ``verify=False``.
    Checkpoints written before checksums existed (qtransform 0.1, 0.2) load unverified.

    Other tools' checkpoints load too (:func:`imported_format`: Quark's HF format, compressed-tensors,
    GGUF files): their quantized tensors become QTensors as stored, never re-quantized (an importer
    refuses, naming the tensor, what no qtransform spec holds exactly); float tensors take ``like``'s dtype.
    """
    like = model_of(like)
    if not isinstance(verify, bool):
        raise TypeError(f"load: verify must be True or False, got {verify!r}")
    root = Path(directory)
    fmt = imported_format(root)
    if fmt is not None:
        from .interop.base import read_imported

        return from_source(like, read_imported(fmt, root, verify=verify, like=like), kernel=kernel)
    meta = read_metadata(root)
    every, handles = store.open_shards(root)
    located = {n: f for n, f in every.items() if n not in meta.carried}  # kept as stored: not the model's
    ref = extract(like)
    for path in list(meta.entries) + list(meta.aliases):
        if path not in ref:
            raise CheckpointError(f"{CONFIG}: tensor {path!r} is not a tensor of {type(like).__name__}")
    parts = quantized_parts(meta)
    stored = set(meta.entries) | {n for n in located if not any(n in g for g in parts.values())}
    meta = meta._replace(aliases={**tied_aliases(like, stored), **meta.aliases})
    check_aliases(meta, stored)
    expected = {}
    for path, leaf in ref.items():
        if path in meta.aliases:
            continue
        if path in meta.entries:
            e = meta.entries[path]
            if tuple(leaf.shape) != e.shape:
                raise CheckpointError(f"{CONFIG}: quantized tensor {path!r} has shape {list(e.shape)}, "
                                      f"the model's is {list(leaf.shape)}")
            expected.update(parts[path])
        elif isinstance(leaf, qt.QTensor):
            raise CheckpointError(f"{CONFIG}: {path!r} is quantized in the model but not in the checkpoint")
        else:
            expected[path] = (tuple(leaf.shape), leaf.dtype)
    act_parts = activation_parts(like, meta)
    try:  # the rotations fit the model, before any data is read
        check_online(like, meta.online)
    except ValueError as e:
        raise CheckpointError(f"{CONFIG}: {e}") from None
    expected.update({n: v for parts in act_parts.values() for n, v in parts.items()})
    try:
        expected.update(out_parts := output_parts(like, meta.outputs, meta.entries))
    except ValueError as e:
        raise CheckpointError(f"{CONFIG}: {e}") from None
    for name, (shape, dtype) in list(expected.items()):  # a float tensor may be stored in another float dtype
        stored = stored_float(handles, located, name) if dtype in store.FLOAT_DTYPES and name in ref else None
        if stored is not None:
            expected[name] = (shape, stored)
    store.check_headers(root, located, handles, expected)
    verify_checksums(root, every, verify=verify)
    act_names = [n for parts in act_parts.values() for n in parts]
    tree = read_tree(root, meta, located, handles, expected, list(ref) + act_names + list(out_parts))  # every tensor read once
    for path, leaf in ref.items():  # in the model's dtypes (a bf16 checkpoint loads into a float32 model)
        if path in tree and leaf.dtype in store.FLOAT_DTYPES:
            tree[path] = cast_leaf(tree[path], leaf.dtype)
    return _build(like, meta, tree, act_parts, kernel, root)


def _build(like: nn.Module, meta, tree: dict, act_parts: dict, kernel: str, root) -> nn.Module:
    """The model of a read tree: static activation quantizers' fields gathered into QParams."""
    acts = {}
    for site, spec in meta.activations.items():
        acts[site] = spec if spec.dynamic else qt.QParams(spec=spec, **{
            n.rpartition(PREFIX[site.role])[2]: tree.pop(n) for n in act_parts.get(site, {})})
    model = to_module(like, Quantized({}, tree, activations=acts, online=meta.online,
                                        outputs=take_outputs(tree, meta.outputs)),
                      kernel=kernel)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(f"{root}: {left[:5]} have no value (not in the checkpoint; build `like` on a real "
                              "device so that non-persistent buffers are initialized)")
    return model


def imported_format(path) -> str | None:
    """The name of the importer (:data:`bridge.interop.IMPORTERS`) that reads ``path`` when it is another
    tool's checkpoint (Quark, compressed-tensors, a GGUF file); ``None`` for a qtransform checkpoint or
    anything no importer knows."""
    root = Path(path)
    if root.is_dir():
        try:
            cfg = json.loads((root / CONFIG).read_text()).get("quantization_config")
        except (OSError, ValueError, AttributeError):
            cfg = None
        if isinstance(cfg, dict) and cfg.get("quant_method") == metadata.QUANT_METHOD:
            return None
    elif not root.is_file():
        return None
    from . import interop

    return interop.detect_format(root)


def from_source(like: nn.Module, source, *, kernel: str = "auto") -> nn.Module:
    """``like`` rebuilt from an imported checkpoint (:class:`bridge.interop.Checkpoint`): its quantized
    tensors as they are stored (never re-quantized), every tensor checked against ``like`` first."""
    meta, tree = source.meta, dict(source.tree)
    ref = extract(like)
    act_parts = activation_parts(like, meta)
    act_names = {n for parts in act_parts.values() for n in parts}
    unknown = sorted(p for p in tree if p not in ref and p not in act_names)
    if unknown:
        raise CheckpointError(f"{source.directory}: tensors {unknown[:5]} are not tensors of {type(like).__name__}")
    aliases = {**tied_aliases(like, set(tree)), **meta.aliases}
    for alias, target in aliases.items():
        if alias not in tree and target in tree:
            tree[alias] = tree[target]
    missing = sorted(p for p in ref if p not in tree)
    if missing:
        raise CheckpointError(f"{source.directory}: no value for {missing[:5]} of {type(like).__name__}")
    for path, leaf in tree.items():
        want = ref.get(path)
        if want is not None and tuple(leaf.shape) != tuple(want.shape):
            raise CheckpointError(f"{source.directory}: tensor {path!r} has shape {list(leaf.shape)}, the model's is "
                                  f"{list(want.shape)}")
        if want is not None and not isinstance(leaf, qt.QTensor) and leaf.dtype != want.dtype:
            tree[path] = leaf.to(want.dtype)
    try:
        check_online(like, meta.online)
    except ValueError as e:
        raise CheckpointError(f"{source.directory}: {e}") from None
    return _build(like, meta, tree, act_parts, kernel, source.directory)

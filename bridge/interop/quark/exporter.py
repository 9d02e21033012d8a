"""Export to AMD Quark's HF format (``quant_method: "quark"``), which transformers loads through its
Quark quantizer (with ``amd-quark`` installed) and vLLM serves.

The export is a transformers checkpoint directory: ``config.json`` (the model's config with Quark's
``quantization_config``), safetensors shards with Quark's tensor names and packing
(:mod:`.tensors`), and the tokenizer and generation files. ``quantization_config`` holds:

* ``global_quant_config``: the layer config (``weight`` / ``input_tensors`` / ``output_tensors``
  :mod:`Quark tensor configs <.config>`) most linear layers share;
* ``layer_quant_config``: the others, by module name (``"*.<name>"`` when every linear layer of that
  name shares one); ``exclude``: the linear layers left in floating point;
* the static fp8 key/value cache as the ``output_tensors`` of ``k_proj`` / ``v_proj`` with
  ``export.kv_cache_group = ["*k_proj", "*v_proj"]`` (vLLM reads them as the attention's
  ``k_scale`` / ``v_scale``; transformers' Quark layers quantize the projections' outputs, i.e.
  before the rotary embedding where a model has one, while we and vLLM quantize the cache after it);
* ``export``: ``pack_method: "reorder"`` (int4 in AWQ order), ``weight_format: "real_quantized"``;
* ``qtransform``: our own metadata (specs, logical dtypes, recipe), which Quark and vLLM ignore and
  :class:`~bridge.interop.quark.QuarkImporter` uses to give back the very same specs.

Mixture-of-experts weights are written per expert and projection under the original checkpoint names
(:mod:`bridge.interop.experts`); each experts module has one layer config, found by its name as vLLM's Quark MoE
method looks it up (``layer_quant_config`` pattern, else the global config).

Carried tensors (the input's tensors the model class does not load: multi-token-prediction layers,
:attr:`bridge.interop.Checkpoint.carried`) are written as stored under their own names, their modules in
``exclude`` (left float by Quark's and vLLM's loaders); ``qtransform`` records them (``carried``).

Quark quantizes ``nn.Linear`` layers only: quantized embeddings, transformers' ``Conv1D`` (GPT-2) and
fused attention projections without ``k_proj``/``v_proj`` for a KV cache are refused by tree path.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path

import torch

import qtransform as qt

from ...arch.embeddings import output_embeddings
from ...checkpoint import metadata, store
from ...modules.actquant import PREFIX
from . import config as qc
from .. import experts as moe
from ..base import Checkpoint, Exporter, Support, carried_modules, copy_extras, judged_spec, write_config
from ..hf_model import transformers_model
from .tensors import shape_problem, symmetric_zero, to_quark

__all__ = ["QuarkExporter", "KV_CACHE_GROUP", "FORMAT_VERSION", "skeleton", "layer_config"]

#: What ``export.kv_cache_group`` names (the projections whose outputs are the key/value cache).
KV_CACHE_GROUP = ["*k_proj", "*v_proj"]
#: The Quark version whose config format the export follows (written as ``version``).
FORMAT_VERSION = "0.13"
_KV_PROJ = {"key": "k_proj", "value": "v_proj"}
_EMPTY = {"input_tensors": None, "output_tensors": None, "weight": None, "bias": None, "target_device": None}


@functools.lru_cache(maxsize=8)
def _skeleton(config_json: str, paths: tuple[str, ...]) -> tuple[dict, str | None, str]:
    model = transformers_model(json.loads(config_json), paths=paths)
    types = {n: type(m) for n, m in model.named_modules()}
    out = output_embeddings(model)
    out_name = next((n for n, m in model.named_modules() if m is out), None) if out is not None else None
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    return types, (out_name if tied else None), type(model).__name__, moe.experts_modules(model), moe.routers(model)


def skeleton(source: Checkpoint) -> tuple[dict, str | None, str]:
    """``({module name: module class}, the tied output embedding's name or None, class name)`` of the
    transformers model whose weights ``source`` holds (its ``architectures``, else the first head class
    that has all its weights), built on the ``meta`` device (no memory); ``ValueError`` when none does."""
    paths = tuple(sorted(p for p in list(source.tree) + list(source.meta.entries)
                         if p.endswith((".weight", ".bias"))))
    return _skeleton(json.dumps(source.config, sort_keys=True, default=str), paths)[:3]


def experts_of(source: Checkpoint) -> tuple[dict, list[str]]:
    """``({experts module name: ExpertsInfo}, router module names)`` of the model :func:`skeleton` builds
    (:mod:`bridge.interop.experts`)."""
    paths = tuple(sorted(p for p in list(source.tree) + list(source.meta.entries)
                         if p.endswith((".weight", ".bias"))))
    return _skeleton(json.dumps(source.config, sort_keys=True, default=str), paths)[3:]


def _module(path: str) -> str:
    return path.rpartition(".")[0]


def layer_config(weight: dict | None = None, input_tensors: dict | None = None, output_tensors: dict | None = None) -> dict:
    """One Quark ``QLayerConfig`` as JSON."""
    return {**_EMPTY, "weight": weight, "input_tensors": input_tensors, "output_tensors": output_tensors}


class QuarkExporter(Exporter):
    """``--to quark``: Quark's HF format (see the module docstring)."""

    name = "quark"
    description = "AMD Quark HF format (transformers with amd-quark, vLLM): int4/uint4/int8 weights, fp8, OCP MX"
    carries = True

    def support(self, spec: qt.QuantSpec, role: str = "weight") -> Support:
        return qc.judge(spec, role)

    # ------------------------------------------------------------------ whole-model conditions
    def problems(self, source: Checkpoint, *, allow_nearest: bool = False) -> list[str]:
        out = super().problems(source, allow_nearest=allow_nearest)
        try:
            types, tied_out, _ = skeleton(source)
        except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as e:
            return out + [f"{source.directory}: {e}" if source.config else
                          f"{source.directory}: no transformers config.json (Quark exports transformers models)"]
        linear = {n for n, t in types.items() if t is torch.nn.Linear}
        (experts, _), naming = experts_of(source), moe.naming_of(source.config)
        out += _experts_problems(source, experts, naming)
        for path, entry in source.meta.entries.items():
            m = _module(path)
            if m in experts:
                continue  # _experts_problems
            if not path.endswith(".weight") or m not in linear:
                kind = types[m].__name__ if m in types else "no module of the model"
                out.append(f"{path}: a quantized {kind} weight; Quark quantizes the weights of nn.Linear layers only")
                continue
            why = shape_problem(entry.spec, entry.shape)
            if why is not None:
                out.append(f"{path}: {why}")
            if m == tied_out:
                out.append(f"{path}: the output embedding is quantized while the config ties it to the input "
                           "embedding (transformers would tie the two again on load)")
        outputs = {s.module for s in source.meta.activations if s.role == "output"}
        for site in source.meta.activations:
            where = f"{site.module}:{site.role}"
            if site.role in _KV_PROJ:
                proj = f"{site.module}.{_KV_PROJ[site.role]}"
                if proj not in linear:
                    out.append(f"{where}: the {site.role} cache of a module without an nn.Linear "
                               f"{_KV_PROJ[site.role]} (Quark stores it as that projection's output scale)")
                elif proj in outputs:
                    out.append(f"{where}: {proj} also quantizes its output; Quark has one output quantizer per layer")
            elif (hit := moe.site_weight(site.module, experts)) and site.role == "input" and naming is not None:
                others = {str(sp) for st, sp in source.meta.activations.items()
                          if st.role == "input" and st.module.rpartition(".")[0] == hit[0]}
                if len(others) > 1 or len([st for st in source.meta.activations if st.role == "input" and
                                           st.module.rpartition(".")[0] == hit[0]]) != len(experts[hit[0]].weights):
                    out.append(f"{where}: the projections of {hit[0]} have different input quantizers ({sorted(others)}); "
                               "vLLM takes one Quark layer config per experts module")
            elif site.module not in linear:
                out.append(f"{where}: an activation quantizer on a {types.get(site.module, type(None)).__name__}; "
                           "Quark quantizes the inputs and outputs of nn.Linear layers only")
        return out

    # ------------------------------------------------------------------ writing
    def write(self, source: Checkpoint, out: Path, *, allow_nearest: bool = False) -> None:
        types, _, arch = skeleton(source)
        (experts, routers), naming = experts_of(source), moe.naming_of(source.config)
        name = functools.partial(moe.export_name, naming=naming)
        # experts modules stand beside the linear layers: one layer config each (vLLM resolves a FusedMoE layer's by
        # its name), their weights written per expert; routers too (float: excluded by name)
        linear = [name(n) for n, t in types.items() if t is torch.nn.Linear or n in routers] + \
            [name(n) for n in experts]
        meta = source.meta
        layers = {m: dict(_EMPTY) for m in linear}
        consumed, entries, seen = set(), {}, {}

        def produce():  # the tensors, one layer (one expert's projection) at a time: written as they come
            for path, entry in meta.entries.items():
                m = _module(path)
                layers[name(m)]["weight"] = qc.tensor_config(judged_spec(path, entry), "weight")
                consumed.add(path)
                if m not in experts:
                    yield {f"{name(m)}.{k}": v for k, v in to_quark(source.tree[path], path).items()}
                    entries[name(path)] = entry
                    continue
                for piece, q in moe.pieces(path, source.tree[path], naming):
                    yield {f"{piece}.{k}": v for k, v in to_quark(q, f"{piece}.weight").items()}
                    entries[f"{piece}.weight"] = metadata.Entry(q.spec, tuple(q.shape), q.dtype)
            for site, spec in meta.activations.items():
                names = {f: f"{site.module}.{PREFIX[site.role]}{f}" for f in qt.QParams.FIELDS}
                consumed.update(names.values())
                if moe.site_weight(site.module, experts) and naming is not None:  # vLLM: one input_scale per expert
                    names = {f: f"{site.module}_{PREFIX[site.role]}{f}" for f in qt.QParams.FIELDS}  # the tree's
                    consumed.update(names.values())
                    layers[name(site.module.rpartition(".")[0])]["input_tensors"] = qc.tensor_config(spec, site.role)
                    count = source.tree[site.module].shape[0]
                    for piece in moe.input_pieces(site.module, count, naming):
                        yield _activation_tensors(source.tree, names, spec, f"{piece}.input_")
                    continue
                if site.role in _KV_PROJ:
                    proj, role = f"{site.module}.{_KV_PROJ[site.role]}", "output"
                else:
                    proj, role = name(site.module), site.role
                layers[proj][f"{role}_tensors"] = qc.tensor_config(spec, site.role)
                yield _activation_tensors(source.tree, names, spec, f"{proj}.{role}_")
            for path, leaf in source.tree.items():
                if path in consumed:
                    continue
                if _module(path) in experts and naming is not None and leaf.dim() == 3:  # float experts: per expert
                    yield {f"{piece}.weight": t for piece, t in moe.pieces(path, leaf, naming)}
                    continue
                key = (leaf.untyped_storage().data_ptr(), leaf.storage_offset(), tuple(leaf.shape), leaf.dtype)
                yield {name(path): leaf.clone() if leaf.numel() and key in seen else leaf}
                seen.setdefault(key, path)
            for carried, t in source.carried.items():  # as stored, under their own names (excluded by module)
                yield {carried: t}

        store.write_shards(out, produce(), file_metadata={"format": "pt"})
        config = dict(source.config)
        if not config.get("architectures"):  # vLLM picks the model class by it
            config["architectures"] = [arch]
        config["quantization_config"] = quantization_config(layers, linear, meta._replace(entries=entries))
        write_config(out, config)
        copy_extras(source, out)


def _experts_problems(source: Checkpoint, experts: dict, naming) -> list[str]:
    """Why the quantized experts of ``source`` cannot be written per expert in Quark's layout (one line per path):
    no per-expert names, a transposed layout, gate/up scale blocks that straddle, a piece Quark cannot pack, or
    projections of one experts module with different specs (vLLM takes one layer config per FusedMoE layer)."""
    out = []
    for module, info in experts.items():
        paths = [f"{module}.{w}" for w in info.weights if f"{module}.{w}" in source.meta.entries]
        specs = {judged_spec(p, source.meta.entries[p]) for p in paths}
        if len(specs) > 1:
            out.append(f"{module}: its experts' projections are quantized with different specs "
                       f"({sorted(map(str, specs))}); vLLM takes one Quark layer config per experts module")
        for path in paths:
            entry = source.meta.entries[path]
            why = moe.refusal(path, info, naming, entry.spec, entry.shape, target="Quark")
            if why is None:
                split = 2 if path.endswith(".gate_up_proj") else 1
                shape = (entry.shape[1] // split, entry.shape[2])
                bad = shape_problem(judged_spec(path, entry), shape)
                why = None if bad is None else f"{path}: one expert's {shape[0]}x{shape[1]} matrix: {bad}"
            if why is not None:
                out.append(why)
    return out


def _activation_tensors(tree: dict, names: dict, spec: qt.QuantSpec, prefix: str) -> dict:
    """A static per-tensor activation quantizer's scale (and zero point) as Quark's scalars."""
    scale = tree.get(names["scale"])
    if scale is None:
        raise ValueError(f"{names['scale']}: missing from the checkpoint (a static activation quantizer's scale)")
    out = {prefix + "scale": scale.reshape(()).contiguous()}
    if spec.format in qc.INT_DTYPES:
        codes = torch.int8 if spec.format == "int8" else torch.uint8
        zp = tree.get(names["zero_point"])
        zp = torch.tensor(symmetric_zero(spec.format)) if zp is None else zp
        out[prefix + "zero_point"] = zp.reshape(()).to(codes).contiguous()
    return out


def _compress(names: list[str], chosen: set[str], linear: list[str]) -> list[str]:
    """``names`` (a subset ``chosen`` of the linear layers), with ``"*.<last>"`` for each last name
    component every linear layer of which is in ``chosen``."""
    by_last: dict[str, list[str]] = {}
    for n in linear:
        by_last.setdefault(n.rpartition(".")[2], []).append(n)
    out, done = [], set()
    for n in names:
        last = n.rpartition(".")[2]
        if "." in n and len(by_last[last]) > 1 and all(x in chosen for x in by_last[last]):
            if last not in done:
                out.append(f"*.{last}")
                done.add(last)
        else:
            out.append(n)
    return out


def quantization_config(layers: dict[str, dict], linear: list[str], meta: metadata.Metadata) -> dict:
    """Quark's ``quantization_config`` for ``{linear layer: layer config}`` (empty: excluded)."""
    keys = {m: json.dumps(c, sort_keys=True) for m, c in layers.items()}
    quantized = [m for m in linear if layers[m] != _EMPTY]
    common = Counter(keys[m] for m in quantized).most_common(1)
    glob = json.loads(common[0][0]) if common else dict(_EMPTY)
    per_layer = {}
    for key in dict.fromkeys(keys[m] for m in quantized):
        members = [m for m in quantized if keys[m] == key]
        if key == json.dumps(glob, sort_keys=True):
            continue
        for pattern in _compress(members, set(members), linear):
            per_layer[pattern] = json.loads(key)
    excluded = [m for m in linear if layers[m] == _EMPTY]
    kv = next((layers[m]["output_tensors"] for m in quantized for s in meta.activations
               if s.role in _KV_PROJ and m == f"{s.module}.{_KV_PROJ[s.role]}"), None)
    hint = metadata.encode(meta.entries, recipe=meta.recipe, recipe_name=meta.recipe_name,
                           activations=meta.activations, carried=meta.carried)
    exclude = _compress(excluded, set(excluded), linear)
    exclude += [m for m in carried_modules(meta.carried) if m not in exclude]  # carried tensors' modules: float
    return {"quant_method": "quark", "global_quant_config": glob, "layer_quant_config": per_layer,
            "layer_type_quant_config": {}, "exclude": exclude,
            "kv_cache_quant_config": ({p: layer_config(output_tensors=kv) for p in KV_CACHE_GROUP} if kv else {}),
            "kv_cache_post_rope": False, "algo_config": None, "softmax_quant_spec": None, "quant_mode": "eager_mode",
            "version": FORMAT_VERSION,
            "export": {"kv_cache_group": list(KV_CACHE_GROUP) if kv else [], "min_kv_scale": 0.0,
                       "pack_method": "reorder", "weight_format": "real_quantized", "weight_merge_groups": None},
            "qtransform": hint}

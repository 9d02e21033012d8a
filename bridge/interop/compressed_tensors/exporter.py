"""``--to compressed-tensors``: checkpoints vLLM and transformers' compressed-tensors quantizer load.

The export is a transformers checkpoint directory: ``config.json`` with a ``quantization_config``
of ``quant_method: "compressed-tensors"`` (``config_groups`` of layers sharing one scheme,
``ignore``, ``kv_cache_scheme``, ``format``, ``quantization_status: "compressed"``), safetensors
shards with compressed-tensors' tensor names and packing (:mod:`.tensors`), and the tokenizer
and generation files. What maps to what (:mod:`.config`):

* integer weights (``int1``..``int8``, ``uint1``..``uint8``; per tensor, per output channel, groups
  along the input features, 2-D blocks; symmetric or with an integer zero point) are
  ``pack-quantized`` (``int-quantized`` when the layer's inputs are integer-quantized too);
* fp8 e4m3 weights are ``float-quantized`` (``naive-quantized`` without activation quantizers);
  static per-tensor and dynamic per-tensor/per-token/group activation quantizers (int or fp8 e4m3)
  become ``input_activations``/``output_activations`` with ``input_scale``/``output_scale``; the
  static key/value cache becomes ``kv_cache_scheme`` with ``k_scale``/``v_scale`` (strategy ``tensor``, or
  ``attn_head`` for per-head scales: vLLM's ``CompressedTensorsKVCacheMethod.create_weights``);
* ``mxfp4``, ``mxfp6_e2m3``, ``mxfp8_e4m3`` and ``nvfp4`` are ``mxfp4-pack-quantized``,
  ``mxfp6-pack-quantized``, ``mxfp8-quantized`` and ``nvfp4-pack-quantized``.

Mixture-of-experts weights (the stacked ``<experts>.gate_up_proj`` / ``down_proj`` of transformers 5) are written
one 2-D layer per expert and projection under the original checkpoint names that transformers' ``save_pretrained``
and vLLM's fused-MoE loaders use (Mixtral ``block_sparse_moe.experts.{e}.w1``/``w3``/``w2``, Qwen-MoE
``mlp.experts.{e}.gate_proj``/``up_proj``/``down_proj``: :mod:`bridge.interop.experts`); a ``"Linear"`` target covers
them (vLLM gives FusedMoE layers the ``Linear`` scheme), float experts and routers are named in ``ignore``.
Experts stored transposed (GPT-OSS), of model types without known per-expert names, whose scale blocks straddle
the gate/up boundary, or whose projections differ in scheme, are refused by path.

All of these are exact: the codes and scales are ours, bit for bit. Float zero points (HQQ), fp8
e5m2 and the other element types compressed-tensors lacks are ``"nearest"``: with
``allow_nearest`` the weight is dequantized and re-quantized to :func:`.config.nearest` (its
extra error is measured in the README). compressed-tensors holds float scales in the model's
dtype (``config.json``'s ``dtype``): scales wider than it (float32 scales of a bfloat16 model) are
refused, or rounded to it with ``allow_nearest``. GPTQ's act-order needs no ``g_idx``: our GPTQ fixes its
groups before the column loop (``static_groups``), so checkpoints carry no permutation.

Carried tensors (the input's tensors the model class does not load: multi-token-prediction layers,
:attr:`bridge.interop.Checkpoint.carried`) are written as stored under their own names, their modules named in
``ignore`` (so vLLM and transformers build them unquantized); our metadata records them (``carried``).

Our own metadata (specs, recipe, tied paths) rides along in the shards' safetensors metadata
(``qtransform_config``), ignored by other readers, so that :class:`.importer.CompressedTensorsImporter`
gives back the very tree that was exported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, NamedTuple

import torch
from torch import nn

import qtransform as qt

from ...arch.embeddings import output_embeddings
from ...checkpoint import metadata, store
from ...checkpoint.metadata import Entry
from ...modules.actquant import PREFIX
from . import config as ct_config
from .. import experts as moe
from ..base import Checkpoint, Exporter, Support, carried_modules, copy_extras, judged_spec, write_config
from ..hf_model import model_paths
from .importer import GLOBAL_SCALES_KEY, HINT_KEY
from .model import QUANTIZABLE, is_cached_attention, skeleton
from .tensors import to_ct

__all__ = ["CompressedTensorsExporter"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class _Layer(NamedTuple):
    """One quantized module of the export."""

    weight: qt.QTensor | None      # the (possibly re-quantized) weight, None for activation-only layers
    mapping: ct_config.Mapping | None
    inputs: dict | None            # QuantizationArgs of its input / output quantizers
    outputs: dict | None


class _Plan(NamedTuple):
    layers: dict[str, _Layer]                  # module name -> layer
    kv: dict | None                            # the kv_cache_scheme
    specs: dict[str, qt.QuantSpec]             # exported spec per weight path
    activations: dict[qt.Site, qt.QuantSpec]   # exported activation specs
    linears: list[str]                         # every nn.Linear and router of the model (for "Linear" targets)
    problems: list[str]
    untie: bool = False                        # the output embedding is quantized: transformers must not tie it
    arch: str = ""                             # the model class (for configs that do not name it)
    claimed: frozenset = frozenset()           # tree paths the layers write (experts: as per-expert pieces)
    experts: tuple = ()                        # checkpoint names of the experts modules
    naming: moe.Naming | None = None           # per-expert names of this model type (bridge.interop.experts)


def _model_dtype(config: dict) -> torch.dtype | None:
    name = config.get("dtype") or config.get("torch_dtype")
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    return dt if dt in _FLOATS else None


def _fits(src: torch.dtype, dst: torch.dtype) -> bool:
    """Every ``src`` value is a ``dst`` value (compressed-tensors holds scales in the model's dtype)."""
    return src == dst or dst == torch.float32 or (src == torch.float16 and dst == torch.float32)


def _weight_layer(path: str, q: qt.QTensor, mdtype, allow_nearest: bool, problems: list) -> tuple | None:
    """``(_Layer, exported spec)`` of one 2-D quantized weight (re-quantized to the nearest spec, scales rounded to
    the model's dtype with ``allow_nearest``), or ``None`` with the reason appended to ``problems``."""
    spec = ct_config.nearest(q.spec)
    mapping = ct_config.weight_mapping(spec)
    cols = q.shape[-1]
    size = mapping.args.get("group_size")
    if size and cols % size:
        problems.append(f"{path}: group size {size} does not divide the {cols} input features "
                        "(compressed-tensors needs whole groups)")
        return None
    if spec != q.spec:  # re-quantized; integer zero points: the MSE-searched range (10.6 % rather than
        w = qt.dequantize(q)  # 11.7 % weight error from HQQ's 7.1 % on SmolLM2, where min/max is worse)
        q = qt.quantize(w, qt.choose_qparams(w, spec, observer="mse" if spec.fmt.family == "int" else None))
    if mdtype is not None and q.qparams.scale.is_floating_point() and mapping.kind in ("pack", "int", "float") \
            and not _fits(q.qparams.scale.dtype, mdtype):
        if not allow_nearest:
            problems.append(f"{path}: {q.qparams.scale.dtype} scales in a {mdtype} model (compressed-tensors "
                            "holds scales in the model's dtype; quantize the model in float32, or pass "
                            f"allow_nearest=True / --allow-nearest to round them to {mdtype})")
            return None
        spec = spec.replace(scale_dtype=str(mdtype).removeprefix("torch."))
        qp = qt.QParams(spec=spec, **{**q.qparams.tensors(), "scale": q.qparams.scale.to(mdtype)})
        q = qt.QTensor(codes=q.codes, qparams=qp, width=q.width, dtype=q.dtype)
    return _Layer(q, mapping, None, None), spec


def _experts_schemes(layers: dict, experts: dict, naming) -> list[str]:
    """vLLM's fused-MoE loaders take one scheme for all projections of an experts module: refuse others by name."""
    out = []
    for module in experts:
        prefix = moe.export_name(module, naming) + "."
        args = {json.dumps([layer.mapping and layer.mapping.args, layer.inputs], sort_keys=True)
                for n, layer in layers.items() if n.startswith(prefix)}
        if len(args) > 1:
            out.append(f"{module}: its experts' projections are quantized with {len(args)} different schemes; vLLM's "
                       "fused-MoE loaders take one scheme for gate, up and down")
    return out


def _plan(source: Checkpoint, allow_nearest: bool) -> _Plan:
    """Everything the export writes, or the reasons it cannot (``problems``, one line per path)."""
    problems: list[str] = []
    model, why = skeleton(source.config, model_paths(source))
    if model is None:
        return _Plan({}, None, {}, {}, [], [f"{source.directory}: {why}"])
    modules = dict(model.named_modules())
    mdtype = _model_dtype(source.config)
    experts = moe.experts_modules(model)
    naming = moe.naming_of(source.config)
    layers, specs, claimed = {}, {}, set()
    for path, entry in source.meta.entries.items():
        mname, _, leaf = path.rpartition(".")
        module = modules.get(mname)
        if mname in experts:
            why = moe.refusal(path, experts[mname], naming, entry.spec, entry.shape, target="compressed-tensors")
            if why is not None:
                problems.append(why)
                continue
            s = ct_config.judge(judged_spec(path, entry), "weight")
            if s.kind == "no" or (s.kind == "nearest" and not allow_nearest):
                continue  # reported by Exporter.problems
            for piece, q in moe.pieces(path, source.tree[path], naming):
                layer = _weight_layer(f"{piece}.weight", q, mdtype, allow_nearest, problems)
                if layer is not None:
                    layers[piece], specs[f"{piece}.weight"] = layer
            claimed.add(path)
            continue
        if leaf != "weight" or not isinstance(module, QUANTIZABLE):
            kind = "no module" if module is None else type(module).__name__
            problems.append(f"{path}: {kind} weight; compressed-tensors quantizes the weights of nn.Linear and "
                            "nn.Embedding only (transformers' Conv1D of GPT-2 included)")
            continue
        s = ct_config.judge(entry.spec, "weight")
        if s.kind == "no" or (s.kind == "nearest" and not allow_nearest):
            continue  # reported by Exporter.problems
        layer = _weight_layer(path, source.tree[path], mdtype, allow_nearest, problems)
        if layer is not None:
            name = moe.export_name(mname, naming)
            layers[name], specs[f"{name}.weight"] = layer
            claimed.add(path)
    problems += _experts_schemes(layers, experts, naming)
    acts, kv_specs = {}, {}
    for site, spec in source.meta.activations.items():
        s = ct_config.judge(spec, site.role)
        if s.kind == "no" or (s.kind == "nearest" and not allow_nearest):
            continue
        spec = ct_config.nearest(spec)
        module = modules.get(site.module)
        if site.role in qt.spec.KV_ROLES:
            if module is None or not is_cached_attention(module):
                problems.append(f"{site.module}:{site.role}: not an attention module whose key/value cache "
                                "compressed-tensors quantizes")
            kv_specs[site] = spec
        elif moe.site_weight(site.module, experts) and site.role == "input" and naming is not None:
            args = ct_config.activation_args(spec, site.role)  # vLLM: one input quantizer per expert and projection
            for piece in moe.input_pieces(site.module, source.tree[site.module].shape[0], naming):
                layers[piece] = layers.get(piece, _Layer(None, None, None, None))._replace(inputs=args)
        elif not isinstance(module, nn.Linear):
            problems.append(f"{site.module}:{site.role}: compressed-tensors quantizes activations of nn.Linear only")
        else:
            name = moe.export_name(site.module, naming)
            old = layers.get(name, _Layer(None, None, None, None))
            args = ct_config.activation_args(spec, site.role)
            layers[name] = old._replace(**{"inputs" if site.role == "input" else "outputs": args})
        acts[site] = spec
    kv = None
    if kv_specs:
        attn = sorted(n for n, m in modules.items() if is_cached_attention(m))
        covered = {s.module for s in kv_specs}
        if len(set(kv_specs.values())) > 1 or covered != set(attn) or \
                {s.role for s in kv_specs} != set(qt.spec.KV_ROLES) or len(kv_specs) != 2 * len(covered):
            problems.append("key/value cache: compressed-tensors' kv_cache_scheme is one scheme for the keys and "
                            f"values of every attention layer ({len(attn)} here); this checkpoint quantizes "
                            f"{len(kv_specs)} key/value sites with {len(set(kv_specs.values()))} spec(s)")
        else:
            kv = ct_config.activation_args(next(iter(kv_specs.values())), "key")
    routers = set(moe.routers(model))  # float in vLLM's MoE models; named in ignore all the same
    linears = sorted(moe.export_name(n, naming) for n, m in modules.items() if isinstance(m, nn.Linear) or n in routers)
    head = output_embeddings(model)
    head_name = next((n for n, m in modules.items() if head is not None and m is head), None)
    untie = bool(source.config.get("tie_word_embeddings")) and f"{head_name}.weight" in specs
    return _Plan(layers, kv, specs, acts, linears, problems, untie, type(model).__name__, frozenset(claimed),
                 tuple(moe.export_name(n, naming) for n in experts), naming)


def _kind(layer: _Layer) -> str:
    """How the layer's weight is stored: integer weights of ``int-quantized`` layers unpacked in int8."""
    fmt = ct_config.compression_format(layer.mapping, layer.inputs)
    return "int" if fmt == "int-quantized" else layer.mapping.kind


def _groups(plan: _Plan) -> tuple[dict, list[str], str]:
    """``config_groups``, ``ignore`` and the top-level ``format``."""
    by_scheme: dict[str, list[str]] = {}
    schemes = {}
    for name, layer in plan.layers.items():
        fmt = "dense" if layer.mapping is None else ct_config.compression_format(layer.mapping, layer.inputs)
        scheme = {"weights": None if layer.mapping is None else layer.mapping.args,
                  "input_activations": layer.inputs, "output_activations": layer.outputs, "format": fmt}
        key = json.dumps(scheme, sort_keys=True)
        schemes[key] = scheme
        by_scheme.setdefault(key, []).append(name)
    groups, ignore = {}, []
    keys = sorted(by_scheme)
    owner = {f"{x}.": x for x in plan.experts}

    def experts_of(name):  # the experts module (checkpoint name) of a per-expert piece, or None
        return next((x for p, x in owner.items() if name.startswith(p)), None)

    def targets_of(names):  # per-expert pieces as one regex per experts module (which vLLM matches too)
        return sorted({moe.ignore_pattern(x, plan.naming) if (x := experts_of(n)) else n for n in names})
    only = len(keys) == 1 and {n for n in by_scheme[keys[0]] if experts_of(n) is None} <= set(plan.linears)
    for i, key in enumerate(keys):
        targets = ["Linear"] if only else targets_of(by_scheme[key])
        groups[f"group_{i}"] = {"targets": targets, **schemes[key]}
    if only:  # vLLM gives FusedMoE layers the "Linear" scheme: float experts must be ignored by name
        quantized = {experts_of(n) for n in by_scheme[keys[0]]}
        ignore = sorted(set(plan.linears) - set(by_scheme[keys[0]])) + \
            [moe.ignore_pattern(x, plan.naming) for x in plan.experts if x not in quantized]
    formats = {s["format"] for s in schemes.values()} - {"dense"}
    top = formats.pop() if len(formats) == 1 else "mixed-precision" if formats else "dense"
    return groups, ignore, top


def _act_tensors(source: Checkpoint, site: qt.Site, spec: qt.QuantSpec, sep: str = ".") -> dict[str, torch.Tensor]:
    """compressed-tensors' tensors of a static activation quantizer (``input_scale``... shape ``(1,)``; a per-head
    key/value cache's ``k_scale``/``v_scale`` ``(num_key_value_heads, 1, 1)``, as llm-compressor writes strategy
    ``attn_head`` and vLLM flattens it), by their tree names (``<module><sep>input_scale``: ``sep`` ``"_"`` for an
    experts projection's buffers)."""
    out = {}
    for field in ("scale",) if spec.symmetric else ("scale", "zero_point"):
        name = f"{site.module}{sep}{PREFIX[site.role]}{field}"
        if name not in source.tree:
            if field == "scale":
                raise ValueError(f"{name}: the static {site.role} quantizer's scale is not in the checkpoint")
            continue
        per_head = site.role in qt.spec.KV_ROLES and not isinstance(spec.granularity, qt.PerTensor)
        t = source.tree[name].reshape(-1, 1, 1) if per_head else source.tree[name].reshape(1)
        if field == "zero_point":
            codec = spec.fmt.codec
            off = 0 if codec.signed else 1 << (codec.bits - 1)
            t = (t.to(torch.int32) - off).to(torch.int8)
        out[name] = t
    return out


def _tensor_groups(source: Checkpoint, plan: _Plan) -> Iterator[dict[str, torch.Tensor]]:
    """The tensors to write, one group per layer (kept in one shard), made as the shards are written: a layer's
    compressed form (one expert's projection for experts) is built when its shard is."""
    claimed = set()
    for name, layer in plan.layers.items():
        if layer.weight is not None:
            parts = to_ct(layer.weight, _kind(layer), args=layer.mapping.args, where=f"{name}.weight")
            yield {f"{name}.{k}": v for k, v in parts.items()}
            claimed.add(f"{name}.weight")
    for site, spec in plan.activations.items():
        if not spec.dynamic and plan.naming is not None and site.module in source.meta.entries:  # experts' input
            acts = _act_tensors(source, site, spec, sep="_")  # the tree's <experts>.gate_up_proj_input_scale...
            pieces = moe.input_pieces(site.module, source.tree[site.module].shape[0], plan.naming)
            yield {f"{p}.{n[len(site.module) + 1:]}": t for p in pieces for n, t in acts.items()}
            claimed |= set(acts)
        elif not spec.dynamic:
            acts = _act_tensors(source, site, spec)
            yield acts
            claimed |= {f"{site.module}.{PREFIX[site.role]}{f}" for f in qt.QParams.FIELDS}
    tied = bool(source.config.get("tie_word_embeddings", True)) and not plan.untie
    experts = {moe.import_name(x, plan.naming) for x in plan.experts} if plan.naming is not None else set()
    for path, leaf in source.tree.items():
        if path in claimed or path in source.meta.entries or path in plan.claimed:
            continue
        if path in source.meta.aliases and (tied or isinstance(leaf, qt.QTensor)):
            continue  # transformers ties it on load (save_pretrained stores tied tensors once too)
        if path.rpartition(".")[0] in experts and leaf.dim() == 3:  # float experts: per-expert weights too
            yield {f"{name}.weight": t for name, t in moe.pieces(path, leaf, plan.naming)}
            continue
        yield {moe.export_name(path, plan.naming): leaf}
    for name, t in source.carried.items():  # as stored, under their own names (named in ignore)
        yield {name: t}


def _hint(source: Checkpoint, plan: _Plan) -> str:
    """Our metadata of the exported tree (``qtransform_config``), for the importer."""
    entries = {f"{n}.weight": Entry(plan.specs[f"{n}.weight"], tuple(layer.weight.shape), layer.weight.dtype)
               for n, layer in plan.layers.items() if layer.weight is not None}
    d = metadata.encode(entries, recipe=source.meta.recipe, recipe_name=source.meta.recipe_name,
                        rules=source.meta.rules, aliases=source.meta.aliases, skip_modules=source.meta.skip_modules,
                        activations=plan.activations, carried=tuple(source.carried))
    return json.dumps(d, sort_keys=True, separators=(",", ":"))


def _global_scales(plan: _Plan) -> str:
    """Our exact NVFP4 tensor scales (compressed-tensors stores their reciprocals), ``{path: float.hex()}``."""
    return json.dumps({f"{n}.weight": float(layer.weight.qparams.global_scale).hex() for n, layer in plan.layers.items()
                       if layer.weight is not None and layer.weight.qparams.global_scale is not None}, sort_keys=True)


class CompressedTensorsExporter(Exporter):
    """``--to compressed-tensors`` (see the module docstring)."""

    name = "compressed-tensors"
    description = "compressed-tensors (vLLM, transformers): pack-quantized int1-8, fp8 (+ activations, KV cache), " \
                  "MXFP4/6/8, NVFP4"
    carries = True

    def support(self, spec: qt.QuantSpec, role: str = "weight") -> Support:
        return ct_config.judge(spec, role)

    def _plan(self, source: Checkpoint, allow_nearest: bool) -> _Plan:
        """:func:`_plan`, kept for the source it was made for (``export`` asks :meth:`problems`, then writes)."""
        key = (id(source), id(source.tree), allow_nearest)
        cached = getattr(self, "_last", None)
        if cached is None or cached[0] != key or cached[1] is not source:
            self._last = (key, source, _plan(source, allow_nearest))
        return self._last[2]

    def problems(self, source: Checkpoint, *, allow_nearest: bool = False) -> list[str]:
        out = super().problems(source, allow_nearest=allow_nearest)
        plan = self._plan(source, allow_nearest)
        out += plan.problems
        for name, layer in plan.layers.items():  # data: zero points compressed-tensors cannot store
            if layer.weight is not None and layer.mapping.kind in ("pack", "int"):
                try:
                    to_ct(layer.weight, _kind(layer), args=layer.mapping.args, where=f"{name}.weight")
                except ValueError as e:
                    out.append(str(e))
        if out:  # nothing will be written: do not keep the tree alive
            self._last = None
        return out

    def write(self, source: Checkpoint, out: Path, *, allow_nearest: bool = False) -> None:
        plan = self._plan(source, allow_nearest)
        self._last = None
        if plan.problems:
            raise ValueError("export to compressed-tensors:\n  " + "\n  ".join(plan.problems))
        groups, ignore, fmt = _groups(plan)
        ignore = ignore + [m for m in carried_modules(source.carried) if m not in ignore]  # carried: float
        qc = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
              "config_groups": groups, "ignore": ignore, "kv_cache_scheme": plan.kv,
              "global_compression_ratio": None, "sparsity_config": {}, "transform_config": {}}
        store.write_shards(out, _tensor_groups(source, plan),
                           file_metadata={"format": "pt", HINT_KEY: _hint(source, plan),
                                          GLOBAL_SCALES_KEY: _global_scales(plan)})
        config = dict(source.config)
        if plan.untie:  # a quantized output embedding: its own weights, not the (float) input embedding's
            config["tie_word_embeddings"] = False
        if not config.get("architectures"):  # a model built from a config: the class the skeleton took
            config["architectures"] = [plan.arch]
        write_config(out, {**config, "quantization_config": qc})
        copy_extras(source, out)

"""Reading Quark HF-format checkpoints (``quant_method: "quark"``) into our tree, without re-quantizing.

Each linear layer's Quark config is resolved as Quark's loader does: the first
``layer_quant_config`` pattern that matches its name (``fnmatch``), else ``layer_type_quant_config
["Linear"]``, else ``global_quant_config``; ``exclude`` leaves it in floating point (its key/value
cache output, if ``kv_cache_quant_config`` names it, still counts). A layer is quantized where its
config has a weight spec and the checkpoint holds ``<layer>.weight_scale``; its weight becomes a
:class:`~qtransform.QTensor` holding the very codes, scales and zero points
(:func:`~bridge.interop.quark.tensors.from_quark`). Static activation scales become
``<layer>.input_scale`` / ``output_scale`` (and zero points); the outputs of the
``export.kv_cache_group`` projections ``k_proj`` / ``v_proj`` become the attention module's
``k_scale`` / ``v_scale``. Everything else (biases, norms, embeddings, unquantized layers) is copied; the tensors
our export recorded as carried (``qtransform``'s ``carried``: the input's tensors the model class does not load)
come back as stored, apart from the tree (:attr:`~bridge.interop.Checkpoint.carried`). Per-expert
weights (``...experts.{e}.gate_proj``, Mixtral's ``w1``) take their experts module's config (as vLLM resolves a
FusedMoE layer's) and are stacked back into our experts paths (:func:`bridge.interop.experts.fuse`).

A checkpoint that :class:`~bridge.interop.quark.QuarkExporter` wrote carries our specs under
``quantization_config["qtransform"]``: where one decodes like the spec read from Quark's fields,
it is taken (with the logical dtype), so export then import gives back the same tree. Quark
dtypes or schemes without a qtransform equivalent (two-stage NVFP4-style configs, dynamic
weights, MX int8...) raise ``ValueError`` naming the layer.

Before anything is built, :func:`~bridge.interop.quark.validate.check_config` checks the config's keys and
types, the digests our exporter writes into the shards are verified (``verify=False`` skips them), and every
stored tensor is checked against what the config says (shape, dtype, packed width); codes or quantization
tensors without their scale or weight, and a config that disagrees with the spec recorded beside it, are
refused by name (:class:`~bridge.CheckpointError` naming the file and the tensor or key).
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

import torch

import qtransform as qt

from ...checkpoint import config_file, metadata, store
from ...checkpoint.layout import dtype_from_name, dtype_name
from ...checkpoint.tree_io import CONFIG
from . import config as qc
from ...checkpoint.metadata import CheckpointError
from .. import experts
from ..base import FLOAT_SCALES, Checkpoint, Importer, verify_shards
from .tensors import from_quark, symmetric_zero
from .validate import check_config

__all__ = ["QuarkImporter", "resolve_layer"]

#: A per-expert projection (``model.layers.0.mlp.experts.3.gate_proj``, Mixtral's ``...experts.3.w1``).
_PIECE = re.compile(r"^(?P<module>.+\.experts)\.\d+\.[A-Za-z0-9_]+$")

_KV = {"k_proj": ("key", "k_scale"), "v_proj": ("value", "v_scale")}
_PART_SUFFIXES = (".weight_scale", ".weight_zero_point", ".input_zero_point", ".output_zero_point")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def resolve_layer(qcfg: dict, name: str) -> dict | None:
    """The Quark layer config of the linear layer ``name`` (``None``: not quantized), as Quark resolves it."""
    for pattern, cfg in (qcfg.get("layer_quant_config") or {}).items():
        if fnmatch.fnmatch(name, pattern):
            chosen = cfg
            break
    else:
        chosen = (qcfg.get("layer_type_quant_config") or {}).get("Linear") or qcfg.get("global_quant_config")
    if any(fnmatch.fnmatch(name, pattern) for pattern in qcfg.get("exclude") or []):
        kv = next((c for p, c in (qcfg.get("kv_cache_quant_config") or {}).items() if fnmatch.fnmatch(name, p)), None)
        return {"weight": None, "input_tensors": None, "output_tensors": kv.get("output_tensors")} if kv else None
    return chosen


def _logical_shape(cfg: dict, weight: torch.Tensor, scale: torch.Tensor, where: str) -> tuple[int, int]:
    dtype, grouped = cfg.get("dtype"), cfg.get("qscheme") == "per_group"
    if weight.dim() != 2:
        raise ValueError(f"{where}: a {weight.dim()}-D quantized weight; Quark's linear weights are 2-D")
    a, b = weight.shape
    if grouped and dtype in ("int4", "uint4") and scale.dim() != 2:
        raise ValueError(f"{where}: a {scale.dim()}-D weight_scale; Quark's per-group scales are 2-D (groups, out)")
    if dtype in ("int4", "uint4"):
        return (int(scale.shape[-1]), a) if grouped else (a, b * 8)
    if dtype in ("int8", "uint8"):
        return (b, a) if grouped else (a, b)
    if dtype == "fp4":
        return a, b * 2
    if dtype in ("fp6_e3m2", "fp6_e2m3"):
        return a, b * 4 // 3
    return a, b


def _scale_dtype(cfg: dict, scale: torch.Tensor, where: str) -> str:
    if cfg.get("scale_format") == "e8m0":
        if scale.dtype != torch.uint8:
            raise ValueError(f"{where}: e8m0 scales stored as {scale.dtype}, expected uint8")
        return "e8m0"
    name = dtype_name(scale.dtype)
    if name not in FLOAT_SCALES:
        raise ValueError(f"{where}: scales stored as {name}; expected one of {list(FLOAT_SCALES)}")
    return name


def _symmetric(cfg: dict, zp: torch.Tensor | None, fmt: str) -> bool:
    """Quark says symmetric and every stored zero point is the symmetric one."""
    return bool(cfg.get("symmetric")) and cfg.get("zero_point_type") != "float32" and (
        zp is None or bool(torch.all(zp == symmetric_zero(fmt))))


def _weight(cfg: dict, parts: dict, dtype: torch.dtype, where: str, reorder: bool, cfg_where: str) -> qt.QTensor:
    """The QTensor of one layer's stored ``parts``; errors name ``where`` (the file and tensor) or, for what the
    config says, ``cfg_where`` (config.json and the layer)."""
    zp = parts.get("weight_zero_point")
    if zp is not None and zp.is_floating_point() and zp.dtype != parts["weight_scale"].dtype:
        # our float zero points share the scale's dtype: read both as float32 (exact for either)
        parts = {**parts, "weight_scale": parts["weight_scale"].float(), "weight_zero_point": zp.float()}
    scale_dtype = _scale_dtype(cfg, parts["weight_scale"], where)
    shape = _logical_shape(cfg, parts["weight"], parts["weight_scale"], where)
    spec = qc.spec_of(cfg, scale_dtype=scale_dtype, symmetric=False, where=cfg_where)
    q = from_quark(parts, spec, shape, dtype, where, reorder=reorder)
    if spec.format in qc.INT_DTYPES and _symmetric(cfg, q.qparams.zero_point, spec.format):
        q = from_quark(parts, qc.spec_of(cfg, scale_dtype=scale_dtype, symmetric=True, where=cfg_where), shape, dtype, where,
                       reorder=reorder)
    return q


def _activation(cfg: dict, scale: torch.Tensor, zp: torch.Tensor | None, kv: bool, where: str):
    """``(spec, {field: tensor})`` of a static per-tensor activation quantizer."""
    if cfg.get("qscheme") != "per_tensor" or cfg.get("is_dynamic"):
        raise ValueError(f"{where}: a {'dynamic ' if cfg.get('is_dynamic') else ''}{cfg.get('qscheme')} activation "
                         "quantizer; only static per-tensor ones are imported")
    dtype = cfg.get("dtype")
    if dtype not in ("fp8_e4m3", "fp8_e5m2", "int8", "uint8"):
        raise ValueError(f"{where}: activation dtype {dtype!r} is not imported")
    sdt = _scale_dtype(cfg, scale, where)
    sym = dtype.startswith("fp8") or _symmetric(cfg, zp, dtype)
    spec = qt.QuantSpec(format=dtype, granularity=qt.PerTensor(), symmetric=sym, scale_dtype=sdt)
    grid = () if kv else (1, 1)
    if scale.numel() != 1 or (zp is not None and (zp.numel() != 1 or zp.is_floating_point() or zp.dtype == torch.bool)):
        bad = "scale" if scale.numel() != 1 else "zero_point"
        raise ValueError(f"{where}: a per-tensor activation {bad} must be one {'float' if bad == 'scale' else 'integer'}"
                         f", got shape {list((scale if bad == 'scale' else zp).shape)} and dtype "
                         f"{(scale if bad == 'scale' else zp).dtype}")
    fields = {"scale": scale.reshape(grid).contiguous()}
    want = qt.choose_qparams(torch.zeros(1, 1), spec).zero_point
    if want is not None:
        if zp is None:
            raise ValueError(f"{where}: an integer activation quantizer without a zero point")
        fields["zero_point"] = zp.reshape(grid).to(want.dtype).contiguous()
    return spec, fields


def _read_all(root: Path, verify: bool) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """``({name: shard file}, {name: tensor})``: every tensor, its digest checked first (unless ``verify`` is
    false; shards written by Quark itself carry none)."""
    located, handles = store.open_shards(root)
    verify_shards(root, located, verify=verify)
    out = {}
    for name, f in located.items():
        try:
            out[name] = handles[f].get_tensor(name)
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{root / f}: cannot read tensor {name!r} ({e})") from None
    return located, out


def _hint(qcfg: dict) -> metadata.Metadata | None:
    raw = qcfg.get("qtransform")
    if not isinstance(raw, dict):
        return None
    try:
        return metadata.decode(raw, where="quantization_config.qtransform")
    except metadata.CheckpointError:
        return None


class QuarkImporter(Importer):
    """Reads Quark's HF format (see the module docstring)."""

    name = "quark"

    def detect(self, directory: Path) -> bool:
        p = Path(directory) / CONFIG
        if not p.is_file():
            return False
        try:
            qcfg = json.loads(p.read_text()).get("quantization_config")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            return False
        return isinstance(qcfg, dict) and qcfg.get("quant_method") == "quark"

    def read(self, directory: Path, *, verify: bool = True) -> Checkpoint:
        root = Path(directory)
        if not isinstance(verify, bool):
            raise TypeError(f"quark import: verify must be True or False, got {verify!r}")
        if not self.detect(root):
            raise ValueError(f"{root}: not a Quark checkpoint (config.json with quantization_config.quant_method "
                             "'quark')")
        cfile = root / CONFIG
        config = config_file.read_config(cfile)
        check_config(config, cfile)  # shapes and types of every key, before anything is read
        qcfg = config["quantization_config"]
        export = qcfg.get("export") or {}
        kv_group = export.get("kv_cache_group") or []
        if export.get("weight_format", "real_quantized") != "real_quantized":
            raise CheckpointError(f"{cfile}: Quark export with weight_format {export.get('weight_format')!r}; only "
                                  "'real_quantized' weights are read (fake-quantized ones are plain float checkpoints)")
        if export.get("pack_method", "reorder") not in ("reorder", "order"):
            raise CheckpointError(f"{cfile}: Quark pack_method {export.get('pack_method')!r} is not 'reorder' or "
                                  "'order'")
        reorder = export.get("pack_method", "reorder") == "reorder"
        located, tensors = _read_all(root, verify)
        at = lambda n: f"{root / located[n]}: {n}"  # noqa: E731  (where a stored tensor's error points)
        hint = _hint(qcfg)
        carried = hint.carried if hint is not None else ()  # as stored, not the model's: apart from the tree
        gone = sorted(n for n in carried if n not in tensors)
        if gone:
            raise CheckpointError(f"{cfile}: carried tensor(s) {gone[:5]} recorded with the export "
                                  "(quantization_config.qtransform) are not stored (deleted or renamed)")
        carried = {n: tensors.pop(n) for n in carried}
        dtype = dtype_from_name(config.get("dtype") or config.get("torch_dtype") or "float32")
        tree, entries, acts, consumed = {}, {}, {}, set()
        for wname in [n for n in tensors if n.endswith(".weight") and f"{n}_scale" in tensors]:
            layer = wname[: -len(".weight")]
            piece = _PIECE.match(layer)  # one expert's projection: its experts module's config, as vLLM resolves it
            cfg = resolve_layer(qcfg, piece["module"] if piece else layer)
            if cfg is None or cfg.get("weight") is None:
                raise CheckpointError(f"{at(wname)}: stored with a weight_scale, but the Quark config ({cfile}) "
                                      f"leaves {layer} unquantized")
            if isinstance(cfg["weight"], list):
                raise CheckpointError(f"{cfile}: {layer}: a two-stage Quark weight quantizer (e.g. NVFP4-style); "
                                      "not imported")
            if cfg.get("bias") is not None:
                raise CheckpointError(f"{cfile}: {layer} has a quantized bias in Quark's config; not imported")
            parts = {k: tensors[f"{layer}.{k}"] for k in ("weight", "weight_scale", "weight_zero_point")
                     if f"{layer}.{k}" in tensors}
            try:
                q = _weight(cfg["weight"], parts, dtype, at(wname), reorder, f"{cfile}: {wname}")
            except ValueError as e:
                raise CheckpointError(str(e)) from None
            known = hint.entries.get(wname) if hint is not None else None
            if known is not None and _recorded(known.spec, known.shape) != _recorded(q.spec, q.shape):
                raise CheckpointError(f"{cfile}: {wname}: the Quark config and tensors read as "
                                      f"{_recorded(q.spec, q.shape)}, the spec recorded with the export "
                                      f"(quantization_config.qtransform) says {_recorded(known.spec, known.shape)}")
            if known is not None and qc.decodes_alike(known.spec, q.spec):
                q = qt.QTensor(codes=q.codes, qparams=qt.QParams(spec=known.spec, scale=q.qparams.scale,
                                                                 zero_point=q.qparams.zero_point),
                               width=q.width, dtype=known.dtype)
            tree[wname], entries[wname] = q, metadata.Entry(q.spec, tuple(q.shape), q.dtype)
            consumed |= {f"{layer}.{k}" for k in parts}
        for sname in [n for n in tensors if n.endswith((".input_scale", ".output_scale"))]:
            layer, _, field = sname.rpartition(".")
            role = field.removesuffix("_scale")
            cfg = resolve_layer(qcfg, layer) or {}
            tcfg = cfg.get(f"{role}_tensors")
            if not isinstance(tcfg, dict):
                raise CheckpointError(f"{at(sname)}: stored, but the Quark config ({cfile}) of {layer} has no "
                                      f"static {role} quantizer")
            parent, _, last = layer.rpartition(".")
            kv = role == "output" and last in _KV and any(fnmatch.fnmatch(layer, p) for p in kv_group)
            zname = f"{layer}.{role}_zero_point"
            try:
                spec, fields = _activation(tcfg, tensors[sname], tensors.get(zname), kv, at(sname))
            except ValueError as e:
                raise CheckpointError(str(e)) from None
            site = qt.Site(parent, _KV[last][0]) if kv else qt.Site(layer, role)
            prefix = f"{parent}.{_KV[last][1].removesuffix('scale')}" if kv else f"{layer}.{role}_"
            known = hint.activations.get(site) if hint is not None else None
            if known is not None and not qc.decodes_alike(known, spec):
                raise CheckpointError(f"{at(sname)}: the Quark config ({cfile}) reads it as {spec}, the spec recorded "
                                      f"with the export (quantization_config.qtransform) says {known}")
            acts[site] = known if known is not None else spec
            tree.update({prefix + f: t for f, t in fields.items()})
            consumed |= {sname, zname}
        _check_leftovers(tensors, consumed, hint, at, cfile)
        for name, t in tensors.items():
            if name not in consumed:
                tree[name] = t
        tree, entries = experts.fuse(tree, entries, config, where=root)  # per-expert weights: our stacked experts
        tree, acts = experts.fuse_inputs(tree, acts, config, prefixes={"input": "input_", "output": "output_"},
                                         where=root)  # per-expert input scales: one quantizer per projection
        for site, spec in list(acts.items()):
            known = hint.activations.get(site) if hint is not None else None
            if known is not None and known != spec and qc.decodes_alike(known, spec):
                acts[site] = known
        missing = sorted(f"{s.module} ({s.role})" for s, a in (hint.activations if hint else {}).items()
                         if isinstance(a, qt.QuantSpec) and not a.dynamic and s not in acts)
        if missing:
            raise CheckpointError(f"{cfile}: static activation quantizer(s) {missing[:5]} recorded with the export "
                                  "(quantization_config.qtransform) have no stored scale (deleted or renamed?)")
        meta = metadata.Metadata(
            entries=entries, recipe=hint.recipe if hint else None, recipe_name=hint.recipe_name if hint else None,
            version=metadata.VERSION_ACTIVATIONS if acts else metadata.VERSION, activations=acts,
            carried=tuple(carried))
        return Checkpoint(root, meta, tree, {k: v for k, v in config.items() if k != "quantization_config"}, carried)


def _recorded(spec: qt.QuantSpec, shape) -> tuple:
    """What the spec our export recorded must agree on with the one read from Quark's fields (an offset zero
    point is exported as a float32 one; float zero points and their scales are read as float32)."""
    scale = spec.scale_dtype if spec.symmetric or spec.zero_point_domain == "int" else None
    return spec.format, spec.granularity, scale, list(shape)


def _check_leftovers(tensors: dict, consumed: set, hint, at, cfile) -> None:
    """Refuse what a quantized layer left behind: a quantization tensor without its layer's weight or scale,
    codes (an integer or float8 weight) without their scale, a weight our export recorded as quantized."""
    for name, t in tensors.items():
        if name in consumed:
            continue
        if name.endswith(_PART_SUFFIXES):
            raise CheckpointError(f"{at(name)}: a quantization tensor without its layer's "
                                  f"{'weight' if '_scale' in name else 'scale'} (deleted or renamed?)")
        if name.endswith(".weight") and t.dtype not in _FLOATS:
            raise CheckpointError(f"{at(name)}: {t.dtype} codes without their weight_scale (a quantized weight "
                                  "whose scale was deleted or renamed)")
        if hint is not None and name in hint.entries:
            raise CheckpointError(f"{at(name)}: quantized ({hint.entries[name].spec.format}) in the spec recorded "
                                  f"with the export ({cfile}: quantization_config.qtransform), stored without its "
                                  "weight_scale")
    if hint is not None:
        gone = sorted(p for p in hint.entries if p not in tensors)
        if gone:
            raise CheckpointError(f"{cfile}: quantized tensor(s) {gone[:5]} recorded with the export "
                                  "(quantization_config.qtransform) are not stored")

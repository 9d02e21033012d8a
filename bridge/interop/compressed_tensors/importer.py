"""Reading compressed-tensors checkpoints (ours, or llm-compressor's) into our tree, without re-quantizing.

:class:`CompressedTensorsImporter` finds each quantized layer's scheme (``config_groups`` targets
and ``ignore``: names, ``re:`` regexes, class names, the last resolved on the model built on the
``meta`` device), reads its args back into our spec (:func:`.config.spec_of`) and its tensors
into a QTensor (:func:`.tensors.from_ct`): codes and scales bit for bit. Activation quantizers
become our activation sites (``input_scale`` -> the ``input`` site), ``kv_cache_scheme`` the
``key``/``value`` sites of every attention layer with ``k_scale``/``v_scale``. The tensors our export recorded as
carried (the input's tensors the model class does not load, its metadata's ``carried``) come back as they are
stored, apart from the tree (:attr:`~bridge.interop.Checkpoint.carried`).

A checkpoint that :class:`~bridge.interop.compressed_tensors.CompressedTensorsExporter` wrote
carries our metadata (``qtransform_config`` in the safetensors metadata): where its spec of a
tensor stores the same bits (the same compressed-tensors args, the tensors read back under it),
the importer takes it, so calibration-only fields (``symmetric_range``, ``pad``...), unsigned
formats, the recipe and tied paths come back as they were: export then import gives the same tree.
Act-order permutations (``weight_g_idx`` other than ``i // group_size``) have no equivalent in our
checkpoints and are refused. Per-expert weights of mixture-of-experts checkpoints (``...experts.{e}.gate_proj``,
Mixtral's ``w1``; quantized or float) are selected by ``"Linear"`` targets and stacked back into our experts paths
(:func:`bridge.interop.experts.fuse`).

Before anything is built, :func:`~bridge.interop.compressed_tensors.validate.check_config` checks the config's
keys and types, the digests our exporter writes into the shards are verified (``verify=False`` skips them),
and every stored tensor is checked against the args (shape, dtype, an exact packed width: never cut to fit);
codes or quantization tensors without their scale, and args that disagree with the spec recorded beside
them, are refused by name (:class:`~bridge.CheckpointError` naming the file and the tensor or key).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

import qtransform as qt

from ...checkpoint import config_file, metadata, store
from ...checkpoint.metadata import CheckpointError, Entry, Metadata
from ...checkpoint.tree_io import CONFIG
from . import config as ct_config
from .. import experts
from ..base import Checkpoint, Importer, verify_shards
from .model import matches, skeleton
from .tensors import from_ct, reciprocal
from .validate import check_config

__all__ = ["CompressedTensorsImporter", "HINT_KEY", "GLOBAL_SCALES_KEY"]

#: The safetensors metadata key of our metadata in exports.
HINT_KEY = "qtransform_config"
#: ... and of our NVFP4 tensor scales (``{path: float.hex()}``): compressed-tensors stores their reciprocals,
#: and not every float32 is the reciprocal of one, so the exact value travels beside it.
GLOBAL_SCALES_KEY = "qtransform_global_scales"
_WEIGHT_PARTS = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_global_scale",
                 "weight_g_idx")
_ACT_PREFIX = {"input": "input_", "output": "output_", "key": "k_", "value": "v_"}


def _infer_format(w: dict, inputs: dict | None) -> str:
    """The compressor compressed-tensors infers for a scheme without a ``format`` of its own."""
    bits, typ, group = w.get("num_bits"), w.get("type"), w.get("group_size")
    if typ == "float" and group == 32 and bits in (4, 6):
        return f"mxfp{bits}-pack-quantized"
    if typ == "float" and group == 32 and bits == 8 and str(w.get("scale_dtype")) in ("torch.uint8", "uint8"):
        return "mxfp8-quantized"
    if typ == "float" and bits == 4 and group == 16:
        return "nvfp4-pack-quantized"
    if typ == "int":
        return "int-quantized" if inputs is not None else "pack-quantized"
    return "float-quantized" if inputs is not None else "naive-quantized"


def _logical_shape(parts: dict, kind: str, where: str) -> tuple[int, int]:
    t = parts.get("weight", parts.get("weight_packed"))
    if "weight_shape" in parts:
        s = parts["weight_shape"]
        if s.dtype not in (torch.int64, torch.int32) or tuple(s.shape) != (2,) or bool((s <= 0).any()) or \
                t is None or t.dim() != 2 or int(s[0]) != t.shape[0]:
            raise ValueError(f"{where}_shape: {s.dtype} {s.tolist()} is not the two positive sizes of the stored "
                             f"{None if t is None else list(t.shape)} weight")
        return int(s[0]), int(s[1])
    if t is None or t.dim() != 2:
        raise ValueError(f"{where}: no 2-D weight or weight_packed")
    rows, cols = t.shape
    return rows, {"mxfp4": 2 * cols, "nvfp4": 2 * cols, "mxfp6": 4 * cols // 3}.get(kind, cols)


def _same_args(mapping_args: dict, args: dict) -> bool:
    norm = lambda v: str(v).removeprefix("torch.") if v is not None else None  # noqa: E731
    return all(norm(args.get(k)) == norm(v) for k, v in mapping_args.items())


class CompressedTensorsImporter(Importer):
    """Reads ``quant_method: "compressed-tensors"`` checkpoint directories (see the module docstring)."""

    name = "compressed-tensors"

    def detect(self, directory: Path) -> bool:
        path = Path(directory) / CONFIG
        try:
            qc = json.loads(path.read_text()).get("quantization_config") if path.is_file() else None
        except (OSError, ValueError, AttributeError):
            return False
        return isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors"

    def read(self, directory: Path, *, verify: bool = True) -> Checkpoint:
        root = Path(directory)
        if not isinstance(verify, bool):
            raise TypeError(f"compressed-tensors import: verify must be True or False, got {verify!r}")
        config = config_file.read_config(root / CONFIG)
        qc = config.get("quantization_config") if isinstance(config, dict) else None
        if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
            raise CheckpointError(f"{root / CONFIG}: not a compressed-tensors checkpoint")
        check_config(config, root / CONFIG)  # shapes and types of every key, before anything is read
        if qc.get("quantization_status", "compressed") != "compressed":
            raise CheckpointError(f"{root / CONFIG}: quantization_status {qc.get('quantization_status')!r}: the "
                                  "weights are not stored compressed (nothing to import without re-quantizing)")
        located, handles = store.open_shards(root)
        verify_shards(root, located, verify=verify)  # our exports' digests (llm-compressor's files carry none)
        hint = self._hint(handles, HINT_KEY)
        hmeta = self._hint_meta(hint)
        carried = _carried(located, handles, hmeta.carried if hmeta else (), root)  # as stored, not the model's
        located = {n: f for n, f in located.items() if n not in carried}
        hint_weights, hint_acts = self._hint_specs(hint)
        exact_globals = self._hint(handles, GLOBAL_SCALES_KEY)
        plain = {k: v for k, v in config.items() if k != "quantization_config"}
        scheme_of = _resolver(qc, plain, root)
        read = lambda n: handles[located[n]].get_tensor(n)  # noqa: E731
        tree, entries, activations, claimed = {}, {}, {}, set()

        def add_activation(site, args):
            (spec, tensors), names = self._activation(site, args, located, read, hint_acts,
                                                      where=f"{root}: {site.module}:{site.role}")
            activations[site] = spec
            tree.update(tensors)
            claimed.update(names)

        weight_modules = {n.rpartition(".")[0] for n in located if n.endswith((".weight_scale", ".weight_packed"))}
        act_modules = {n.rpartition(".")[0] for n in located if n.endswith((".input_scale", ".output_scale"))}
        for mname in sorted(weight_modules | act_modules):
            scheme = scheme_of(mname)
            w = scheme.get("weights")
            if w is not None and mname in weight_modules:
                parts = {p: read(f"{mname}.{p}") for p in _WEIGHT_PARTS if f"{mname}.{p}" in located}
                claimed |= {f"{mname}.{p}" for p in parts}
                fmt = scheme.get("format") or (qc.get("format") if qc.get("format") not in (None, "mixed-precision")
                                               else _infer_format(w, scheme.get("input_activations")))
                try:
                    q = self._weight(parts, w, fmt, _dtype(plain), hint_weights.get(f"{mname}.weight"),
                                     f"{root / located[f'{mname}.{next(iter(parts))}']}: {mname}.weight")
                    q = _exact_global(q, parts, exact_globals.get(f"{mname}.weight"))
                except ValueError as e:
                    raise CheckpointError(str(e)) from None
                tree[f"{mname}.weight"] = q
                entries[f"{mname}.weight"] = Entry(q.spec, tuple(q.shape), q.dtype)
            for role in ("input", "output"):
                if scheme.get(f"{role}_activations") is not None:
                    add_activation(qt.Site(mname, role), scheme[f"{role}_activations"])
        if qc.get("kv_cache_scheme") is not None:
            for mname in sorted({n.rpartition(".")[0] for n in located if n.endswith(".k_scale")}):
                for role in qt.spec.KV_ROLES:
                    add_activation(qt.Site(mname, role), qc["kv_cache_scheme"])
        _check_leftovers(located, handles, claimed, hint_weights, entries, root)
        tree.update({n: read(n) for n in located if n not in claimed})
        tree, entries = experts.fuse(tree, entries, plain, where=root)  # per-expert weights: our stacked experts
        tree, activations = experts.fuse_inputs(tree, activations, plain, prefixes=_ACT_PREFIX, where=root)
        for site, spec in list(activations.items()):  # experts' inputs: the spec our metadata recorded, same args
            hs = hint_acts.get(f"{site.module}:{site.role}")
            if hs is not None and hs != spec and ct_config.judge(hs, site.role).kind == "exact" and _same_args(
                    ct_config.activation_args(hs, site.role), ct_config.activation_args(spec, site.role)):
                activations[site] = hs
        aliases = {a: t for a, t in (hint.get("aliases") or {}).items() if t in tree and a not in tree}
        tree.update({a: tree[t] for a, t in aliases.items()})
        meta = Metadata(entries=entries, layout="native", recipe=hmeta.recipe if hmeta else None,
                        recipe_name=hmeta.recipe_name if hmeta else None, rules=hmeta.rules if hmeta else {},
                        aliases=aliases, skip_modules=hmeta.skip_modules if hmeta else None,
                        version=metadata.VERSION_ACTIVATIONS if activations else metadata.VERSION,
                        activations=activations, carried=tuple(carried))
        return Checkpoint(root, meta, tree, plain, carried)

    # ------------------------------------------------------------------ pieces
    @staticmethod
    def _hint(handles, key: str) -> dict:
        for f, h in handles.items():
            raw = (h.metadata() or {}).get(key)
            if raw:
                try:
                    d = json.loads(raw)
                except ValueError:
                    d = None
                if not isinstance(d, dict):
                    raise CheckpointError(f"{f}: safetensors metadata {key!r} (written by qtransform's export) is not a "
                                          "JSON object: the file was edited")
                return d
        return {}

    @staticmethod
    def _hint_meta(hint: dict) -> Metadata | None:
        return metadata.decode(hint, where=f"safetensors metadata {HINT_KEY!r}") if hint else None

    @staticmethod
    def _hint_specs(hint: dict) -> tuple[dict, dict]:
        """``({weight path: (spec, dtype)}, {"module:role": spec})`` our metadata recorded (empty when absent
        or unreadable)."""
        try:
            specs = [qt.QuantSpec.from_dict(s) for s in hint.get("specs", [])]
            weights = {p: (specs[e["spec"]], metadata.dtype_from_name(e["dtype"]))
                       for p, e in hint.get("tensors", {}).items()}
            acts = {k: specs[i] for k, i in (hint.get("activations") or {}).items()}
            return weights, acts
        except (AttributeError, KeyError, IndexError, TypeError, ValueError) as e:
            raise CheckpointError(f"safetensors metadata {HINT_KEY!r} (written by qtransform's export) is malformed "
                                  f"({type(e).__name__}: {e})") from None

    def _weight(self, parts: dict, args: dict, fmt: str, dtype, hinted, where: str) -> qt.QTensor:
        if "weight_g_idx" in parts:
            g, size = parts.pop("weight_g_idx"), args.get("group_size") or 0
            if size <= 0 or not torch.equal(g.long(), torch.arange(g.numel()) // size):
                raise ValueError(f"{where}: an act-order permutation (weight_g_idx), which qtransform checkpoints "
                                 "cannot hold (quantize with static groups instead)")
        if "weight_scale" not in parts:
            raise ValueError(f"{where}: quantized (a weight_packed is stored) but its weight_scale is not")
        spec, kind = ct_config.spec_of(args, fmt, parts["weight_scale"].dtype, where=where)
        shape = _logical_shape(parts, kind, where)
        if hinted is not None:  # the spec our metadata recorded: it must store the same bits
            hs, hdtype = hinted
            try:
                m = ct_config.weight_mapping(hs)
            except ValueError:
                m = None
            if m is None or not (m.kind == kind or {m.kind, kind} == {"pack", "int"}) or not _same_args(m.args, args):
                raise CheckpointError(f"{where}: the args of config.json {args} disagree with the spec recorded with the "
                                      f"export ({HINT_KEY}: {hs}): the config was edited")
            return from_ct(parts, kind, hs, shape, hdtype, args=args, where=where)
        return from_ct(parts, kind, spec, shape, dtype, args=args, where=where)

    def _activation(self, site: qt.Site, args: dict, located, read, hinted, *, where: str):
        """``((spec, {our tensor name: tensor}), ct names read)`` of one activation quantizer."""
        prefix = f"{site.module}.{_ACT_PREFIX[site.role]}"
        names = {f: prefix + f for f in ("scale", "zero_point") if prefix + f in located}
        if not args.get("dynamic") and "scale" not in names:
            raise CheckpointError(f"{where}: static quantizer without {prefix}scale")
        scale = read(names["scale"]) if "scale" in names else None
        zp = read(names["zero_point"]) if "zero_point" in names else None
        heads = args.get("strategy") == "attn_head" and site.role in qt.spec.KV_ROLES
        n = 1 if not heads or scale is None else scale.numel()  # per head: (num_key_value_heads[, 1, 1])
        if scale is not None and ((scale.numel() != 1 and not heads) or not scale.is_floating_point()
                                  or (heads and scale.dim() > 1 and list(scale.shape[1:]) != [1] * (scale.dim() - 1))):
            raise CheckpointError(f"{where}: {names['scale']} must hold one float"
                                  f"{' per key/value head' if heads else ''}, got shape {list(scale.shape)} "
                                  f"and dtype {scale.dtype}")
        if zp is not None and (zp.numel() != n or zp.is_floating_point() or zp.dtype == torch.bool):
            raise CheckpointError(f"{where}: {names['zero_point']} must hold one integer, got shape "
                                  f"{list(zp.shape)} and dtype {zp.dtype}")
        try:
            spec = ct_config.activation_spec_of(args, None if scale is None else scale.dtype, where=where)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        hs = hinted.get(f"{site.module}:{site.role}")
        if hs is not None and ct_config.judge(hs, site.role).kind == "exact":
            if not (_same_args(ct_config.activation_args(hs, site.role), args) and hs.scale_dtype == spec.scale_dtype):
                raise CheckpointError(f"{where}: the config's {site.role} quantizer ({spec}) disagrees with the spec "
                                      f"recorded with the export ({hs})")
            spec = hs
        out = {}
        if not spec.dynamic:
            shape = ((n,) if n > 1 else ()) if site.role in qt.spec.KV_ROLES else (1, 1)
            out[names["scale"]] = scale.reshape(shape)
            codec = spec.fmt.codec
            if spec.fmt.family == "int" and (not spec.symmetric or not codec.signed):  # uint: the fixed mid-range one
                off = 0 if codec.signed else 1 << (codec.bits - 1)
                z = zp.to(torch.int32) if zp is not None else torch.zeros(1, dtype=torch.int32)
                out[prefix + "zero_point"] = (z + off).to(codec.code_dtype).reshape(shape)
        return (spec, out), set(names.values())


_FLOATS = ("F32", "F16", "BF16", "F64")


def _carried(located, handles, names, root: Path) -> dict:
    """``{name: tensor}`` of the carried tensors our export recorded (``carried`` in its metadata): the input's
    tensors the model class does not load, stored as they were beside the model's; each must be stored."""
    gone = sorted(n for n in names if n not in located)
    if gone:
        raise CheckpointError(f"{root}: carried tensor(s) {gone[:5]} recorded with the export ({HINT_KEY}) are not "
                              "stored (deleted or renamed)")
    return {n: handles[located[n]].get_tensor(n) for n in names}


def _check_leftovers(located, handles, claimed: set, hinted: dict, entries: dict, root: Path) -> None:
    """Refuse what a quantized layer left behind: quantization tensors no scheme read (a weight_packed, zero
    point, shape... without its scale), codes (an integer or float8 weight) without their scale, a weight our
    export recorded as quantized that was not read as one."""
    for name, f in located.items():
        if name in claimed:
            continue
        where = f"{root / f}: {name}"
        last = name.rpartition(".")[2]
        if last in _WEIGHT_PARTS[1:] or last in ("input_zero_point", "output_zero_point", "k_zero_point",
                                                 "v_zero_point"):
            raise CheckpointError(f"{where}: a quantization tensor that no quantized layer read (its scale or "
                                  "weight deleted or renamed, or no config_groups scheme selects its layer)")
        if last == "weight" and handles[f].get_slice(name).get_dtype() not in _FLOATS:
            raise CheckpointError(f"{where}: {handles[f].get_slice(name).get_dtype()} codes without their "
                                  "weight_scale (a quantized weight whose scale was deleted or renamed)")
    gone = sorted(p for p in hinted if p not in entries)
    if gone:
        raise CheckpointError(f"{root}: {gone[:5]} quantized in the spec recorded with the export ({HINT_KEY}), "
                              "not stored as quantized (a scale deleted or renamed)")


#: A per-expert projection of a mixture-of-experts checkpoint (``...experts.3.gate_proj``, Mixtral's ``w1``...):
#: no module of the transformers model (its experts are one module), selected by ``"Linear"`` targets as vLLM does.
_PIECE = re.compile(r"^.+\.experts\.\d+\.[A-Za-z0-9_]+$")
_EXPERT_LINEAR = torch.nn.Linear(1, 1, device="meta")


def _resolver(qc: dict, config: dict, root: Path):
    """``scheme_of(module name)``: the ``config_groups`` scheme that selects a module holding quantization
    tensors (names and regexes first; class names on the model built on the ``meta`` device)."""
    groups, ignore, built = qc.get("config_groups") or {}, qc.get("ignore") or [], {}

    def scheme_of(mname: str) -> dict:
        named = [g for g in groups.values() if matches(mname, None, g.get("targets", []))]
        module = None
        if not named:
            if "modules" not in built:
                model, why = skeleton(config)
                if model is None:
                    raise CheckpointError(f"{root}: config_groups target module classes: {why}")
                built["modules"] = dict(model.named_modules())
            module = built["modules"].get(mname)
            if module is None and _PIECE.match(mname):  # one expert's projection: a Linear, as vLLM's FusedMoE reads it
                module = _EXPERT_LINEAR
            named = [g for g in groups.values() if module is not None and matches(mname, module, g.get("targets", []))]
        if not named or matches(mname, module, ignore):
            raise CheckpointError(f"{root}: {mname} has quantization tensors but no config_groups scheme selects it")
        return named[0]
    return scheme_of


def _exact_global(q: qt.QTensor, parts: dict, value) -> qt.QTensor:
    """``q`` with the NVFP4 tensor scale our metadata recorded, when its reciprocal is the stored one."""
    if q.qparams.global_scale is None or not isinstance(value, str):
        return q
    try:
        g = torch.tensor(float.fromhex(value), dtype=torch.float32)
    except (ValueError, OverflowError):
        return q
    if not torch.equal(reciprocal(g), parts["weight_global_scale"].reshape(1).float()):
        return q
    qp = qt.QParams(spec=q.spec, **{**q.qparams.tensors(), "global_scale": g})
    return qt.QTensor(codes=q.codes, qparams=qp, width=q.width, dtype=q.dtype)


def _dtype(config: dict) -> torch.dtype:
    name = config.get("dtype") or config.get("torch_dtype") or "float32"  # a name: checked by check_config
    dt = getattr(torch, str(name), None)
    return dt if isinstance(dt, torch.dtype) and dt.is_floating_point else torch.float32

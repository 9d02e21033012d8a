"""What a qtransform checkpoint holds, read from its metadata and safetensors headers only.

>>> import torch, tempfile, qtransform as qt, bridge
>>> from bridge.app.describe import describe
>>> m = torch.nn.Sequential(torch.nn.Linear(64, 32))
>>> q = bridge.quantize(m, qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)))
>>> d = tempfile.mkdtemp() + "/ckpt"
>>> bridge.save(q, d)
>>> print(describe(d).splitlines()[0])
checkpoint .../ckpt: 1 quantized tensor(s), 1 other tensor(s)
"""

from __future__ import annotations

import math
from pathlib import Path

import qtransform as qt

from ..checkpoint import CONFIG, LAYOUTS, read_metadata, store
from ..checkpoint.store import read_json
from ..io import imported_format
from .report import format_bytes, online_rows, online_summary, steps_label, table, tree_bytes

__all__ = ["describe", "describe_imported", "stored_bytes"]


def stored_bytes(directory) -> dict[str, int]:
    """``{stored tensor name: bytes}`` from the shard headers (no tensor data is read)."""
    return store.header_bytes(*store.open_shards(Path(directory)))


def describe(directory) -> str:
    """A table: per quantized tensor its spec, granularity, shape, bytes, bits/weight and rule.
    Another tool's checkpoint (Quark, compressed-tensors, GGUF) is described as our importer reads it."""
    root = Path(directory)
    fmt = imported_format(root)
    if fmt is not None:
        return describe_imported(root, fmt)
    meta = read_metadata(root)
    raw = read_json(root / CONFIG, "model config")["quantization_config"]
    sizes = stored_bytes(root)
    layout = LAYOUTS[meta.layout]
    parts = {p: [n for n in layout.expected(p, e.spec, e.shape, e.dtype) if n in sizes]
             for p, e in meta.entries.items()}
    claimed = {n for ns in parts.values() for n in ns}
    rows = [["tensor", "format", "granularity", "shape", "bytes", "bits/weight", "rule"]]
    q_bytes = q_numel = 0
    for path, e in meta.entries.items():
        nbytes = sum(sizes[n] for n in parts[path])
        numel = math.prod(e.shape)
        q_bytes, q_numel = q_bytes + nbytes, q_numel + numel
        spec_txt = str(e.spec).split(" ")
        rows.append([path, e.spec.format, " ".join(spec_txt[1:]), "x".join(map(str, e.shape)),
                     format_bytes(nbytes), f"{8 * nbytes / numel:.3f}", meta.rules.get(path, "")])
    other = {n: b for n, b in sizes.items() if n not in claimed}
    steps = "?" if meta.recipe is None else steps_label(meta.recipe.steps)
    recipe = meta.recipe_name or ("stored" if meta.recipe is not None else "none")
    lines = [f"checkpoint {root}: {len(meta.entries)} quantized tensor(s), {len(other)} other tensor(s)",
             f"steps: {steps}; recipe: {recipe}; qtransform {raw.get('qtransform_version', '?')}, "
             f"metadata version {meta.version}, layout {meta.layout}", ""]
    lines += table(rows)
    lines += ["", _totals(q_bytes, q_numel, sum(other.values()))]
    if meta.activations:
        lines.append("activation quantizers: " + "; ".join(_activation_summary(meta.activations)))
    if meta.online:
        lines.append("online rotations: " + "; ".join(online_summary(online_rows(meta.online))))
    return "\n".join(lines)


def _totals(q_bytes: int, q_numel: int, other: int) -> str:
    return (f"quantized: {format_bytes(q_bytes)} for {q_numel / 1e6:.2f}M weights "
            f"({8 * q_bytes / max(q_numel, 1):.3f} bits/weight); other tensors: {format_bytes(other)}; "
            f"total {format_bytes(q_bytes + other)}")


def _activation_summary(activations) -> list[str]:
    """``"<count> <role> <spec> (static|dynamic)"`` per kind of activation quantizer, in first-seen order
    (the key/value cache's are stored as ``k_scale``/``v_scale`` of the attention modules)."""
    counts: dict[tuple, int] = {}
    for site, spec in activations.items():
        key = (site.role, str(spec), "dynamic" if spec.dynamic else "static")
        counts[key] = counts.get(key, 0) + 1
    return [f"{n} {role} {spec} ({kind})" for (role, spec, kind), n in counts.items()]


def describe_imported(directory, fmt: str) -> str:
    """:func:`describe` of another tool's checkpoint: the specs our importer maps its tensors to (exact:
    the importer refuses, naming the tensor, what it cannot map)."""
    from .. import interop

    root = Path(directory)
    source = interop.IMPORTERS[fmt].read(root)
    rows = [["tensor", "format", "granularity", "shape", "bytes", "bits/weight"]]
    floats = {p: t for p, t in source.tree.items() if not isinstance(t, qt.QTensor)}
    q_bytes = q_numel = 0
    for path, leaf in source.tree.items():
        if path in floats:
            continue
        nbytes, numel = leaf.nbytes(), math.prod(leaf.shape)
        q_bytes, q_numel = q_bytes + nbytes, q_numel + numel
        spec_txt = str(leaf.spec).split(" ")
        rows.append([path, leaf.spec.format, " ".join(spec_txt[1:]), "x".join(map(str, leaf.shape)),
                     format_bytes(nbytes), f"{8 * nbytes / numel:.3f}"])
    meta = source.meta
    lines = [f"{fmt} checkpoint {root}: {len(rows) - 1} quantized tensor(s), {len(floats)} other tensor(s) "
             "(read by qtransform's importer, not re-quantized)", ""]
    lines += table(rows)
    lines += ["", _totals(q_bytes, q_numel, tree_bytes(floats))]
    if meta.activations:
        lines.append("activation quantizers: " + "; ".join(_activation_summary(meta.activations)))
    return "\n".join(lines)

"""What a qtransform checkpoint holds, read from its metadata and safetensors headers only.

>>> import torch, tempfile, qtransform as qt, bridge
>>> from bridge.describe import describe
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

from . import io, metadata
from .report import table, format_bytes

__all__ = ["describe", "tensor_bytes"]


_WIDTH = {name: dtype.itemsize for dtype, name in io._ST_DTYPES.items()}  # safetensors dtype -> bytes


def tensor_bytes(directory) -> dict[str, int]:
    """``{stored tensor name: bytes}`` from the shard headers (no tensor data is read)."""
    located, handles = io._open_shards(Path(directory))
    out = {}
    for name, f in located.items():
        sl = handles[f].get_slice(name)
        shape, dtype = sl.get_shape(), sl.get_dtype()
        out[name] = math.prod(shape) * _WIDTH.get(dtype, 1)
    return out


def describe(directory) -> str:
    """A table: per quantized tensor its spec, granularity, shape, bytes, bits/weight and rule."""
    root = Path(directory)
    cfg = io._read_json(root / io.CONFIG, "model config")
    qcfg = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    entries = metadata.decode(qcfg, where=str(root / io.CONFIG))
    sizes = tensor_bytes(root)
    rules = qcfg.get("rules") or {}
    parts = {p: [n for n in sizes if n == p or n.startswith(p + "_")] for p in entries}
    claimed = {n for ns in parts.values() for n in ns}
    rows = [["tensor", "format", "granularity", "shape", "bytes", "bits/weight", "rule"]]
    q_bytes = q_numel = 0
    for path, e in entries.items():
        nbytes = sum(sizes[n] for n in parts[path])
        numel = math.prod(e.shape)
        q_bytes, q_numel = q_bytes + nbytes, q_numel + numel
        spec_txt = str(e.spec).split(" ")
        rows.append([path, e.spec.format, " ".join(spec_txt[1:]), "x".join(map(str, e.shape)),
                     format_bytes(nbytes), f"{8 * nbytes / numel:.3f}", rules.get(path, "")])
    other = {n: b for n, b in sizes.items() if n not in claimed}
    lines = [f"checkpoint {root}: {len(entries)} quantized tensor(s), {len(other)} other tensor(s)",
             f"algorithm: {qcfg.get('algorithm', '?')}; recipe: {qcfg.get('recipe_name') or ('stored' if qcfg.get('recipe') else 'none')}; "
             f"qtransform {qcfg.get('qtransform_version', '?')}, metadata version {qcfg.get('version')}", ""]
    lines += table(rows)
    total = q_bytes + sum(other.values())
    lines += ["", f"quantized: {format_bytes(q_bytes)} for {q_numel / 1e6:.2f}M weights "
                  f"({8 * q_bytes / max(q_numel, 1):.3f} bits/weight); other tensors: {format_bytes(sum(other.values()))}; "
                  f"total {format_bytes(total)}"]
    return "\n".join(lines)

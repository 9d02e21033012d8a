"""GGUF (llama.cpp): export of qtransform checkpoints.

**Export** (``qtransform export CKPT --to gguf --out DIR`` writes ``DIR/<name>.gguf`` and
``DIR/gguf_export.json``): each quantized weight whose spec *is* a GGUF block format is written
bit for bit (:data:`~bridge.interop.gguf.tensors.EXACT_TYPES`: Q8_0, Q4_0, Q4_1 with the
``"offset"`` zero point, MXFP4). Any other spec is written, with ``allow_nearest``, as the nearest
GGUF type: its dequantized weight re-quantized to Q4_1 for at most 4 bits, Q8_0 above (the least
extra error); ``--to gguf-k`` writes K-quants instead where rows are a multiple of 256 (Q4_K for at
most 4 bits, Q6_K for 5 and 6: smaller files, more error); the extra error (relative RMS and
largest absolute difference against our dequantized weight, read back through the ``gguf``
package's own dequantization) is measured per tensor into ``gguf_export.json``. Float tensors keep
their dtype (F32, F16, BF16; 1-D tensors F32, as llama.cpp wants norms). Architecture and
tokenizer metadata: :mod:`.arch`. Per-tensor SHA-256 digests (type and data bytes) go into the
metadata key :data:`~.checks.DIGESTS`, which llama.cpp ignores and our importer verifies.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

import qtransform as qt

from . import arch as gguf_arch, checks, tensors as gguf_tensors
from . import moe as gguf_moe
from ..base import Checkpoint, Exporter, Support, judged_spec

__all__ = ["GGUFExporter", "nearest_type", "REPORT"]

#: The per-tensor report written beside the GGUF file.
REPORT = "gguf_export.json"


def nearest_type(spec: qt.QuantSpec, k: int, *, k_quants: bool = False) -> str:
    """The GGUF type a non-exact ``spec`` is written as, for rows of ``k`` elements: the least extra
    error (Q4_1 for at most 4 bits, Q8_0 above), or with ``k_quants`` the smaller K-quant files (Q4_K,
    Q6_K) where rows are a multiple of 256; F16 for rows GGUF blocks cannot hold."""
    bits = spec.fmt.codec.bits
    if k % 32:
        return "F16"
    if bits <= 4:
        return "Q4_K" if k_quants and k % 256 == 0 else "Q4_1"
    if bits <= 6:
        return "Q6_K" if k_quants and k % 256 == 0 else "Q8_0"
    return "Q8_0"


def _nearest_note(spec: qt.QuantSpec, k_quants: bool) -> str:
    bits = spec.fmt.codec.bits
    if k_quants:
        kind = "Q4_K (Q4_1 for rows not a multiple of 256)" if bits <= 4 else \
            "Q6_K (Q8_0 for rows not a multiple of 256)" if bits <= 6 else "Q8_0"
    else:
        kind = "Q4_1" if bits <= 4 else "Q8_0"
    return f"re-quantized to GGUF {kind}; extra error measured per tensor in {REPORT}"


class GGUFExporter(Exporter):
    """``--to gguf``: one ``.gguf`` file llama.cpp and transformers read (see the module)."""

    name = "gguf"
    description = "GGUF for llama.cpp (Q8_0/Q4_0/Q4_1/MXFP4 exact, others as Q4_1/Q8_0)"

    def __init__(self, *, k_quants: bool = False):
        if not isinstance(k_quants, bool):
            raise TypeError(f"GGUFExporter: k_quants must be True or False, got {k_quants!r}")
        self.k_quants = k_quants
        if k_quants:
            self.name = "gguf-k"
            self.description = "GGUF for llama.cpp, nearest types as K-quants (Q4_K/Q6_K: smaller, less exact)"

    def support(self, spec: qt.QuantSpec, role: str = "weight") -> Support:
        if role != "weight":
            if spec.dynamic and role in ("input", "output"):
                return Support("nearest", "dynamic activation quantization is llama.cpp's own (Q8 blocks of the "
                                          "matmul inputs), not stored in the file")
            return Support("no", f"GGUF stores weights only, not a {'static ' if not spec.dynamic else ''}"
                                 f"{role} quantizer")
        qtype = gguf_tensors.exact_type(spec)
        if qtype is not None:
            return Support("exact", f"GGUF {qtype}")
        return Support("nearest", _nearest_note(spec, self.k_quants))

    def problems(self, source: Checkpoint, *, allow_nearest: bool = False) -> list[str]:
        out = super().problems(source, allow_nearest=allow_nearest)
        config = source.config
        arch_issues = gguf_arch.arch_problems(config)
        if arch_issues:
            return out + [f"config.json: {p}" for p in arch_issues]
        for path, name, _, _ in _planned(source, self._paths(source)):
            if name is None:
                out.append(f"{path}: no GGUF tensor name for it in architecture {gguf_arch.arch_of(config)}")
        for path, entry in source.meta.entries.items():
            spec = judged_spec(path, entry)
            exact = gguf_tensors.exact_type(spec) in gguf_tensors.EXACT_TYPES
            matrix = len(entry.shape) == 2 or gguf_moe.expert_pieces(path, entry) is not None
            if exact and (not matrix or entry.shape[-1] % 32) and not allow_nearest:
                out.append(f"{path}: {entry.spec}: shape {tuple(entry.shape)} is not rows of a multiple of 32 "
                           "(GGUF blocks); pass allow_nearest=True / --allow-nearest to write the nearest type")
            if path.endswith(".mlp.shared_expert_gate.weight"):
                out.append(f"{path}: {entry.spec}: llama.cpp reads the shared-expert gate as one float vector "
                           "(ffn_gate_inp_shexp); leave it float (routers are by default)")
        return out

    @staticmethod
    def _paths(source: Checkpoint) -> list[str]:
        """Tree paths to write: tied copies (aliases) of tied embeddings are left out."""
        tied = bool(source.config.get("tie_word_embeddings", False))
        return [p for p in source.tree if not (p in source.meta.aliases and tied)]

    def write(self, source: Checkpoint, out: Path, *, allow_nearest: bool = False) -> None:
        import gguf

        config = source.config
        arch = gguf_arch.arch_of(config)
        name = str(config.get("_name_or_path") or source.directory.name or "model").rstrip("/").split("/")[-1]
        path = Path(out) / f"{name}.gguf"
        writer = gguf.GGUFWriter(str(path), arch)
        gguf_arch.write_arch(writer, config, name)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        tok_note = gguf_arch.write_tokenizer(writer, source.directory, int(config["vocab_size"]))
        report, digests = {}, {}
        for tree_path, gname, leaf, rows in _planned(source, self._paths(source)):
            data, qtype, info = _tensor(tree_path, leaf, config, allow_nearest=allow_nearest, k_quants=self.k_quants,
                                        rows=rows)
            raw_dtype = None if qtype in ("F32", "F16") else gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(gname, data, raw_dtype=raw_dtype)
            digests[gname] = checks.digest_entry(qtype, data)
            report[gname] = {"path": tree_path, "type": qtype, **info}
        writer.add_string(checks.DIGESTS, json.dumps(digests, sort_keys=True, separators=(",", ":")))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        summary = {"file": path.name, "architecture": arch, "tokenizer": tok_note or "written", "tensors": report}
        (Path(out) / REPORT).write_text(json.dumps(summary, indent=2) + "\n")


def _planned(source: Checkpoint, paths: list[str]) -> list[tuple[str, str | None, object, slice | None]]:
    """``(tree path, GGUF name or None, leaf, rows of each expert)`` per tensor: a stacked experts weight as its
    GGUF pieces (:func:`.moe.expert_pieces`), the shared-expert gate ``(1, H)`` as llama.cpp's vector ``(H,)``."""
    config = source.config
    names = gguf_arch.hf_names(paths, gguf_arch.arch_of(config), int(config["num_hidden_layers"]))
    out = []
    for path, name in names.items():
        leaf = source.tree[path]
        pieces = gguf_moe.expert_pieces(path, leaf) if name is None else None
        if pieces is not None:
            out += [(path, n, leaf, rows) for n, rows in pieces]
            continue
        if name is not None and name.endswith("ffn_gate_inp_shexp.weight") and not isinstance(leaf, qt.QTensor):
            leaf = leaf.reshape(-1)
        out.append((path, name, leaf, None))
    return out


def _float_data(w: torch.Tensor) -> tuple[np.ndarray, str]:
    if w.dim() == 1 or w.dtype not in (torch.float16, torch.bfloat16):
        return w.detach().to(torch.float32).contiguous().numpy(), "F32"
    if w.dtype == torch.float16:
        return w.detach().contiguous().numpy(), "F16"
    return w.detach().contiguous().view(torch.uint8).numpy().reshape(*w.shape[:-1], -1), "BF16"


def _tensor(path: str, leaf, config: dict, *, allow_nearest: bool, k_quants: bool = False, rows: slice | None = None):
    """``(data, GGUF type, report entry)`` of one tree leaf (rows in llama.cpp's order); ``rows``: those rows of
    each expert of a stacked experts leaf (gate or up of ``gate_up_proj``)."""
    import gguf.quants

    index = gguf_arch.qk_rows(path, config, leaf.shape[0]) if len(leaf.shape) == 2 else None
    if not isinstance(leaf, qt.QTensor):
        data, qtype = _float_data(gguf_arch.reorder_rows(gguf_moe.take_expert_rows(leaf, rows, path), index))
        return data, qtype, {"kind": "exact"}
    stacked = len(leaf.shape) == 3
    spec = qt.matrix_spec(leaf.spec, tuple(leaf.shape)) if stacked else leaf.spec
    qtype = gguf_tensors.exact_type(spec)
    blocks_fit = len(leaf.shape) in (2, 3) and leaf.shape[-1] % 32 == 0
    if qtype is not None and (blocks_fit or qtype not in gguf_tensors.EXACT_TYPES):
        if stacked:  # expert by expert, each an ordinary matrix: experts the outermost axis
            leaf = gguf_moe.take_expert_rows(leaf, rows, path)
            data = np.stack([gguf_tensors.encode_blocks(qt.stacked.matrix(leaf, e), qtype, path=f"{path}[{e}]")
                             for e in range(leaf.shape[0])])
            return data, qtype, {"kind": "exact", "spec": str(spec)}
        q = gguf_arch.reorder_rows(leaf, index)
        return gguf_tensors.encode_blocks(q, qtype, path=path), qtype, {"kind": "exact", "spec": str(leaf.spec)}
    if not allow_nearest:  # problems() refused it already; a direct call gets the same answer
        raise ValueError(f"{path}: {leaf.spec} has no exact GGUF type; pass allow_nearest=True")
    w = gguf_arch.reorder_rows(gguf_moe.take_expert_rows(qt.dequantize(leaf, dtype=torch.float32), rows, path), index)
    w2 = w.reshape(-1, w.shape[-1]) if w.dim() != 2 else w
    qtype = nearest_type(spec, w2.shape[-1], k_quants=k_quants) if w.dim() >= 2 else "F32"
    if qtype in ("F16", "F32"):
        data = w.numpy().astype(np.float16 if qtype == "F16" else np.float32)
        back = torch.from_numpy(data.astype(np.float32))
    else:
        if qtype in ("Q4_K", "Q6_K"):
            data = gguf_tensors.quantize_k(w2, qtype)
        else:
            data = gguf_tensors.encode_blocks(qt.quantize(w2, qt.choose_qparams(w2, gguf_tensors.IMPORT_SPECS[qtype])),
                                      qtype, path=path)
        data = data.reshape(*w.shape[:-1], -1)
        back = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype]).copy())
    diff = (back.reshape(w.shape) - w).double()
    rms = float(w.double().pow(2).mean().sqrt())
    info = {"kind": "nearest", "spec": str(spec),
            "rel_rms_error": float(diff.pow(2).mean().sqrt()) / max(rms, 1e-30), "max_abs_error": float(diff.abs().max())}
    return data, qtype, info

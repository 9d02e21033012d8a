"""GGUF (llama.cpp): export of qtransform checkpoints and import of GGUF files.

**Export** (``qtransform export CKPT --to gguf --out DIR`` writes ``DIR/<name>.gguf`` and
``DIR/gguf_export.json``): each quantized weight whose spec *is* a GGUF block format is written
bit for bit (:data:`~bridge.interop.gguf_quants.EXACT_TYPES`: Q8_0, Q4_0, Q4_1 with the
``"offset"`` zero point, MXFP4). Any other spec is written, with ``allow_nearest``, as the nearest
GGUF type: its dequantized weight re-quantized to Q4_1 for at most 4 bits, Q8_0 above (the least
extra error); ``--to gguf-k`` writes K-quants instead where rows are a multiple of 256 (Q4_K for at
most 4 bits, Q6_K for 5 and 6: smaller files, more error); the extra error (relative RMS and
largest absolute difference against our dequantized weight, read back through the ``gguf``
package's own dequantization) is measured per tensor into ``gguf_export.json``. Float tensors keep
their dtype (F32, F16, BF16; 1-D tensors F32, as llama.cpp wants norms). Architecture and
tokenizer metadata: :mod:`.gguf_arch`.

**Import** (:class:`GGUFImporter`, registered as ``"gguf"``): a ``.gguf`` file (or a directory
holding one) read into a :class:`~bridge.interop.Source` without re-quantizing: Q4_1, Q8_0, Q4_0,
MXFP4, Q4_K and Q6_K blocks become QTensors whose codes are the file's and whose dequantized values
are the bits the ``gguf`` package's dequantization gives (:data:`~.gguf_quants.IMPORT_SPECS`);
F32/F16/BF16 tensors stay float. Other types raise ``ValueError`` naming the tensor and type,
unless ``GGUFImporter(dequantize=True)`` (then they are dequantized to float32, said per tensor).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

import qtransform as qt

from ..checkpoint.metadata import Metadata, entries_of
from . import gguf_arch, gguf_quants
from .base import Exporter, Importer, Source, Support, register_exporter, register_importer

__all__ = ["GGUFExporter", "GGUFImporter", "nearest_type", "REPORT"]

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
        qtype = gguf_quants.exact_type(spec)
        if qtype is not None:
            return Support("exact", f"GGUF {qtype}")
        return Support("nearest", _nearest_note(spec, self.k_quants))

    def problems(self, source: Source, *, allow_nearest: bool = False) -> list[str]:
        out = super().problems(source, allow_nearest=allow_nearest)
        config = source.config
        arch_issues = gguf_arch.arch_problems(config)
        if arch_issues:
            return out + [f"config.json: {p}" for p in arch_issues]
        names = gguf_arch.hf_names(self._paths(source), gguf_arch.arch_of(config), int(config["num_hidden_layers"]))
        for path, name in names.items():
            if name is None:
                out.append(f"{path}: no GGUF tensor name for it in architecture {gguf_arch.arch_of(config)}")
        for path, entry in source.meta.entries.items():
            exact = gguf_quants.exact_type(entry.spec) in gguf_quants.EXACT_TYPES
            if exact and (len(entry.shape) != 2 or entry.shape[-1] % 32) and not allow_nearest:
                out.append(f"{path}: {entry.spec}: shape {tuple(entry.shape)} is not rows of a multiple of 32 "
                           "(GGUF blocks); pass allow_nearest=True / --allow-nearest to write the nearest type")
        return out

    @staticmethod
    def _paths(source: Source) -> list[str]:
        """Tree paths to write: tied copies (aliases) of tied embeddings are left out."""
        tied = bool(source.config.get("tie_word_embeddings", False))
        return [p for p in source.tree if not (p in source.meta.aliases and tied)]

    def write(self, source: Source, out: Path, *, allow_nearest: bool = False) -> None:
        import gguf

        config = source.config
        arch = gguf_arch.arch_of(config)
        name = str(config.get("_name_or_path") or source.directory.name or "model").rstrip("/").split("/")[-1]
        path = Path(out) / f"{name}.gguf"
        writer = gguf.GGUFWriter(str(path), arch)
        gguf_arch.write_arch(writer, config, name)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        tok_note = gguf_arch.write_tokenizer(writer, source.directory, int(config["vocab_size"]))
        names = gguf_arch.hf_names(self._paths(source), arch, int(config["num_hidden_layers"]))
        report = {}
        for tree_path, gname in names.items():
            leaf = source.tree[tree_path]
            data, qtype, info = _tensor(tree_path, leaf, config, allow_nearest=allow_nearest, k_quants=self.k_quants)
            raw_dtype = None if qtype in ("F32", "F16") else gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(gname, data, raw_dtype=raw_dtype)
            report[gname] = {"path": tree_path, "type": qtype, **info}
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        summary = {"file": path.name, "architecture": arch, "tokenizer": tok_note or "written", "tensors": report}
        (Path(out) / REPORT).write_text(json.dumps(summary, indent=2) + "\n")


def _rows(t: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return t if index is None else t.index_select(0, index)


def _permute_q(q: qt.QTensor, index: torch.Tensor) -> qt.QTensor:
    """``q`` with its rows reordered (codes, scales and zero points of groups along the rows)."""
    qp = q.qparams
    fields = {k: (_rows(v, index) if v.dim() and v.shape[0] == q.shape[0] else v) for k, v in qp.tensors().items()}
    return qt.QTensor(codes=_rows(q.codes, index), qparams=qt.QParams(spec=qp.spec, **fields), width=q.width,
                      dtype=q.dtype)


def _float_data(w: torch.Tensor) -> tuple[np.ndarray, str]:
    if w.dim() == 1 or w.dtype not in (torch.float16, torch.bfloat16):
        return w.detach().to(torch.float32).contiguous().numpy(), "F32"
    if w.dtype == torch.float16:
        return w.detach().contiguous().numpy(), "F16"
    return w.detach().contiguous().view(torch.uint8).numpy().reshape(w.shape[0], -1), "BF16"


def _tensor(path: str, leaf, config: dict, *, allow_nearest: bool, k_quants: bool = False):
    """``(data, GGUF type, report entry)`` of one tree leaf (rows in llama.cpp's order)."""
    import gguf.quants

    index = gguf_arch.qk_rows(path, config, leaf.shape[0]) if len(leaf.shape) == 2 else None
    if not isinstance(leaf, qt.QTensor):
        data, qtype = _float_data(_rows(leaf, index))
        return data, qtype, {"kind": "exact"}
    qtype = gguf_quants.exact_type(leaf.spec)
    blocks_fit = len(leaf.shape) == 2 and leaf.shape[1] % 32 == 0
    if qtype is not None and (blocks_fit or qtype not in gguf_quants.EXACT_TYPES):
        q = leaf if index is None else _permute_q(leaf, index)
        return gguf_quants.encode(q, qtype, path=path), qtype, {"kind": "exact", "spec": str(leaf.spec)}
    if not allow_nearest:  # problems() refused it already; a direct call gets the same answer
        raise ValueError(f"{path}: {leaf.spec} has no exact GGUF type; pass allow_nearest=True")
    w = _rows(qt.dequantize(leaf, dtype=torch.float32), index)
    w2 = w.reshape(-1, w.shape[-1]) if w.dim() != 2 else w
    qtype = nearest_type(leaf.spec, w2.shape[-1], k_quants=k_quants) if w.dim() >= 2 else "F32"
    if qtype in ("F16", "F32"):
        data = w.numpy().astype(np.float16 if qtype == "F16" else np.float32)
        back = torch.from_numpy(data.astype(np.float32))
    else:
        if qtype in ("Q4_K", "Q6_K"):
            data = gguf_quants.quantize_k(w2, qtype)
        else:
            data = gguf_quants.encode(qt.quantize(w2, qt.choose_qparams(w2, gguf_quants.IMPORT_SPECS[qtype])),
                                      qtype, path=path)
        back = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype]).copy())
    diff = (back.reshape(w.shape) - w).double()
    rms = float(w.double().pow(2).mean().sqrt())
    info = {"kind": "nearest", "spec": str(leaf.spec),
            "rel_rms_error": float(diff.pow(2).mean().sqrt()) / max(rms, 1e-30), "max_abs_error": float(diff.abs().max())}
    return data, qtype, info


class GGUFImporter(Importer):
    """Reads a ``.gguf`` file (or a directory with exactly one) into a :class:`Source` (see the module).

    ``dequantize=True`` reads types without an exact spec of ours as float32 instead of refusing."""

    name = "gguf"

    def __init__(self, *, dequantize: bool = False):
        if not isinstance(dequantize, bool):
            raise TypeError(f"GGUFImporter: dequantize must be True or False, got {dequantize!r}")
        self.dequantize = dequantize

    @staticmethod
    def _file(path: Path) -> Path | None:
        p = Path(path)
        if p.is_dir():
            files = sorted(p.glob("*.gguf"))
            p = files[0] if len(files) == 1 else None
        if p is None or not p.is_file():
            return None
        with open(p, "rb") as f:
            return p if f.read(4) == b"GGUF" else None

    def detect(self, directory: Path) -> bool:
        return self._file(directory) is not None

    def read(self, directory: Path) -> Source:
        from gguf import GGUFReader, GGMLQuantizationType, dequantize
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        path = self._file(directory)
        if path is None:
            raise ValueError(f"GGUFImporter.read: {directory} is not a GGUF file (nor a directory holding one)")
        config = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
        if gguf_arch.arch_of(config) is None:
            raise ValueError(f"{path}: architecture {config.get('model_type')!r}: GGUF import supports "
                             f"{sorted(gguf_arch.ARCHES)}")
        names = _gguf_to_hf(config)
        tree, notes = {}, {}
        for t in GGUFReader(str(path)).tensors:
            hf = names.get(t.name)
            if hf is None:
                raise ValueError(f"{path}: tensor {t.name} has no transformers name in architecture "
                                 f"{config['model_type']}")
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists ne0 (the row) first
            kind = GGMLQuantizationType(int(t.tensor_type)).name
            if kind in gguf_quants.IMPORT_SPECS:
                leaf = gguf_quants.decode(np.asarray(t.data), kind, shape, path=t.name)
            elif kind in ("F32", "F16", "BF16"):
                leaf = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))
                if kind == "F16":
                    leaf = leaf.to(torch.float16)
                elif kind == "BF16":
                    leaf = leaf.to(torch.bfloat16)
            elif self.dequantize:
                leaf = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))
                notes[hf] = f"{kind} dequantized to float32"
            else:
                raise ValueError(f"{path}: tensor {t.name} ({hf}) is GGUF {kind}, which no qtransform spec holds "
                                 f"exactly (exact: {sorted(gguf_quants.IMPORT_SPECS)}); pass "
                                 "GGUFImporter(dequantize=True) to read it as float32")
            index = gguf_arch.qk_rows(hf, config, shape[0], inverse=True) if len(shape) == 2 else None
            if index is not None:
                leaf = _permute_q(leaf, index) if isinstance(leaf, qt.QTensor) else leaf.index_select(0, index)
            tree[hf] = leaf
        aliases = {}
        if config.get("tie_word_embeddings") and "lm_head.weight" not in tree and "model.embed_tokens.weight" in tree:
            tree["lm_head.weight"] = tree["model.embed_tokens.weight"]
            aliases["lm_head.weight"] = "model.embed_tokens.weight"
        quantized = {p: v for p, v in tree.items() if isinstance(v, qt.QTensor) and p not in aliases}
        meta = Metadata(entries=entries_of(quantized), aliases=aliases)
        if notes:
            config["gguf_dequantized"] = notes
        return Source(path.parent, meta, tree, config)


def _gguf_to_hf(config: dict) -> dict[str, str]:
    """GGUF tensor name -> transformers path, for the HF names of a model of ``config``."""
    arch = gguf_arch.arch_of(config)
    blocks = int(config["num_hidden_layers"])
    hf = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    per_layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                 "post_attention_layernorm.weight"]
    hf += [f"model.layers.{i}.{n}" for i in range(blocks) for n in per_layer]
    return {g: p for p, g in gguf_arch.hf_names(hf, arch, blocks).items() if g is not None}


register_exporter(GGUFExporter())
register_exporter(GGUFExporter(k_quants=True))
register_importer(GGUFImporter())

"""GGUF (llama.cpp): import of GGUF files.

**Import** (:class:`GGUFImporter`, registered as ``"gguf"``): a ``.gguf`` file (or a directory
holding one) read into a :class:`~bridge.interop.Checkpoint` without re-quantizing: Q4_1, Q8_0, Q4_0,
MXFP4, Q4_K and Q6_K blocks become QTensors whose codes are the file's and whose dequantized values
are the bits the ``gguf`` package's dequantization gives (:data:`~.tensors.IMPORT_SPECS`);
F32/F16/BF16 tensors stay float. Other types raise ``ValueError`` naming the tensor and type,
unless ``GGUFImporter(dequantize=True)`` (then they are dequantized to float32, said per tensor).

Before anything is built (:mod:`.checks`): the file must parse (a damaged one is a
:class:`~bridge.CheckpointError` naming it), every tensor's extent must lie aligned inside the data
section without overlapping another, the hyperparameter keys must be present and typed, agree with
``like`` when given (what ``bridge.load(path, like=model)`` passes), and every tensor must match the
digest our exporter wrote (when the file carries them; ``verify=False`` skips it, as for native checkpoints).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import qtransform as qt

from ...checkpoint.metadata import Metadata, entries_of
from ...checkpoint.metadata import CheckpointError
from . import arch as gguf_arch, checks, moe as gguf_moe, tensors as gguf_tensors
from ..base import Checkpoint, Importer

__all__ = ["GGUFImporter"]


class GGUFImporter(Importer):
    """Reads a ``.gguf`` file (or a directory with exactly one) into a :class:`Checkpoint` (see the module).

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

    def read(self, directory: Path, *, verify: bool = True, like=None) -> Checkpoint:
        """The file as a :class:`Checkpoint`, checked first (see the module): ``verify`` checks the tensors
        against our exporter's digests when present; ``like`` (a transformers model) must have the
        file's architecture and hyperparameters."""
        from gguf import GGMLQuantizationType, dequantize
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        if not isinstance(verify, bool):
            raise TypeError(f"GGUFImporter.read: verify must be True or False, got {verify!r}")
        path = self._file(directory)
        if path is None:
            raise ValueError(f"GGUFImporter.read: {directory} is not a GGUF file (nor a directory holding one)")
        reader = checks.open_reader(path)
        hyper = checks.hyperparameters(reader, path)
        if like is not None:
            checks.check_hyperparameters(hyper, like, path)
        if verify:
            checks.check_digests(reader, path)
        try:
            config = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
        except Exception as e:  # transformers' reading of metadata we checked: still the file's fault
            raise CheckpointError(f"{path}: transformers cannot read its metadata ({type(e).__name__}: {e})") from None
        config = gguf_moe.moe_config(reader, config, path)
        if gguf_arch.arch_of(config) is None:
            raise ValueError(f"{path}: architecture {config.get('model_type')!r}: GGUF import supports "
                             f"{sorted(gguf_arch.arches())}")
        names = _gguf_to_hf(config)
        tree, notes, expert_parts = {}, {}, {}
        for t in reader.tensors:
            hf = names.get(t.name)
            if hf is None and gguf_moe.is_moe(config) and gguf_moe.is_expert_tensor(t.name):
                hf = t.name  # a 3-D expert tensor: fused into the experts' stacked weights below
            if hf is None:
                raise CheckpointError(f"{path}: tensor {t.name} has no transformers name in architecture "
                                 f"{config['model_type']}")
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists ne0 (the row) first
            kind = GGMLQuantizationType(int(t.tensor_type)).name
            if kind in gguf_tensors.IMPORT_SPECS and len(shape) == 3 and hf == t.name:  # experts: one matrix each
                raw = np.asarray(t.data).reshape(shape[0], shape[1], -1)
                leaf = qt.stacked.stack([gguf_tensors.decode_blocks(raw[e], kind, shape[1:], path=f"{t.name}[{e}]")
                                         for e in range(shape[0])])
            elif kind in gguf_tensors.IMPORT_SPECS:
                leaf = gguf_tensors.decode_blocks(np.asarray(t.data), kind, shape, path=t.name)
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
                                 f"exactly (exact: {sorted(gguf_tensors.IMPORT_SPECS)}); pass "
                                 "GGUFImporter(dequantize=True) to read it as float32")
            if hf == t.name:
                expert_parts[hf] = leaf
                continue
            if t.name.endswith("ffn_gate_inp_shexp.weight") and len(shape) == 1 and not isinstance(leaf, qt.QTensor):
                leaf = leaf.reshape(1, -1)  # llama.cpp's vector: transformers' (1, hidden) gate
            index = gguf_arch.qk_rows(hf, config, shape[0], inverse=True) if len(shape) == 2 else None
            leaf = gguf_arch.reorder_rows(leaf, index)
            tree[hf] = leaf
        tree.update(gguf_moe.fuse(expert_parts, path))
        aliases = {}
        if config.get("tie_word_embeddings") and "lm_head.weight" not in tree and "model.embed_tokens.weight" in tree:
            tree["lm_head.weight"] = tree["model.embed_tokens.weight"]
            aliases["lm_head.weight"] = "model.embed_tokens.weight"
        quantized = {p: v for p, v in tree.items() if isinstance(v, qt.QTensor) and p not in aliases}
        meta = Metadata(entries=entries_of(quantized), aliases=aliases)
        if notes:
            config["gguf_dequantized"] = notes
        return Checkpoint(path.parent, meta, tree, config)


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
    if gguf_moe.is_moe(config):
        hf += gguf_moe.hf_moe_names(config)
    return {g: p for p, g in gguf_arch.hf_names(hf, arch, blocks).items() if g is not None}

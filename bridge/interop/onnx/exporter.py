"""``--to onnx``: an ONNX model (QDQ form) that ONNX Runtime runs, from a qtransform checkpoint of a
transformers model.

The export is a directory: ``model.onnx`` (``input_ids``, ``attention_mask`` -> the first outputs the
checkpoint's transformers class returns: ``logits`` for causal and masked LMs, ``last_hidden_state``
for a base model; batch and sequence dynamic; opset 21; its tensors in ``model.onnx.data`` beside it
when they pass ONNX's 2 GB protobuf limit), ``config.json`` (the model's config, without a
``quantization_config``) and the tokenizer and generation files.

Each quantized weight is stored as its codes (int4/uint4/int8/uint8, fp8) with its scale (and zero
point) feeding a ``DequantizeLinear`` (per tensor, per channel ``axis``, or per group ``block_size``),
and each static input quantizer is a ``QuantizeLinear``/``DequantizeLinear`` pair on its layer's input
(:mod:`.graph`; what ONNX holds: :mod:`.tensors`). The codes and scales are ours bit for bit, so
ONNX Runtime decodes the very weights our model computes with; what it cannot hold exactly (float
zero points, NF4, MX, NVFP4, 2-D blocks, dynamic activations, output and key/value-cache quantizers)
is refused by tree path before anything is written. Online rotations are refused by the base class.

The model's specs ride along in the ONNX model's ``metadata_props`` (``qtransform.weights``,
``qtransform.activations``).
"""

from __future__ import annotations

from pathlib import Path

import qtransform as qt

from ...modules.experts import EXPERT_WEIGHTS
from ..base import Checkpoint, Exporter, Support, copy_extras, write_config
from . import tensors as onnx_tensors

__all__ = ["OnnxExporter", "MODEL_FILE", "DATA_FILE", "PROTOBUF_LIMIT"]

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
#: Serialized protobufs cannot pass 2 GB: larger models keep their tensors in :data:`DATA_FILE`.
PROTOBUF_LIMIT = 2 ** 31 - 2 ** 24


class OnnxExporter(Exporter):
    """``--to onnx``: see the module docstring."""

    name = "onnx"
    description = ("ONNX QDQ model (ONNX Runtime): int4/uint4/int8/uint8 and fp8 weights per tensor, channel or "
                   "group, static int8/fp8 input quantizers")

    def support(self, spec: qt.QuantSpec, role: str = "weight") -> Support:
        return onnx_tensors.judge(spec, role)

    def problems(self, source: Checkpoint, *, allow_nearest: bool = False) -> list[str]:
        out = super().problems(source, allow_nearest=allow_nearest)
        if not source.config.get("model_type"):
            return out + [f"{source.directory}: no transformers config.json (the ONNX export traces a transformers "
                          "model's forward)"]
        weights = {p.rpartition(".")[0] for p in source.tree if p.endswith(".weight")}
        for path, leaf in source.tree.items():  # transformers' experts run a grouped_mm op ONNX has no function for
            if path.rpartition(".")[2] in EXPERT_WEIGHTS and getattr(leaf, "ndim", len(leaf.shape)) == 3:
                out.append(f"{path}: mixture-of-experts weights; transformers' experts forward (grouped_mm) has no "
                           "ONNX conversion here (export to compressed-tensors or quark instead)")
        for path, entry in source.meta.entries.items():
            if entry.spec.fmt.family == "int" and onnx_tensors.judge(entry.spec).kind == "exact":
                q = source.tree.get(path)
                zp = None if q is None else q.qparams.zero_point
                if zp is not None and not zp.is_floating_point():
                    lo, hi = entry.spec.fmt.codec.qmin, entry.spec.fmt.codec.qmax
                    if int(zp.min()) < lo or int(zp.max()) > hi:
                        out.append(f"{path}: zero points outside the {entry.spec.format} code range [{lo}, {hi}]")
        for site in source.meta.activations:
            if site.role == "input" and site.module not in weights:
                out.append(f"{site.module}:{site.role}: an input quantizer on a module without a weight; the ONNX "
                           "export quantizes the inputs of linear layers")
        return out

    def write(self, source: Checkpoint, out: Path, *, allow_nearest: bool = False) -> None:
        import onnx

        from ..hf_model import float_model
        from .graph import export_float, hint, quantize_graph

        model, _ = export_float(float_model(source))
        quantize_graph(model, source)
        onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, **hint(source)})
        large = sum(len(t.raw_data) for t in model.graph.initializer) > PROTOBUF_LIMIT
        if not large:
            onnx.checker.check_model(model)
        onnx.save_model(model, str(out / MODEL_FILE), save_as_external_data=large, all_tensors_to_one_file=True,
                        location=DATA_FILE, size_threshold=1024)
        write_config(out, source.config)
        copy_extras(source, out)

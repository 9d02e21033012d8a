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

Models that are not transformers ones (a CNN, an MLP, a decoder of transposed convolutions): :func:`export_module`
exports a quantized model in memory on example inputs, and ``bridge.interop.export(ckpt, to="onnx", out=...,
like=Net, example_inputs=(x,))`` a saved checkpoint of one (``like``: the float model or a factory of it, as
:func:`bridge.load` takes it). Both trace the float model holding the dequantized weights (:mod:`.module`) with
``torch.onnx.export(dynamo=True)`` (the ``torch.export`` based exporter, torch's default since 2.9: tracing our
quantized modules themselves would decode the weights with ops ONNX has no function for, the packed CPU kernels'
``aten._weight_int8pack_mm``, or that no ``DequantizeLinear`` stands for), then rewrite the graph as above. The
batch axis is dynamic unless ``dynamic_shapes`` says otherwise. The export is ``model.onnx`` (and
``model.onnx.data``) in ``out``, written whole or not at all.

>>> import torch, qtransform as qt, bridge, tempfile, onnx
>>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(72, 4))
>>> qnet = bridge.quantize(net, qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)))
>>> out = export_module(qnet, (torch.randn(2, 3, 5, 5),), tempfile.mkdtemp() + "/net")
>>> sorted({n.op_type for n in onnx.load(str(out / MODEL_FILE)).graph.node} & {"DequantizeLinear", "Conv", "Gemm"})
['Conv', 'DequantizeLinear', 'Gemm']
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import qtransform as qt

from ...checkpoint import store
from ...modules.experts import EXPERT_WEIGHTS
from ..base import Checkpoint, Exporter, Support, copy_extras, write_config
from . import tensors as onnx_tensors
from .graph import OPSET
from .module import float_twin, like_model, module_source, refusal

__all__ = ["OnnxExporter", "export_module", "MODEL_FILE", "DATA_FILE", "PROTOBUF_LIMIT"]

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

    def problems(self, source: Checkpoint, *, allow_nearest: bool = False, like=None, opset: int = OPSET,
                 **trace) -> list[str]:
        """The base class's, the opset's (:func:`.tensors.opset_problem`) and the graph's: a transformers
        ``config.json`` unless ``like`` gives the model, zero points in range, input quantizers on layers."""
        out = super().problems(source, allow_nearest=allow_nearest)
        for path, entry in source.meta.entries.items():
            why = onnx_tensors.opset_problem(entry.spec, opset)
            out += [f"{path}: {entry.spec}: {why}"] if why else []
        for site, spec in source.meta.activations.items():
            why = onnx_tensors.opset_problem(spec, opset)
            out += [f"{site.module}:{site.role}: {spec}: {why}"] if why else []
        if like is None and not source.config.get("model_type"):
            return out + [f"{source.directory}: no transformers config.json (the ONNX export traces a transformers "
                          "model's forward; pass like= (the float model or a factory of it) and example_inputs= "
                          "to export another model)"]
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
                           "export quantizes the inputs of linear and convolution layers")
        return out

    def write(self, source: Checkpoint, out: Path, *, allow_nearest: bool = False, like=None,
              example_inputs=None, dynamic_shapes=None, opset: int = OPSET, input_names=None,
              output_names=None) -> None:
        """``source`` as ONNX in ``out``: a transformers model from its ``config.json``, or with ``like`` the
        float model ``like`` gives traced on ``example_inputs`` (see :func:`export_module`)."""
        from .graph import export_float, export_traced, quantize_graph

        if like is None:
            from ..hf_model import float_model
            model, _ = export_float(float_model(source))
            quantize_graph(model, source)
        else:
            args = _inputs(example_inputs)
            model = export_traced(like_model(like, source), args, opset=_opset(opset), input_names=input_names,
                                  output_names=output_names, dynamic_shapes=_dynamic(args, dynamic_shapes))
            quantize_graph(model, source, unused="skip")
        _save(model, source, out)
        if like is None:
            write_config(out, source.config)
            copy_extras(source, out)


def _save(model, source: Checkpoint, out: Path) -> None:
    """Save the ONNX ``model`` (checked) as :data:`MODEL_FILE` in ``out``, its specs in ``metadata_props``."""
    import onnx

    from .graph import hint

    onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, **hint(source)})
    large = sum(len(t.raw_data) for t in model.graph.initializer) > PROTOBUF_LIMIT
    if not large:
        onnx.checker.check_model(model)
    onnx.save_model(model, str(out / MODEL_FILE), save_as_external_data=large, all_tensors_to_one_file=True,
                    location=DATA_FILE, size_threshold=1024)


def _inputs(example_inputs) -> tuple:
    """``example_inputs`` as the tuple of positional arguments (a single tensor: one argument)."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)) or not example_inputs:
        raise TypeError(f"example_inputs must be a tensor or a non-empty tuple of the forward's positional "
                        f"arguments, got {type(example_inputs).__name__}")
    return tuple(example_inputs)


def _dynamic(args: tuple, dynamic_shapes):
    """``dynamic_shapes`` as given, or axis 0 of every tensor argument dynamic (one ``batch`` for all)."""
    if dynamic_shapes is not None:
        return dynamic_shapes
    batch = torch.export.Dim("batch")
    return tuple({0: batch} if isinstance(a, torch.Tensor) and a.dim() > 0 else None for a in args)


def _opset(opset) -> int:
    import onnx

    top = onnx.defs.onnx_opset_version()
    if isinstance(opset, bool) or not isinstance(opset, int) or not 18 <= opset <= top:
        raise ValueError(f"opset must be an int from 18 (torch.onnx's dynamo exporter) to {top} (the installed "
                         f"onnx), got {opset!r}")
    return opset


def export_module(qmodel: nn.Module, example_inputs, out, *, dynamic_shapes=None, opset: int = OPSET,
                  input_names=None, output_names=None, overwrite: bool = False) -> Path:
    """Export the quantized model ``qmodel`` (:func:`bridge.quantize`, :func:`bridge.load`) to an ONNX QDQ
    model, ``out/model.onnx``, that ONNX Runtime runs.

    Args:
        qmodel: any ``nn.Module`` whose quantized modules are ``QLinear``, ``QConv1d/2d/3d``,
            ``QConvTranspose1d/2d/3d`` or ``QEmbedding`` (``QEmbeddingBag`` is refused: :mod:`.module`); it is not
            changed.
        example_inputs: the forward's positional arguments (a tensor or a tuple) to trace with.
        out: the directory to write (absent or empty unless ``overwrite``); it appears whole or not at all.
        dynamic_shapes: as ``torch.export`` takes them (one entry per argument); default: axis 0 of every
            tensor argument is the dynamic ``batch`` (trace with a batch of at least 2: torch.export
            specializes size 1).
        opset: the ONNX opset (18 to the installed onnx's newest): int4/uint4 codes and per-group scales need
            21, fp8 19.
        input_names, output_names: the graph's names (default: the forward's argument names, torch's outputs).
        overwrite: replace a non-empty ``out``.

    Weights are their codes (int4/uint4/int8/uint8, fp8) with scales (and zero points) feeding a
    ``DequantizeLinear``; static input quantizers are ``QuantizeLinear``/``DequantizeLinear`` pairs with the
    stored scales and zero points, dynamic uint8 per-tensor ones ``DynamicQuantizeLinear`` +
    ``DequantizeLinear`` (see :mod:`.tensors`). What ONNX cannot express (per-token dynamic int8, MX/NVFP4,
    NF4, float zero points, output quantizers, online rotations, low-rank corrections...) is one ``ValueError``
    listing every module path and spec, before anything is written. Returns ``Path(out)``.
    """
    if not isinstance(qmodel, nn.Module):
        raise TypeError(f"export_module: qmodel must be a torch.nn.Module, got {type(qmodel).__name__}")
    args, opset = _inputs(example_inputs), _opset(opset)
    if not isinstance(overwrite, bool):
        raise TypeError(f"export_module: overwrite must be True or False, got {overwrite!r}")
    target = Path(out)
    if target.exists() and (not target.is_dir() or (any(target.iterdir()) and not overwrite)):
        raise ValueError(f"export_module: out {target} exists and is not an empty directory (pass overwrite=True)")
    source = module_source(qmodel)
    problems = OnnxExporter().problems(source, like=qmodel, opset=opset)
    owners = {p.rpartition(".")[0] for p in source.meta.entries}
    for name, m in qmodel.named_modules():
        why = refusal(m, name) if name in owners else None
        problems += [why] if why else []
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise ValueError(f"export_module: {len(problems)} item(s) of {type(qmodel).__name__} cannot be expressed "
                         f"in ONNX:\n  {shown}")
    from .graph import export_traced, quantize_graph

    model = export_traced(float_twin(qmodel), args, opset=opset, input_names=input_names, output_names=output_names,
                          dynamic_shapes=_dynamic(args, dynamic_shapes))
    quantize_graph(model, source, unused="skip")
    with store.atomic_directory(target, overwrite=overwrite) as tmp:
        _save(model, source, Path(tmp))
    return target

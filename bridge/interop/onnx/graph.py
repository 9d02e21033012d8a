"""The ONNX graph of a qtransform checkpoint: the transformers model's forward exported by
``torch.onnx.export`` (the ``torch.export`` based exporter, opset 21), then rewritten so that every
quantized weight is integer (or fp8) codes + scale (+ zero point) feeding a ``DequantizeLinear``, and
every static input quantizer is a ``QuantizeLinear``/``DequantizeLinear`` pair before its layer's
``MatMul``/``Gemm``/``Conv``/``ConvTranspose`` (a dynamic one ``DynamicQuantizeLinear`` + ``DequantizeLinear``).
:func:`export_float` traces a transformers model on ``input_ids``/``attention_mask``; :func:`export_traced` any
float model on the example inputs given (:func:`bridge.interop.onnx.export_module`).

The float model is built from ``config.json`` and loaded with the checkpoint's tensors (quantized
ones dequantized: only to trace the forward; their float values are dropped from the graph). The
exporter runs unoptimized so that the initializers keep the state-dict names (the tree paths); a
``Linear`` weight then feeds a ``Transpose`` (constant-folded by ONNX Runtime), so each weight's
``DequantizeLinear`` decodes the tensor exactly as the tree stores it: same axis, same blocks.

The graph computes in float32 (ONNX Runtime's CPU kernels): float16/bfloat16 weights are widened
(exact), and a quantized weight of a 16-bit model is rounded to its dtype after decoding
(``Cast`` there and back), as our ``dequantize`` rounds it.
"""

from __future__ import annotations

import json
from typing import Mapping

import torch

import qtransform as qt

from ...modules.actquant import PREFIX
from ..base import Checkpoint
from .tensors import Parts, activation_parts, weight_parts

__all__ = ["OPSET", "export_float", "export_traced", "quantize_graph"]

#: The ONNX opset the export targets (blocked DequantizeLinear, int4/uint4 element types).
OPSET = 21
#: Nodes between a weight initializer and the layer that multiplies it.
_PASS = ("Transpose", "Reshape", "Cast", "Identity", "Unsqueeze", "Squeeze")
_COMPUTE = ("MatMul", "Gemm")
#: Nodes whose input 1 is the weight and input 0 the activation.
_CONV = ("Conv", "ConvTranspose")


def export_float(model: torch.nn.Module):
    """``(onnx.ModelProto, output names)`` of ``model(input_ids, attention_mask)`` (batch and sequence
    dynamic), its initializers named by the state dict (the key/value cache is not part of the graph).
    ``ValueError`` naming the model's class when its forward needs other inputs (pixel values, a robot's
    state...) or ``torch.onnx.export`` cannot convert it (data-dependent control flow, ops without an ONNX
    function): the export is refused, nothing written."""
    _no_cache(model)
    vocab = int(getattr(model.config, "vocab_size", 2) or 2)
    ids = (torch.arange(16).reshape(2, 8) * 7) % vocab
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    try:
        with torch.no_grad():
            out = model(**kwargs)
    except Exception as e:  # noqa: BLE001  (the model's own code: whatever it raises without its other inputs)
        raise ValueError(f"{type(model).__name__}: its forward on input_ids and attention_mask alone fails "
                         f"({type(e).__name__}: {_first_line(e)}); the ONNX graph has no other inputs") from e
    names = [k for k, v in out.items() if isinstance(v, torch.Tensor)]
    dims = {0: "batch", 1: "sequence"}
    try:
        program = torch.onnx.export(model, (), kwargs=kwargs, dynamo=True, optimize=False, opset_version=OPSET,
                                    input_names=list(kwargs), output_names=names, verbose=False,
                                    dynamic_shapes={k: dims for k in kwargs})
    except torch.onnx.OnnxExporterError as e:
        raise ValueError(f"{type(model).__name__}: torch.onnx.export cannot convert its forward ({type(e).__name__}: "
                         f"{_first_line(e)}); export to compressed-tensors or quark instead") from e
    return program.model_proto, names


def export_traced(model: torch.nn.Module, args: tuple, *, dynamic_shapes=None, opset: int = OPSET,
                  input_names=None, output_names=None):
    """``onnx.ModelProto`` of ``model(*args)`` traced by ``torch.onnx.export`` (the ``torch.export`` based
    exporter, unoptimized so that the initializers keep the state-dict names), ``dynamic_shapes`` as
    ``torch.export`` takes them. ``ValueError`` naming the model's class when its forward fails on ``args`` or
    cannot be converted (data-dependent control flow, ops without an ONNX function)."""
    try:
        with torch.no_grad():
            model(*args)
    except Exception as e:  # noqa: BLE001  (the model's own code)
        raise ValueError(f"{type(model).__name__}: its forward on example_inputs fails ({type(e).__name__}: "
                         f"{_first_line(e)})") from e
    try:
        program = torch.onnx.export(model, args, dynamo=True, optimize=False, opset_version=opset, verbose=False,
                                    input_names=input_names, output_names=output_names,
                                    dynamic_shapes=dynamic_shapes)
    except Exception as e:  # noqa: BLE001  (torch.export's and the converter's errors alike)
        raise ValueError(f"{type(model).__name__}: torch.onnx.export cannot convert its forward ({type(e).__name__}: "
                         f"{_first_line(e)})") from e
    return program.model_proto


def _first_line(e: BaseException) -> str:
    """What went wrong, in one line: the summary of a ``torch.onnx`` error (after its advice), else the first line."""
    text = str(e)
    if "## Exception summary" in text:
        text = text.split("## Exception summary", 1)[1]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[0] if lines else type(e).__name__)[:300]


def _no_cache(model: torch.nn.Module) -> None:
    """``use_cache = False`` in every config the model's modules read (a vision-language model's text config
    too: its language model returns a cache object, no tensor, otherwise)."""
    from transformers import PretrainedConfig

    todo = [model.config] + [m.config for m in model.modules() if isinstance(getattr(m, "config", None),
                                                                                 PretrainedConfig)]
    seen: list = []
    while todo:
        config = todo.pop()
        if any(config is c for c in seen):
            continue
        seen.append(config)
        config.use_cache = False
        todo += [v for v in vars(config).values() if isinstance(v, PretrainedConfig)]


# ---------------------------------------------------------------------------------------------- rewriting
def _tensor(name: str, onnx_type: str, array):
    """A TensorProto of ``array`` (numpy, the storage dtype) as ``onnx_type``."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    dt = getattr(TensorProto, onnx_type)
    if onnx_type in ("INT4", "UINT4"):  # two to a byte, the first in the low nibble, over the flattened tensor
        flat = array.reshape(-1).astype(np.uint8) & 15
        if flat.size % 2:
            flat = np.concatenate([flat, np.zeros(1, np.uint8)])
        return helper.make_tensor(name, dt, array.shape, (flat[0::2] | (flat[1::2] << 4)).tobytes(), raw=True)
    if onnx_type.startswith("FLOAT8") or onnx_type == "BFLOAT16":
        return helper.make_tensor(name, dt, array.shape, np.array(array, order="C").tobytes(), raw=True)
    return numpy_helper.from_array(np.array(array, order="C"), name)


def _scale_nodes(parts: Parts, stem: str, inits: list, nodes: list) -> str:
    """Add the scale initializer (and a Cast to float32 for 16-bit scales); the float32 scale's name."""
    from onnx import TensorProto, helper

    kind = {"float32": "FLOAT", "float16": "FLOAT16", "bfloat16": "BFLOAT16"}[parts.scale_dtype]
    inits.append(_tensor(f"{stem}_scale", kind, parts.scale))
    if kind == "FLOAT":
        return f"{stem}_scale"
    nodes.append(helper.make_node("Cast", [f"{stem}_scale"], [f"{stem}_scale_f32"], to=TensorProto.FLOAT,
                                  name=f"{stem}_scale_cast"))
    return f"{stem}_scale_f32"


def _dq_inputs(parts: Parts, stem: str, inits: list, nodes: list) -> tuple[list[str], dict]:
    scale = _scale_nodes(parts, stem, inits, nodes)
    names = [f"{stem}_quantized", scale]
    if parts.zero_point is not None:
        inits.append(_tensor(f"{stem}_zero_point", parts.onnx_type, parts.zero_point))
        names.append(f"{stem}_zero_point")
    attrs = {} if parts.axis is None else {"axis": parts.axis}
    if parts.block_size is not None:
        attrs["block_size"] = parts.block_size
    return names, attrs


def _weight_nodes(path: str, q: qt.QTensor) -> tuple[list, list]:
    """Initializers and nodes producing the float32 tensor ``path`` from ``q``'s codes."""
    from onnx import TensorProto, helper

    parts = weight_parts(q, path)
    inits, nodes = [_tensor(f"{path}_quantized", parts.onnx_type, parts.codes)], []
    inputs, attrs = _dq_inputs(parts, path, inits, nodes)
    rounded = q.dtype in (torch.float16, torch.bfloat16)
    out = f"{path}_dequantized" if rounded else path
    nodes.append(helper.make_node("DequantizeLinear", inputs, [out], name=f"{path}_dequantize", **attrs))
    if rounded:  # our dequantize rounds the float32 product to the weight's dtype
        to = TensorProto.FLOAT16 if q.dtype == torch.float16 else TensorProto.BFLOAT16
        nodes.append(helper.make_node("Cast", [out], [f"{path}_rounded"], to=to, name=f"{path}_round"))
        nodes.append(helper.make_node("Cast", [f"{path}_rounded"], [path], to=TensorProto.FLOAT, name=f"{path}_widen"))
    return inits, nodes


def _same(a: qt.QTensor, b: qt.QTensor) -> bool:
    ta, tb = a.qparams.tensors(), b.qparams.tensors()
    return (a.spec, a.shape, a.dtype) == (b.spec, b.shape, b.dtype) and torch.equal(a.codes, b.codes) and \
        ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def _consumer(nodes: list, weight: str, where: str):
    """The MatMul/Gemm node of ``nodes`` that multiplies the initializer ``weight`` (through Transposes
    and the like) and the index of its other (activation) input."""
    users: dict[str, list] = {}
    for node in nodes:
        for name in node.input:
            users.setdefault(name, []).append(node)
    frontier, seen = [weight], set()
    while frontier:
        name = frontier.pop()
        for node in users.get(name, []):
            if node.op_type in _COMPUTE and list(node.input).index(name) in (0, 1):
                return node, 1 - list(node.input).index(name)
            if node.op_type in _CONV and list(node.input).index(name) == 1:
                return node, 0
            if node.op_type in _PASS and id(node) not in seen:
                seen.add(id(node))
                frontier.extend(node.output)
    raise ValueError(f"{where}: no MatMul/Gemm/Conv/ConvTranspose taking {weight} in the exported graph (the ONNX "
                     "export quantizes the inputs of linear and convolution layers)")


def quantize_graph(model, source: Checkpoint, *, unused: str = "error") -> None:
    """Rewrite the float ``model`` (an ``onnx.ModelProto`` from :func:`export_float` or :func:`export_traced`) in
    place: quantized weights as ``DequantizeLinear`` of their codes, static input quantizers as Q/DQ pairs,
    dynamic ones as ``DynamicQuantizeLinear`` + ``DequantizeLinear``. ``ValueError`` naming the tree path when
    the graph has no place for one; a quantized weight the traced forward never reads (a module it does not
    call) too, unless ``unused="skip"`` (then it and its input quantizer are left out)."""
    from onnx import NodeProto, helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    new_inits, new_nodes, drop = [], [], set()
    for path in source.meta.entries:
        q = source.tree[path]
        t = inits.get(path)
        if t is None and any(o in inits and _same(source.tree[o], q) for o in source.meta.entries):
            continue  # tied: the graph holds one copy, under the other path
        if t is None and unused == "skip":
            drop.add(path)
            continue
        if t is None:
            raise ValueError(f"{path}: not an initializer of the exported graph (a tied weight quantized unlike "
                             "its twin, or one the forward does not use)")
        if tuple(t.dims) != tuple(q.shape):
            raise ValueError(f"{path}: the graph holds it with shape {tuple(t.dims)}, the checkpoint {tuple(q.shape)}")
        i, n = _weight_nodes(path, q)
        new_inits += i
        new_nodes += n
        drop.add(path)
    kept = [t for t in graph.initializer if t.name not in drop]
    del graph.initializer[:]
    graph.initializer.extend(kept + new_inits)
    inputs = [v for v in graph.input if v.name not in drop]
    del graph.input[:]
    graph.input.extend(inputs)
    nodes = new_nodes
    for old in graph.node:  # copies: the graph's own node list is replaced at the end
        nodes.append(NodeProto())
        nodes[-1].CopyFrom(old)
    skipped = {p for p in drop if p not in inits}
    for site, spec in source.meta.activations.items():
        where = f"{site.module}:{site.role}"
        stem = f"{site.module}.{PREFIX[site.role]}"
        if f"{site.module}.weight" in skipped:
            continue
        if spec.dynamic:
            node, k = _consumer(nodes, f"{site.module}.weight", where)
            names = [f"{stem}quantized", f"{stem}scale", f"{stem}zero_point"]
            q_nodes = [helper.make_node("DynamicQuantizeLinear", [node.input[k]], names, name=f"{stem}quantize"),
                       helper.make_node("DequantizeLinear", names, [f"{stem}dequantized"], name=f"{stem}dequantize")]
            node.input[k] = f"{stem}dequantized"
            at = next(j for j, n in enumerate(nodes) if n is node)
            nodes[at:at] = q_nodes
            continue
        parts = activation_parts({f: source.tree.get(stem + f) for f in qt.QParams.FIELDS}, spec, where)
        node, k = _consumer(nodes, f"{site.module}.weight", where)
        x = node.input[k]
        q_inits, q_nodes = [], []
        names, attrs = _dq_inputs(parts, stem.rstrip("_"), q_inits, q_nodes)
        scale_zp = names[1:]
        qattrs = dict(attrs, **({"saturate": int(spec.saturate)} if parts.onnx_type.startswith("FLOAT8") else {}))
        q_nodes.append(helper.make_node("QuantizeLinear", [x, *scale_zp], [names[0]], name=f"{stem}quantize", **qattrs))
        q_nodes.append(helper.make_node("DequantizeLinear", names, [f"{stem}dequantized"], name=f"{stem}dequantize",
                                        **attrs))
        node.input[k] = f"{stem}dequantized"
        graph.initializer.extend(q_inits)
        at = next(j for j, n in enumerate(nodes) if n is node)
        nodes[at:at] = q_nodes
    del graph.node[:]
    graph.node.extend(nodes)


def hint(source: Checkpoint) -> Mapping[str, str]:
    """``metadata_props`` the export carries: the specs per tree path and activation site (JSON)."""
    return {"qtransform.weights": json.dumps({p: str(e.spec) for p, e in source.meta.entries.items()}),
            "qtransform.activations": json.dumps({f"{s.module}:{s.role}": str(spec)
                                                  for s, spec in source.meta.activations.items()})}

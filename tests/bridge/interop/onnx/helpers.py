"""Helpers of the ONNX export tests: tiny models quantized, saved and exported, and ONNX Runtime run on
the exports in a clean interpreter that never imports ``bridge`` or ``qtransform``."""

import json
import subprocess
import sys

import numpy as np
import torch
from interop.compressed_tensors.helpers import batches, tiny
from interop.quark.helpers import ENV

import bridge
import qtransform as qt
from bridge import interop

IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
#: ONNX Runtime's CPU defaults rewrite QDQ graphs into kernels that compute otherwise: an 8-bit
#: DequantizeLinear -> MatMul becomes MatMulNBits with int8 activations (accuracy level 4), and a
#: Q/DQ'd MatMul becomes MatMulIntegerToFloat, whose u8s8 products saturate on AVX2 machines without
#: VNNI. These session settings keep the graph's own float32 semantics.
EXACT = {"session.qdq_matmulnbits_accuracy_level": "1", "session.disable_quant_qdq": "1"}
#: ... and its ReluQuantRewrite drops a ReLU that feeds a QuantizeLinear with a zero point of 0 as if the
#: quantizer clamped at 0, which fp8's does not (OPT's fc2 input): turned off too.
DISABLED = ["ReluQuantRewrite"]

# ONNX Runtime alone: every case's outputs (and sub-graphs' outputs), or the error it met
_RUN = r"""
import json, sys
import numpy as np, onnx, onnxruntime as ort
from onnx import helper, TensorProto

def piece(model, x, y):
    # the nodes computing y from x (or from initializers only), as a model of their own
    all_nodes = list(model.graph.node)
    producers = {o: i for i, n in enumerate(all_nodes) for o in n.output}
    inits = {t.name: t for t in model.graph.initializer}
    nodes, used, todo = {}, [], [y]
    while todo:
        name = todo.pop()
        if name in (x, "") or name in used:
            continue
        used.append(name)
        if name in inits:
            continue
        i = producers[name]
        nodes[i] = all_nodes[i]
        todo.extend(all_nodes[i].input)
    graph = helper.make_graph([nodes[i] for i in sorted(nodes)], "piece",
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)] if x else [],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, None)],
                              initializer=[inits[u] for u in used if u in inits])
    return helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)

cases, out = json.load(open(sys.argv[1])), {}
for name, c in cases.items():
    try:
        so = ort.SessionOptions()
        for k, v in c["options"].items():
            so.add_session_config_entry(k, v)
        s = ort.InferenceSession(c["model"], so, providers=["CPUExecutionProvider"], disabled_optimizers=c["disabled"])
        ids = np.load(c["ids"])
        got = s.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
        out[name] = got[0]
        out[name + ":outputs"] = np.array([o.name for o in s.get_outputs()])
        for i, (x, y, data) in enumerate(c.get("pieces", [])):
            sub = piece(onnx.load(c["model"]), x, y)
            feed = {x: np.load(data)} if x else {}
            out[f"{name}:piece{i}"] = ort.InferenceSession(sub.SerializeToString()).run(None, feed)[0]
    except Exception as e:
        out[name + ":error"] = np.array(f"{type(e).__name__}: {e}")
assert not [m for m in sys.modules if m.split(".")[0] in ("bridge", "qtransform", "torch")], "bridge was imported"
np.savez(sys.argv[2], **out)
"""


def run_onnx(cases: dict, tmp_path) -> dict:
    """``{name: logits, name + ":piece<i>": ...}`` (or ``name + ":error"``) for ``{name: {"model", "ids",
    "options", "disabled", "pieces"}}`` (``ids`` a tensor; ``pieces``: ``[(input name, output name, input tensor)]``,
    sub-graphs extracted and run on their own; input name ``""`` and tensor ``None`` for a constant one)."""
    spec = {}
    for name, c in cases.items():
        np.save(tmp_path / f"{name}.ids.npy", c["ids"].numpy())
        pieces = []
        for i, (x, y, data) in enumerate(c.get("pieces", [])):
            if data is not None:
                np.save(tmp_path / f"{name}.piece{i}.npy", data.numpy())
            pieces.append([x, y, str(tmp_path / f"{name}.piece{i}.npy")])
        spec[name] = {"model": str(c["model"]), "ids": str(tmp_path / f"{name}.ids.npy"),
                      "options": c.get("options", {}), "disabled": c.get("disabled", []), "pieces": pieces}
    (tmp_path / "cases.json").write_text(json.dumps(spec))
    res = subprocess.run([sys.executable, "-c", _RUN, str(tmp_path / "cases.json"), str(tmp_path / "out.npz")],
                         capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    with np.load(tmp_path / "out.npz") as f:
        return {k: f[k] for k in f.files}


def quantize_export(arch, recipe, tmp_path, *, calib=False):
    """``(float model, quantized model, checkpoint dir, export dir)``: a tiny ``arch`` (its config naming its
    class; or a model) quantized with ``recipe`` (a Recipe or a preset name), saved and exported to ONNX."""
    model = tiny(arch) if isinstance(arch, str) else arch
    arch = arch if isinstance(arch, str) else type(arch).__name__
    recipe = qt.get_preset(recipe).recipe if isinstance(recipe, str) else recipe
    qmodel = bridge.quantize(model, recipe, calibration=batches() if calib else None)
    ckpt, out = tmp_path / f"{arch}-ckpt", tmp_path / f"{arch}-onnx"
    bridge.save(qmodel, ckpt)
    interop.export(ckpt, to="onnx", out=out)
    return model, qmodel, ckpt, out


def dequant_kernel(qmodel):
    """``qmodel`` computing with its dequantized weights in float32 (as the ONNX graph does)."""
    for m in qmodel.modules():
        if isinstance(m, bridge.QModule):
            m.kernel = "dequant"
    return qmodel


def outputs(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids))[0]

"""The checks of the export walk (:mod:`.test_every_export`): an export read back by its format's importer, or run by
ONNX Runtime, compared with the qtransform checkpoint it was written from. Each raises ``AssertionError`` on a
failure; the expected values are the checkpoint's own (read by :func:`bridge.interop.read_source`) and the quantized
model's logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import qtransform as qt
from bridge import interop
from bridge.interop.base import read_imported
from bridge.app.imported import load_imported

from .walk_checks import close, same_trees

#: ONNX Runtime's CPU rewrites that compute a QDQ graph otherwise than its float32 semantics
#: (tests/bridge/interop/onnx/helpers.py says why)
_ORT_EXACT = {"session.qdq_matmulnbits_accuracy_level": "1", "session.disable_quant_qdq": "1"}


def refusal_names(message: str, model, directories, named) -> bool:
    """Whether a refusal names a tensor or module path, the model class or the model type (``named`` of
    :mod:`.walk_checks`), once the directories it mentions (whose names hold the test's name) are taken out."""
    for d in directories:
        message = message.replace(str(d), "<dir>")
    return named(message, model, getattr(model.config, "model_type", ""))


def _value(leaf):
    return qt.dequantize(leaf) if isinstance(leaf, qt.QTensor) else leaf


def same_import(fmt: str, out: Path, ckpt: Path) -> None:
    """The export read back by ``IMPORTERS[fmt]`` is the checkpoint: the same paths, each QTensor dequantizing to
    the same values, each float tensor equal, the same carried tensors."""
    got, want = read_imported(fmt, out), interop.read_source(ckpt)
    same_trees(got.tree, want.tree)
    assert sorted(got.carried) == sorted(want.carried)
    assert all(torch.equal(got.carried[n], want.carried[n]) for n in want.carried)


def near_import(fmt: str, out: Path, ckpt: Path, bound: float = 0.25) -> float:
    """An export written with ``allow_nearest`` read back: the same paths, float tensors equal, each quantized
    tensor within relative RMS ``bound`` of ours (the nearest format re-quantizes our values). Returns the worst."""
    got, want = read_imported(fmt, out).tree, interop.read_source(ckpt).tree
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))[:5]
    worst = 0.0
    for p, leaf in want.items():
        a, b = _value(got[p]).float(), _value(leaf).float()
        if not isinstance(leaf, qt.QTensor):
            assert torch.equal(a, b), p
            continue
        err = float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-12))
        assert err <= bound, f"{p}: relative RMS {err:.3f} from ours"
        worst = max(worst, err)
    return worst


def imported_logits(out: Path, ids: torch.Tensor, attn: str | None = None) -> torch.Tensor:
    """The logits of the export loaded by ``load_imported`` (the model its own config describes), with the
    attention implementation ``attn`` (PaliGemma's sdpa and eager differ on a text-only batch)."""
    model = load_imported(out, kernel="dequant")
    if attn is not None:
        model.set_attn_implementation(attn)
    torch.manual_seed(0)
    with torch.no_grad():
        return model(input_ids=ids).logits


def _quantized_paths(ckpt: Path) -> dict:
    src = interop.read_source(ckpt)
    return {p: v for p, v in src.tree.items() if isinstance(v, qt.QTensor)}


def _twin(path: str, q: qt.QTensor, produced: dict, tree: dict) -> str | None:
    """A path the graph computes holding the very codes and scales of ``q`` (tied weights are one copy)."""
    for o in produced:
        v = tree[o]
        if v.shape == q.shape and torch.equal(v.codes, q.codes) and torch.equal(v.qparams.scale, q.qparams.scale):
            return o
    return None


def onnx_run(out: Path, ckpt: Path, ids: torch.Tensor) -> tuple[dict, np.ndarray]:
    """ONNX Runtime on the export: ``({path: dequantized weight}, logits)``; every quantized weight of the
    checkpoint is computed by the graph (itself or, tied, its twin) and made an output of it."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    model = onnx.load(str(out / "model.onnx"))
    computed = {o for n in model.graph.node for o in n.output}
    tree = _quantized_paths(ckpt)
    produced = {p: q for p, q in tree.items() if p in computed}
    orphans = [p for p, q in tree.items() if p not in produced and _twin(p, q, produced, tree) is None]
    assert not orphans, f"quantized weights the graph does not compute: {orphans[:5]}"
    model.graph.output.extend(helper.make_tensor_value_info(p, TensorProto.FLOAT, None) for p in produced)
    so = ort.SessionOptions()
    for k, v in _ORT_EXACT.items():
        so.add_session_config_entry(k, v)
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"],
                             disabled_optimizers=["ReluQuantRewrite"])
    names = [o.name for o in s.get_outputs()]
    res = dict(zip(names, s.run(None, {"input_ids": ids.numpy(), "attention_mask": np.ones_like(ids.numpy())})))
    return {p: res[p] for p in produced}, res[names[0]]


def same_onnx(out: Path, ckpt: Path, ids: torch.Tensor, want: torch.Tensor | None) -> None:
    """ONNX Runtime decodes every quantized weight to our dequantized values bit for bit and, where the model has
    a text forward (``want``: the quantized model's logits), gives its logits (float32 noise)."""
    tree = _quantized_paths(ckpt)
    weights, logits = onnx_run(out, ckpt, ids)
    differ = [p for p, w in weights.items() if not torch.equal(torch.from_numpy(w), qt.dequantize(tree[p]).float())]
    assert not differ, f"{len(differ)} weights ONNX Runtime decodes otherwise: {differ[:5]}"
    if want is not None:
        close(torch.from_numpy(logits), want)

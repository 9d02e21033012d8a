"""The float models the ONNX export traces, for models that are not transformers ones, and the
:class:`~bridge.interop.Checkpoint` view of a quantized model in memory.

The export traces a *float* model whose quantized weights are their dequantized values (float32), so that
``torch.onnx.export`` sees ``nn.Conv2d``, ``nn.Linear``, ``nn.Embedding``... with initializers named by the
state dict; :func:`~bridge.interop.onnx.graph.quantize_graph` then replaces each such initializer by the
``DequantizeLinear`` of our codes and puts the activation quantizers before the layers. Two ways to get it:

* :func:`float_twin`: a copy of a quantized model (:func:`bridge.quantize`) with each quantized module replaced by
  the float module it came from, holding ``dequantize(qweight)``; :func:`module_source` is that model's tree and
  quantization metadata, as a checkpoint of it would hold them;
* :func:`like_model`: a checkpoint's tree (quantized tensors dequantized) loaded into a copy of ``like``, the
  float model (or a zero-argument callable building it), as :func:`bridge.load` takes it.

Quantized classes: ``QLinear`` (``nn.Linear``; transformers' ``Conv1D`` when ``transposed``), ``QConv1d/2d/3d``,
``QConvTranspose1d/2d/3d``, ``QEmbedding``; any other is refused by module path (:func:`refusal`). ``QEmbeddingBag``
is refused: torch.onnx's unoptimized ``embedding_bag`` graph (a ``Loop`` over the bags; the export must stay
unoptimized to keep the state-dict names) crashes ONNX Runtime 1.32 as it loads it, the float model's alone.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

import qtransform as qt

from ...checkpoint.metadata import Metadata, entries_of
from ...io_parts import model_of
from ...modules import CONV_CLASSES, QEmbedding, QEmbeddingBag, QLinear, QModule
from ...modules.actquant import activation_specs
from ...modules.online import online_rotations
from ...step_outputs import read_outputs, records
from ...tree import extract
from ..base import Checkpoint
from ..hf_model import model_paths

__all__ = ["float_twin", "module_source", "like_model", "refusal", "FLOAT_CLASSES"]

#: The float class each quantized class came from (``QLinear`` by ``transposed``).
FLOAT_CLASSES = {**{q: f for f, q in CONV_CLASSES.items()}, QLinear: nn.Linear, QEmbedding: nn.Embedding}
_BAG = ("torch.onnx's unoptimized embedding_bag graph (a Loop over the bags) crashes ONNX Runtime 1.32 when it "
        "loads it; keep the EmbeddingBag in float (exclude it from the recipe) or use an Embedding and a reduction")


def refusal(module: nn.Module, where: str) -> str | None:
    """Why the ONNX export cannot trace the quantized (or float) ``module`` at ``where``; ``None``: it can."""
    if isinstance(module, (QEmbeddingBag, nn.EmbeddingBag)):
        return f"{where}: a quantized {type(module).__name__}: {_BAG}"
    if isinstance(module, QModule) and type(module) not in FLOAT_CLASSES:
        return (f"{where}: a {type(module).__name__}, which the ONNX export cannot trace (it exports "
                f"{', '.join(sorted(c.__name__ for c in FLOAT_CLASSES))})")
    return None


def _float_module(m: QModule, where: str) -> nn.Module:
    """The float module ``m`` came from, with the float32 ``dequantize(m.qweight)`` and ``m``'s bias."""
    why = refusal(m, where)
    if why:
        raise ValueError(why)
    cls = FLOAT_CLASSES[type(m)]
    bias = getattr(m, "bias", None)
    with torch.device("meta"):
        if cls is nn.Linear and m.transposed:
            from transformers.pytorch_utils import Conv1D
            new = Conv1D(m.out_features, m.in_features)
        elif cls is nn.Linear:
            new = nn.Linear(m.in_features, m.out_features, bias=bias is not None)
        else:
            kw = {k: getattr(m, k) for k in m._HYPER}
            new = cls(**kw, **({"bias": bias is not None} if cls in CONV_CLASSES else {}))
    new.weight = nn.Parameter(qt.dequantize(m.qweight, dtype=torch.float32), requires_grad=False)
    if "bias" in new._parameters:
        new.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.float32), requires_grad=False)
    return new.train(m.training)


def float_twin(qmodel: nn.Module) -> nn.Module:
    """A float32 copy of ``qmodel`` (in eval mode) with every quantized module replaced by its float module
    holding the dequantized weight; ``qmodel`` is untouched. ``ValueError`` naming the module path of a
    quantized module no float module stands for (``QExperts``...)."""
    twin = copy.deepcopy(qmodel)
    for name, m in list(twin.named_modules()):
        if isinstance(m, QModule):
            if not name:
                raise ValueError("qmodel: the model itself is a quantized module; wrap it in a container "
                                 "(torch.nn.Sequential(qmodule))")
            owner, _, leaf = name.rpartition(".")
            twin.get_submodule(owner).register_module(leaf, _float_module(m, name))
    return twin.float().eval()


def module_source(qmodel: nn.Module) -> Checkpoint:
    """``qmodel``'s tree and quantization metadata as a :class:`~bridge.interop.Checkpoint` (what
    ``bridge.save`` would write, read back): quantized weights, activation specs and static scales, online
    rotations and step outputs (which the exporter's checks then refuse by path)."""
    tree = extract(qmodel)
    meta = Metadata(entries=entries_of({p: q for p, q in tree.items() if isinstance(q, qt.QTensor)}),
                    activations=activation_specs(qmodel), online=online_rotations(qmodel),
                    outputs=records(read_outputs(qmodel)))
    return Checkpoint(Path(f"<{type(qmodel).__name__}>"), meta, tree, {})


def like_model(like, source: Checkpoint) -> nn.Module:
    """A float32 copy of the float model ``like`` (a module, left untouched, or a zero-argument callable that
    builds one) loaded with ``source``'s tree (quantized tensors dequantized; activation scales left out).
    ``ValueError`` naming the checkpoint and the tensors the model lacks, does not take, or holds with
    another shape."""
    model = model_of(like)
    model = copy.deepcopy(model) if model is like else model
    if any(isinstance(m, QModule) for m in model.modules()):
        raise ValueError(f"like: {type(model).__name__} holds quantized modules; pass the float model (or a "
                         "factory of it), as bridge.load takes it")
    for path in source.meta.entries:
        owner = path.rpartition(".")[0]
        why = refusal(model.get_submodule(owner), owner) if owner else None
        if why:
            raise ValueError(f"{source.directory}: {why}")
    state, want = {}, model.state_dict()
    for p in model_paths(source):
        leaf = source.tree[p]
        t = qt.dequantize(leaf, dtype=torch.float32) if qt.is_qtensor(leaf) else leaf
        if p in want and tuple(want[p].shape) != tuple(t.shape):
            raise ValueError(f"{source.directory}: tensor {p!r} has shape {list(t.shape)}, like's "
                             f"{type(model).__name__} has {list(want[p].shape)}")
        state[p] = t.to(torch.float32) if t.is_floating_point() else t
    result = model.load_state_dict(state, strict=False)
    missing = sorted(k for k in result.missing_keys if k not in source.meta.aliases)
    if missing or result.unexpected_keys:
        raise ValueError(f"{source.directory}: like's {type(model).__name__} does not fit the checkpoint: "
                         f"{len(missing)} tensor(s) without a value {missing[:5]}, {len(result.unexpected_keys)} "
                         f"the model does not have {sorted(result.unexpected_keys)[:5]}")
    return model.float().eval()

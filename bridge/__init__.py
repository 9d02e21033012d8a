"""The PyTorch bridge: the only part of qtransform that knows ``nn.Module``, files and transformers.

>>> import torch, qtransform as qt, bridge
>>> model = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
>>> qmodel = bridge.quantize(model, qt.QuantSpec(format="int4", granularity=qt.PerGroup(64)))
>>> qmodel[0]
QLinear(in_features=256, out_features=64, bias=True, weight=int4 g64 sym [4.500 bits/element], kernel=int4pack_cpu)
>>> qmodel(torch.randn(2, 256)).shape
torch.Size([2, 16])

Packages follow the data flow (docs/layout.md lists them with the core's):

- ``tree``: extract (module -> tree) and to_module (tree -> modules), rebuild hooks.
- ``arch``: model-family tables (blocks, which norm or linear feeds which linears), resolved by
  ``plan`` into the plan's smoothing groups and residual layout.
- ``calibrate``: forward passes with hooks folding site statistics, the block-by-block runner,
  the model's loss (``ModelCalibrator``).
- ``pipeline``: ``plan``, ``quantize_params``, ``quantize``: the one pipeline for models.
- ``modules``: ``QLinear`` & co., activation quantizers, the key/value cache, online rotations.
- ``kernels``: forward paths chosen by device, shape and capability (packed CPU int4/int8, GPU fp8,
  the dequantizing reference).
- ``fx``: graph preparation for models that are not language models: ``fold_batchnorm`` (BatchNorm folded
  into the conv/linear before it, before quantizing).
- ``checkpoint``: files without modules: the atomic, checksummed store, layouts, versioned metadata.
- ``io``: ``save`` / ``load`` of models.
- ``qat``: quantization-aware training in the user's own loop: ``prepare`` (trainable fake quantizers),
  ``convert`` (the exact quantized model), ``distill_loss`` (imported on use: ``from bridge import qat``).
- ``hf``: transformers' quantizer and config, dequantize, offloading, peft (a leaf).
- ``interop``: other ecosystems' formats, one package per target with its exporter and importer:
  ``quark``, ``compressed_tensors``, ``gguf``, ``onnx``.
- ``app``: the ``qtransform`` command, offline models, corpora, evaluation, reports.

Importing ``bridge`` registers ``quant_method: "qtransform"`` with transformers.
"""

import contextlib as _contextlib
import logging as _logging


@_contextlib.contextmanager
def _quiet_imports(names=("torchao", "torch.utils._pytree")):
    """Registering with transformers imports its quantizers, and with them torchao when it is
    installed, which logs warnings about its GPU kernels and deprecated pytree enums on a CPU
    machine: noise for our users, silenced for the duration of that import only."""
    loggers = [_logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(_logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


with _quiet_imports():
    from .modules import (QConv1d, QConv2d, QConv3d, QConvTranspose1d, QConvTranspose2d, QConvTranspose3d,
                          QEmbedding, QEmbeddingBag, QExperts, QLinear, QModule)
    from .tree import extract, module_types, to_module
    from .calibrate import ModelCalibrator
    from .pipeline import Quantized, plan, quantize, quantize_params
    from .checkpoint import CheckpointError, load_tree, read_metadata
    from .io import load, save
    from .fx import BatchNormFolding, fold_batchnorm
    from .hf import QTransformConfig, QTransformHfQuantizer

__all__ = ["extract", "module_types", "to_module", "plan", "quantize", "quantize_params", "Quantized",
           "ModelCalibrator", "save", "load", "load_tree", "read_metadata", "CheckpointError",
           "QTransformConfig", "QTransformHfQuantizer",
           "QModule", "QLinear", "QConv1d", "QConv2d", "QConv3d", "QConvTranspose1d", "QConvTranspose2d",
           "QConvTranspose3d", "QEmbedding", "QEmbeddingBag",
           "QExperts", "fold_batchnorm", "BatchNormFolding"]

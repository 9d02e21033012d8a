"""Other tools' checkpoints (Quark's HF format, compressed-tensors, GGUF files) as transformers models
with our quantized modules, built from the checkpoint's own config: no ``like`` model needed.

The quantized tensors are the importer's (:data:`bridge.interop.IMPORTERS`), as stored: never
re-quantized. This is what ``qtransform eval --model``, ``inspect`` and ``quantize --model`` use
for such directories, so they need neither amd-quark nor compressed-tensors' own modules.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import interop
from ..interop.hf_model import float_model, model_paths, transformers_model
from ..io import from_source, imported_format

__all__ = ["load_imported"]


def load_imported(path, *, dtype: torch.dtype = torch.float32, kernel: str = "auto",
                  dequantize: bool = False, importer: str | None = None) -> nn.Module:
    """The model of another tool's checkpoint at ``path`` (a directory, or a ``.gguf`` file) with our
    quantized modules holding its tensors as stored; with ``dequantize`` the float model of the same
    values instead (its activation quantizers dropped): the source of a new recipe. ``ValueError``
    when no importer reads ``path`` or the importer cannot map a tensor (named). ``importer``: the
    format when the caller knows it already (:func:`bridge.io.imported_format` of ``path``)."""
    fmt = imported_format(path) if importer is None else importer
    if fmt not in interop.IMPORTERS and fmt is not None:
        raise ValueError(f"load_imported: importer must be one of {sorted(interop.IMPORTERS)}, got {fmt!r}")
    if fmt is None:
        raise ValueError(f"load_imported: {path} is not a checkpoint of a format qtransform imports "
                         f"({', '.join(sorted(interop.IMPORTERS))})")
    source = interop.IMPORTERS[fmt].read(path)
    if dequantize:  # the source of a new recipe: the export's carried tensors go into its output as stored
        model = float_model(source, dtype)
        model._qt_carried = dict(source.carried)
        return model
    model = transformers_model(source.config, paths=model_paths(source), device="cpu", dtype=dtype)
    return from_source(model, source, kernel=kernel)

"""Checkpoints other tools read: exporters of qtransform checkpoints to other ecosystems' formats.

:mod:`.base` holds the interface (:class:`Exporter`, :class:`Checkpoint`, :class:`Support`), the
registry :data:`EXPORTERS` and :func:`export`; :class:`Importer` and :data:`IMPORTERS` are the way
back: other tools' checkpoints read into our tree without re-quantizing. Each target is one package
of this one, named alike inside: ``exporter.py`` (its :class:`Exporter`), ``importer.py`` (its
:class:`Importer`, where it has one), ``tensors.py`` (a quantized tensor as the target stores it, and
back) and the target's own helpers (``config.py``, ``model.py``, ``arch.py``, ``graph.py``); its
``__init__`` registers both, and importing this package imports every target.
:mod:`.hf_model` builds the transformers model a checkpoint's ``config.json`` describes, for all of them;
:mod:`.experts` writes mixture-of-experts weights per expert under the original checkpoint names, and back.
"""

from .base import (EXPORTERS, EXTRA_FILES, IMPORTERS, SUPPORT_KINDS, Checkpoint, Exporter, Importer, Support,
                   copy_extras, detect_format, export, read_source, register_exporter, register_importer,
                   write_config)

# the targets register themselves on import (one package each)
from . import compressed_tensors as _compressed_tensors  # noqa: E402,F401  (compressed-tensors: vLLM, transformers)
from . import gguf as _gguf  # noqa: E402,F401  (GGUF: llama.cpp)
from . import onnx as _onnx  # noqa: E402,F401  (ONNX QDQ model: ONNX Runtime)
from . import quark as _quark  # noqa: E402,F401  (AMD Quark HF format: transformers + amd-quark, vLLM)

__all__ = ["EXPORTERS", "EXTRA_FILES", "IMPORTERS", "SUPPORT_KINDS", "Checkpoint", "Exporter", "Importer", "Support",
           "copy_extras", "detect_format", "export", "read_source", "register_exporter", "register_importer",
           "write_config"]

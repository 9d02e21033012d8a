"""Checkpoints other tools read: exporters of qtransform checkpoints to other ecosystems' formats.

:mod:`.base` holds the interface (:class:`Exporter`, :class:`Source`, :class:`Support`), the
registry :data:`EXPORTERS` and :func:`export`; each target is one module of this package that
registers itself when imported here. :class:`Importer` and :data:`IMPORTERS` are the way
back: other tools' checkpoints read into our tree without re-quantizing.
"""

from .base import (EXPORTERS, EXTRA_FILES, IMPORTERS, SUPPORT_KINDS, Exporter, Importer, Source, Support,
                   copy_extras, detect_format, export, read_source, register_exporter, register_importer,
                   write_config)

# the targets register themselves on import (one module each)
from . import compressed_tensors as _compressed_tensors  # noqa: E402,F401  (compressed-tensors: vLLM, transformers)
from . import gguf as _gguf  # noqa: E402,F401  (GGUF: llama.cpp)
from . import onnx as _onnx  # noqa: E402,F401  (ONNX QDQ model: ONNX Runtime)
from . import quark as _quark  # noqa: E402,F401  (AMD Quark HF format: transformers + amd-quark, vLLM)

__all__ = ["EXPORTERS", "EXTRA_FILES", "IMPORTERS", "SUPPORT_KINDS", "Exporter", "Importer", "Source", "Support",
           "copy_extras", "detect_format", "export", "read_source", "register_exporter", "register_importer",
           "write_config"]

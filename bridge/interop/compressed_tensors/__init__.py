"""compressed-tensors (``quant_method: "compressed-tensors"``): vLLM and transformers load it.

:mod:`.exporter` writes it (``--to compressed-tensors``), :mod:`.importer` reads it back (ours or
llm-compressor's) without re-quantizing; :mod:`.config` maps a spec to compressed-tensors'
quantization arguments and back, :mod:`.tensors` a quantized tensor to its stored tensors and back,
:mod:`.model` the model's modules and its target/ignore patterns. Both are registered here.
"""

from ..base import register_exporter, register_importer
from .exporter import CompressedTensorsExporter
from .importer import CompressedTensorsImporter

register_exporter(CompressedTensorsExporter())
register_importer(CompressedTensorsImporter())

__all__ = ["CompressedTensorsExporter", "CompressedTensorsImporter"]

"""ONNX (QDQ form, opset 21): models ONNX Runtime runs. Export only (no importer).

:mod:`.exporter` writes it (``--to onnx``; :func:`export_module` for any quantized model in memory, and
``bridge.interop.export(..., like=...)`` for a checkpoint of one); :mod:`.module` builds the float models traced
for those; :mod:`.graph` exports the float forward and rewrites it
into ``DequantizeLinear`` / ``QuantizeLinear`` nodes; :mod:`.tensors` says which quantized tensors
ONNX holds exactly, and their parts. The exporter is registered here.
"""

from ..base import register_exporter
from .exporter import DATA_FILE, MODEL_FILE, PROTOBUF_LIMIT, OnnxExporter, export_module

# replace=True: kept from the flat module (a second import of it by pytest's importlib mode must not fail)
register_exporter(OnnxExporter(), replace=True)

__all__ = ["OnnxExporter", "export_module", "MODEL_FILE", "DATA_FILE", "PROTOBUF_LIMIT"]

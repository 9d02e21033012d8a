"""GGUF (llama.cpp): export of qtransform checkpoints and import of GGUF files.

:mod:`.exporter` writes one ``.gguf`` file (``--to gguf``, and ``--to gguf-k`` with K-quants as the
nearest types), :mod:`.importer` reads one back without re-quantizing; :mod:`.tensors` maps GGUF block
formats to our specs and their bytes both ways, :mod:`.arch` the architecture metadata, tensor names,
Q/K row order and tokenizer. Both are registered here.
"""

from ..base import register_exporter, register_importer
from .exporter import REPORT, GGUFExporter, nearest_type
from .importer import GGUFImporter

register_exporter(GGUFExporter())
register_exporter(GGUFExporter(k_quants=True))
register_importer(GGUFImporter())

__all__ = ["GGUFExporter", "GGUFImporter", "nearest_type", "REPORT"]

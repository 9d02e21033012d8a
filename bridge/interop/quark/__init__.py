"""AMD Quark's HF format (``quant_method: "quark"``): transformers with ``amd-quark`` and vLLM load it.

:mod:`.exporter` writes it (``--to quark``), :mod:`.importer` reads it back (ours or Quark's own
exports) without re-quantizing; :mod:`.config` maps a spec to Quark's tensor config and back,
:mod:`.tensors` a quantized tensor to Quark's stored tensors and back. Both are registered here.
"""

from ..base import register_exporter, register_importer
from .exporter import FORMAT_VERSION, KV_CACHE_GROUP, QuarkExporter, layer_config, skeleton
from .importer import QuarkImporter, resolve_layer

# replace=True: kept from the flat module, which pytest's importlib mode could import a second time under
# another name (the amd-quark package's); a second registration must not fail on the first
register_exporter(QuarkExporter(), replace=True)
register_importer(QuarkImporter(), replace=True)

__all__ = ["QuarkExporter", "QuarkImporter", "KV_CACHE_GROUP", "FORMAT_VERSION", "skeleton", "layer_config",
           "resolve_layer"]

"""Each export target is one package of :mod:`bridge.interop` (``exporter.py``, ``importer.py`` where it has one,
``tensors.py``...) whose ``__init__`` registers both; the names its flat module had stay importable from it."""

import importlib

import pytest

from bridge import interop

# package -> (export targets, import formats, the public names of the module it replaces)
TARGETS = {
    "quark": (["quark"], ["quark"], ["QuarkExporter", "KV_CACHE_GROUP", "FORMAT_VERSION", "skeleton", "layer_config"]),
    "compressed_tensors": (["compressed-tensors"], ["compressed-tensors"],
                           ["CompressedTensorsExporter", "CompressedTensorsImporter"]),
    "gguf": (["gguf", "gguf-k"], ["gguf"], ["GGUFExporter", "GGUFImporter", "nearest_type", "REPORT"]),
    "onnx": (["onnx"], [], ["OnnxExporter", "MODEL_FILE", "DATA_FILE", "PROTOBUF_LIMIT"]),
}


@pytest.mark.parametrize("package", sorted(TARGETS))
def test_each_target_package_registers_its_exporter_and_importer(package):
    exporters, importers, public = TARGETS[package]
    mod = importlib.import_module(f"bridge.interop.{package}")
    assert [type(interop.EXPORTERS[n]).__module__ for n in exporters] == [f"{mod.__name__}.exporter"] * len(exporters)
    assert [type(interop.IMPORTERS[n]).__module__ for n in importers] == [f"{mod.__name__}.importer"] * len(importers)
    assert set(public) <= set(mod.__all__) and all(hasattr(mod, n) for n in mod.__all__)


def test_every_registered_target_has_its_package():
    owners = {type(e).__module__.rsplit(".", 1)[0] for e in [*interop.EXPORTERS.values(), *interop.IMPORTERS.values()]}
    assert owners == {f"bridge.interop.{p}" for p in TARGETS}


def test_the_exports_copy_the_one_list_of_tokenizer_files():
    from bridge import io
    from bridge.checkpoint import tree_io

    assert io.TOKENIZER_FILES is tree_io.TOKENIZER_FILES
    assert interop.EXTRA_FILES == ("generation_config.json", *tree_io.TOKENIZER_FILES)

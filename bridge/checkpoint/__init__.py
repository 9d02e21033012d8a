"""Checkpoint files, independent of modules: safetensors shards (store), tensor layouts (pluggable:
the native one; exporters add theirs), the versioned metadata, and quantized trees in a directory."""

from .layout import LAYOUTS, NATIVE, Layout, NativeLayout, abstract_qtensor, register_layout
from .metadata import VERSION, CheckpointError, Entry, Metadata
from .tree_io import CONFIG, load_tree, read_metadata

__all__ = ["Layout", "NativeLayout", "NATIVE", "LAYOUTS", "register_layout", "abstract_qtensor", "VERSION",
           "CheckpointError", "Entry", "Metadata", "CONFIG", "load_tree", "read_metadata"]

"""Module <-> tree: ``extract`` (module -> parameter tree, module types) and ``to_module`` (quantized
tree -> modules), with the surgery helpers they share."""

from .extract import extract, module_types, tie_groups, weight_paths
from .rebuild import REBUILD_HOOKS, meta_skeleton, replace_module, submodule, to_module

__all__ = ["extract", "module_types", "weight_paths", "tie_groups", "to_module", "submodule", "replace_module", "meta_skeleton",
           "REBUILD_HOOKS"]

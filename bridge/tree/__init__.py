"""Module <-> tree: ``extract`` (module -> parameter tree, module types) and ``to_module`` (quantized
tree, or the pipeline's :class:`Quantized` result -> modules), with the surgery helpers they share;
``model_plan`` resolves a recipe for a model with its module types, linear layers in their logical
(out, in) layout (GPT-2's ``Conv1D``), keeping in float the linear layers whose weight a module above them
reads directly (``direct_reads``: Mamba's ``dt_proj``, RWKV's rescaled projections)."""

from .extract import extract, module_types, tie_groups, unsupported_experts, weight_paths
from .logical import TYPE_FALLBACK, model_plan, stored_transposed
from .standins import direct_reads
from .quantized import Quantized, Written
from .rebuild import (REBUILD_HOOKS, experts_slot, float_slot, meta_skeleton, qtensor_at, replace_module, site_buffers,
                      submodule, to_module)

__all__ = ["extract", "module_types", "weight_paths", "unsupported_experts", "tie_groups", "Quantized", "Written", "to_module", "submodule",
           "replace_module", "meta_skeleton", "float_slot", "qtensor_at", "experts_slot", "site_buffers", "REBUILD_HOOKS", "model_plan", "stored_transposed", "TYPE_FALLBACK", "direct_reads"]

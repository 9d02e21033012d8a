"""Model-family tables: each decoder family's blocks and which norm or linear feeds which linears
(:mod:`.tables`, plain data), resolved for a model into smoothing groups (:mod:`.groups`) and the
residual-stream layout rotations read (:mod:`.residual`): the model facts ``bridge.plan`` puts on the plan."""

from .tables import ARCHS, FOLDABLE_NORMS, Arch, GroupTemplate
from .groups import find_arch, model_groups, smoothing_groups
from .residual import ROTATABLE, model_layout, residual_layout

__all__ = ["ARCHS", "FOLDABLE_NORMS", "Arch", "GroupTemplate", "find_arch", "smoothing_groups", "model_groups",
           "ROTATABLE", "residual_layout", "model_layout"]

"""Model-family tables: each decoder family's blocks and which norm or linear feeds which linears
(:mod:`.tables`, plain data), resolved for a model into smoothing groups (:mod:`.groups`) and the
residual-stream layout rotations read (:mod:`.residual`)."""

from .tables import ARCHS, FOLDABLE_NORMS, Arch, GroupTemplate
from .groups import find_arch, smoothing_groups, takes_groups, with_groups
from .residual import ROTATABLE, residual_layout, with_layout

__all__ = ["ARCHS", "FOLDABLE_NORMS", "Arch", "GroupTemplate", "find_arch", "smoothing_groups", "takes_groups",
           "with_groups", "ROTATABLE", "residual_layout", "with_layout"]

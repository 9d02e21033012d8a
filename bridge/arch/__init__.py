"""Model-family tables: each decoder family's blocks and which norm or linear feeds which linears
(:mod:`.tables`, plain data), resolved for a model into smoothing groups (:mod:`.groups`)."""

from .tables import ARCHS, FOLDABLE_NORMS, Arch, GroupTemplate
from .groups import find_arch, smoothing_groups, takes_groups, with_groups

__all__ = ["ARCHS", "FOLDABLE_NORMS", "Arch", "GroupTemplate", "find_arch", "smoothing_groups", "takes_groups",
           "with_groups"]

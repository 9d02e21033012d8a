"""Model families, one row each (:mod:`.families`, typed in :mod:`.tables`: plain data): a decoder family's blocks,
which norm or linear feeds which linears, rotatability, expert names and GGUF facts; resolved for a model into
smoothing groups (:mod:`.groups`) and the residual-stream layout rotations read (:mod:`.residual`): the model facts
``bridge.plan`` puts on the plan."""

from .tables import Arch, ExpertNames, Gguf, GroupTemplate
from .families import ARCHS, arch_for, foldable_norms, rotatable
from .groups import find_arch, model_groups, smoothing_groups
from .residual import model_layout, residual_layout
from .towers import towers

__all__ = ["ARCHS", "Arch", "ExpertNames", "Gguf", "GroupTemplate", "arch_for", "foldable_norms", "rotatable",
           "find_arch", "smoothing_groups", "model_groups", "residual_layout", "model_layout", "towers"]

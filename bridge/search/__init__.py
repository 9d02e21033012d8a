"""Mixed-precision search on a model: the measurements (:mod:`.sensitivity`, :mod:`.reference`) the pure
:mod:`qtransform.search` decides from."""

from .fisher import output_fisher
from .sensitivity import ESTIMATES, Sensitivity, measure, searched_layers
from .reference import Reference, kl_reference, spread_pairs

__all__ = ["ESTIMATES", "output_fisher", "Sensitivity", "measure", "searched_layers", "Reference", "kl_reference", "spread_pairs"]

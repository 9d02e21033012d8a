"""Mixed-precision search on a model: the measurements (:mod:`.sensitivity`, :mod:`.reference`) the pure
:mod:`qtransform.search` decides from."""

from .fisher import fisher_pass, output_fisher
from .sensitivity import ESTIMATES, Sensitivity, measure, searched_layers
from .reference import Reference, kl_reference, spread_pairs

__all__ = ["ESTIMATES", "output_fisher", "fisher_pass", "Sensitivity", "measure", "searched_layers", "Reference", "kl_reference", "spread_pairs"]

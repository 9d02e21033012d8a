"""Mixed-precision search on a model: the measurements (:mod:`.sensitivity`, :mod:`.reference`) the pure
:mod:`qtransform.search` decides from."""

from .fisher import fisher_batches, fisher_pass, output_fisher
from .sensitivity import ESTIMATES, FISHER_TOKENS, Sensitivity, measure, searched_layers
from .reference import Reference, kl_reference, spread_pairs

__all__ = ["ESTIMATES", "FISHER_TOKENS", "output_fisher", "fisher_pass", "fisher_batches", "Sensitivity", "measure", "searched_layers", "Reference", "kl_reference", "spread_pairs"]

"""Mixed precision: each layer's scheme chosen under a size budget from measured sensitivity.

``size`` counts a weight's stored bytes under a spec; ``candidates`` names the schemes; ``estimate`` is the
cheap sensitivity (output error under the input Hessian); ``knapsack`` is the exact multiple-choice
knapsack; ``problem`` builds it from layers and constraints (shared schemes, pins, an export target's
formats); ``recipe_text`` writes the answer as a recipe file. The bridge measures; this package decides.
"""

from .size import budget_bytes, tensor_bytes
from .candidates import DEFAULT_CANDIDATES, Candidate, candidate, candidates
from .estimate import SEARCH_ALGORITHMS, output_error, quantized_weight, rank_correlation
from .knapsack import Solution, front, solve
from .problem import SearchResult, search, tied_groups
from .recipe_text import recipe_dict, recipe_json, recipe_toml, search_recipe

__all__ = ["budget_bytes", "tensor_bytes", "DEFAULT_CANDIDATES", "Candidate", "candidate", "candidates",
           "SEARCH_ALGORITHMS", "output_error", "quantized_weight", "rank_correlation", "Solution", "front", "solve", "SearchResult", "search",
           "tied_groups", "recipe_dict", "recipe_json", "recipe_toml", "search_recipe"]

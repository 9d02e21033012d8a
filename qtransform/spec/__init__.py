"""What to quantize and how: ``QuantSpec`` (what decoding needs), ``Recipe`` (which path gets
which spec, and the steps that fit them) and ``Plan`` (a recipe resolved once for a tree)."""

from .quantspec import CALIBRATION_FIELDS, SCALE_RULES, ZERO_POINT_DOMAINS, QuantSpec
from .step import Step
from .plan import KV_ROLES, ROLES, SITE_ROLES, Match, Plan, Site, is_kv_granularity, module_of
from .recipe import Recipe, as_plan, as_recipe
from .transpose import transposed_spec
from .stacked import matrix_spec, stacked_spec

__all__ = ["QuantSpec", "SCALE_RULES", "ZERO_POINT_DOMAINS", "CALIBRATION_FIELDS", "Step", "Match", "Plan", "Site", "ROLES", "KV_ROLES", "SITE_ROLES", "is_kv_granularity",
           "module_of", "Recipe", "as_plan", "as_recipe", "transposed_spec", "stacked_spec",
           "matrix_spec"]

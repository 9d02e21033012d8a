"""Moved: the GPTQ solver lives in :mod:`qtransform.algorithms.gptq_math` now (this module re-exports it
for one version; ``qtransform.algorithms.gptq_solver.gptq(W, H, spec)`` keeps working)."""

from .gptq_math import INITS, GPTQResult, gptq, gptq_many, inverse_hessian_factor

__all__ = ["GPTQResult", "gptq", "gptq_many", "inverse_hessian_factor", "INITS"]

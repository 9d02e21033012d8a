"""``lowrank``: a rank-r correction of each quantized linear's error (EoRA; HQQ+'s adapter, untrained).

After the steps before it, each linear weight the plan quantizes will run as ``Q = dequantize(quantize(W_now,
qparams))`` (the parameters fitted so far, ``context.qparams``; round to nearest where none were), whereas
the float model had ``W`` (``context.reference``: the tensor a rounding step such as GPTQ was given, or
the one AWQ or a rotation made). The step fits ``B A ≈ W - Q`` (:mod:`.lowrank_math`):

1. ``E = W - Q`` in the logical ``(out, in)`` layout (GPT-2's ``Conv1D`` weights are stored transposed);
2. with ``weighted=True`` (default), ``H = XᵀX / n``, the Hessian of the linear's input on the calibration
   data (the model run with the tensors the earlier steps left: GPTQ's on the grid, RTN's still float), is
   eigendecomposed ``H = U Λ Uᵀ`` (eigenvalues damped by ``damp`` times their mean; once per input);
3. the truncated SVD of ``E U Λ^{1/2}`` to rank ``r`` (of ``E`` itself without ``H``) gives ``B``, ``A``
   minimising ``||(E - B A) Xᵀ||_F`` (``||E - B A||_F``).

The result is ``Fit.lowrank`` ``{weight path: LowRank(a (r, in), b (out, r))}`` in the weight's dtype and
the round-to-nearest parameters it corrected, for weights no step had fitted (so the correction
matches the weight that runs). A later step that changes or refits a weight drops its correction.
``Fit.info`` reports each weight's ``lowrank_rank`` and the fraction of the (weighted) error left,
``lowrank_residual``. Stacked mixture-of-experts weights are refused by path (their modules run no
correction): leave them out of the recipe's quantized tensors or out of this step's reach.

Options: ``rank`` (32; capped at ``min(out, in)``), ``weighted`` (True: needs calibration data),
``damp`` (0.01).

>>> import torch, qtransform as qt
>>> w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
>>> spec = qt.QuantSpec(format="uint2", granularity=qt.PerGroup(32), symmetric=False)
>>> fit = qt.run_steps({"fc.weight": w}, qt.Recipe(default=spec, steps=[qt.Step("lowrank", rank=8, weighted=False)]))
>>> c, q = fit.lowrank["fc.weight"], qt.dequantize(qt.quantize(w, fit.qparams["fc.weight"]))
>>> (c.a.shape, c.b.shape), bool((w - q - c.delta()).norm() < (w - q).norm())
((torch.Size([8, 64]), torch.Size([16, 8])), True)
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch

from ..observers import choose_qparams, finalize_stats, init_stats
from ..spec import Site
from ..tensor import dequantize, quantize
from .base import Fit, SiteStats, register_algorithm
from .lowrank_math import LowRank, check_lowrank, hessian_basis, lowrank_error
from .gptq import LINEAR_TYPES
from .options import option, options_checker, received
from .outputs import register_output_kind

__all__ = ["step", "Options", "check_options", "lowrank_weights"]



@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """``lowrank``'s options (see the module docstring).

    >>> check_options(rank=0)
    Traceback (most recent call last):
    ...
    ValueError: lowrank: rank must be an int >= 1, got 0
    """

    rank: int = option(32, ge=1, doc="the rank of each correction (capped at min(out, in))")
    weighted: bool = option(True, doc="weight the error by the input Hessian (EoRA; needs calibration data)")
    damp: float = option(0.01, ge=0, doc="eigenvalue damping, a fraction of their mean")


check_options = options_checker("lowrank", Options)


def lowrank_weights(params: Mapping[str, torch.Tensor], plan) -> list[str]:
    """The weights the step corrects: the plan's quantized 2-D ``Linear``/``Conv1D`` weights (any 2-D
    ``*.weight`` when the plan knows no module types). A stacked experts weight is a ``ValueError`` naming it."""
    out = []
    for p in plan.specs:
        kind = plan[p].module_type
        if kind == "Experts":
            raise ValueError(f"{p}: a low-rank correction of stacked experts weights is not available (the experts "
                             "modules run none); leave the experts out of the recipe (e.g. exclude=['*experts*']) "
                             "or drop the lowrank step")
        w = params.get(p)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and p.endswith(".weight") and (
                kind is None or kind in LINEAR_TYPES):
            out.append(p)
    return out


def _sites(plan, *, options: Options) -> dict:
    if not options.weighted:
        return {}
    # the plan's tensors stand in for params: the paths and types are what matter here
    paths = [p for p in plan.specs if p.endswith(".weight") and plan[p].module_type in (None, *LINEAR_TYPES)]
    return {Site(plan.site_module(p), "input"): init_stats(observer="hessian") for p in paths}


def _wanted(*, options: Options) -> bool:
    return bool(options.weighted)


def step(params, plan, *, context, options: Options) -> Fit:
    """The ``lowrank`` step (see the module docstring)."""
    o = received(Options, options, step="lowrank")
    known, reference = context.qparams or {}, context.reference or {}
    stats = context.stats or {}
    corrections, fitted, info, bases = {}, {}, {}, {}
    for p in context.track(lowrank_weights(params, plan), desc="lowrank"):
        flip = plan[p].module_type == "Conv1D"  # stored (in, out)
        qp = known.get(p)
        if qp is None:
            qp = fitted[p] = choose_qparams(params[p], plan.specs[p], path=p)
        w = reference.get(p, params[p])
        e = (w - dequantize(quantize(params[p], qp, path=p), dtype=w.dtype)).to(w.dtype)
        e = e.T if flip else e
        H = basis = None
        if o.weighted:
            site = Site(plan.site_module(p), "input")
            if site not in stats:
                raise ValueError(f"{p}: no input Hessian at {site.module} (weighted=True needs calibration data)")
            H = finalize_stats(stats[site], path=p)
            if site not in bases:  # one eigendecomposition per input (q/k/v, gate/up share theirs)
                bases[site] = hessian_basis(H.to(e.device, torch.float64 if e.dtype == torch.float64 else torch.float32),
                                            damp=o.damp)
            basis = bases[site]
        c = lowrank_error(e, rank=o.rank, basis=basis)
        corrections[p] = c
        info[p] = {"lowrank_rank": c.rank, "lowrank_residual": float(f"{_residual(e, c.delta(), H):.4g}")}
    return Fit(qparams=fitted, lowrank=corrections, info=info)


def _residual(e: torch.Tensor, delta: torch.Tensor, H) -> float:
    """``||(E - BA)||`` over ``||E||``, in the Hessian's norm ``tr(M H Mᵀ)`` when given."""
    e, r = e.to(torch.float64), (e - delta).to(torch.float64)
    if H is None:
        num, den = r.pow(2).sum(), e.pow(2).sum()
    else:
        H = H.to(torch.float64)
        num, den = ((r @ H) * r).sum(), ((e @ H) * e).sum()
    return float((num / den).clamp_min(0).sqrt()) if den > 0 else 0.0


def _fits(c: LowRank, w, *, path: str, plan) -> None:
    """A correction returned for ``path`` fits the 2-D weight the plan quantizes there (logical layout)."""
    if path not in plan.specs or not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"returned a low-rank correction for {path!r}, which is not a 2-D weight the recipe quantizes")
    check_lowrank(c, tuple(w.shape[::-1]) if plan[path].module_type == "Conv1D" else tuple(w.shape), path=path)


# the kind of step output (Fit.lowrank); a later step that changes or refits a weight drops its correction
register_output_kind("lowrank", LowRank, check=_fits, stale_after=("params", "qparams"),
                     description="rank-r corrections run beside quantized linears ({weight path: LowRank})")
register_algorithm("lowrank", step, outputs=("lowrank",), needs=SiteStats(sites=_sites, wanted=_wanted), options=Options,
                   description="low-rank error correction (EoRA): rank-r A, B per linear, weighted by input Hessians")

"""Running a recipe's steps in order: the one pipeline behind ``quantize_tree``, the bridge,
the command line and quantize-on-load.

``run_steps(params, recipe)`` resolves the recipe once (a :class:`~qtransform.Plan`), checks
every step before any work (known algorithm, valid options, calibration available where a
step needs it), then runs the steps in order. Each step sees the tree as the steps before it
left it; a step that changes a tensor drops the quantization parameters earlier steps
fitted for it (they described the old tensor). The result is one :class:`~qtransform.Fit`:
the changed tensors and the quantization parameters still valid.

Steps that need statistics of activation sites get them from a *calibrator*, supplied by
whoever can run the model (the bridge runs forward passes with hooks): an object with
``site_stats(params, sites) -> {Site: statistics}``, called on the tree as it stands before
that step.

>>> import torch, qtransform as qt
>>> spec = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False, zero_point_domain="float")
>>> params = {"fc.weight": torch.randn(8, 64, generator=torch.Generator().manual_seed(0))}
>>> fit = qt.run_steps(params, qt.Recipe(default=spec, steps=[qt.Step("hqq", iters=5)]))
>>> sorted(fit.qparams), fit.params
(['fc.weight'], {})
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from .. import _tree
from ..algorithms import ALGORITHMS, Context, Fit, SiteStats, check_algorithm_options
from ..observers import Observer, init_stats
from ..spec import Plan, Site, Step, as_plan
from ..tensor import QParams

__all__ = ["Calibrator", "run_steps", "check_steps"]


class Calibrator(Protocol):
    """What runs the model for the steps that need data (the bridge provides one)."""

    def site_stats(self, params: Mapping[str, torch.Tensor], sites: Mapping[Site, Any]) -> Mapping[Site, Any]:
        """``sites`` maps each site to empty statistics (``init_stats(...)``); returns them with every
        calibration batch's activations at that site folded in (``observe``), the model's tensors
        taken from ``params``."""


def check_steps(steps: Sequence[Step], *, calibrated: bool | None = None, on_load: bool = False,
                where: str = "recipe.steps") -> None:
    """Raise ``ValueError``/``TypeError`` naming the step unless every step can run: a registered
    algorithm with valid options; with ``calibrated=False``, no step that needs calibration data
    (``None``: not checked). ``on_load=True`` also requires steps that fit one tensor at a time
    without data (quantize-on-load)."""
    for i, step in enumerate(steps):
        label = step.name if isinstance(step, Step) else repr(step)
        at = f"{where}[{i}] ({label})"
        if not isinstance(step, Step):
            raise TypeError(f"{at}: expected a qtransform.Step, got {type(step).__name__}")
        try:
            algo = ALGORITHMS[step.name]
        except ValueError as e:
            raise ValueError(f"{at}: {e}") from None
        check_algorithm_options(step.name, step.options, path=at)
        if on_load and (algo.needs is not None or not algo.local):
            why = "needs calibration data" if algo.needs is not None else "changes several tensors together"
            local = sorted(n for n, a in ALGORITHMS.items() if a.local and a.needs is None)
            raise ValueError(f"{at}: quantize-on-load runs steps that fit one tensor at a time without data "
                             f"({', '.join(local)}); {step.name!r} {why}. Quantize the model first "
                             "(bridge.quantize or `qtransform quantize`) and load the checkpoint")
        if algo.needs is not None and calibrated is False:
            raise ValueError(f"{at}: {step.name!r} needs statistics of activation sites, i.e. calibration data; "
                             "pass calibration batches (bridge.quantize(model, recipe, calibration=...), "
                             "`qtransform quantize --calib N`) or a calibrator")


def _collect(algo, step: Step, plan: Plan, current: Mapping, calibrator: Calibrator | None, at: str):
    if algo.needs is None:
        return None
    if isinstance(algo.needs, SiteStats):
        sites = {}
        for site, want in algo.needs.sites(plan, **step.options).items():
            if not isinstance(site, Site):
                raise TypeError(f"{at}: SiteStats.sites must return {{Site: observer or statistics}}, got key {site!r}")
            sites[site] = want if isinstance(getattr(want, "observer", None), Observer) else init_stats(observer=want)
        return calibrator.site_stats(current, sites)
    raise TypeError(f"{at}: unknown need {type(algo.needs).__name__}")


def _check_fit(fit, at: str, plan: Plan, current: Mapping[str, torch.Tensor]) -> None:
    if not isinstance(fit, Fit):
        raise TypeError(f"{at}: the algorithm returned {type(fit).__name__}, not a qtransform.Fit")
    for path, t in fit.params.items():
        old = current.get(path)
        if not isinstance(old, torch.Tensor):
            raise ValueError(f"{at}: returned a tensor for {path!r}, which is not a tensor of the tree")
        if t.shape != old.shape or t.dtype != old.dtype:
            raise ValueError(f"{at}: {path}: returned shape {tuple(t.shape)} and dtype {t.dtype} for a tensor of "
                             f"{tuple(old.shape)} {old.dtype}; steps keep shapes and dtypes")
    for path, qp in fit.qparams.items():
        spec = plan.specs.get(path)
        if spec is None:
            raise ValueError(f"{at}: returned qparams for {path!r}, which the recipe leaves unquantized")
        if not isinstance(qp, QParams) or qp.spec != spec:
            raise ValueError(f"{at}: {path}: qparams were made for {getattr(qp, 'spec', qp)}, the plan asks for {spec}")


def run_steps(params: Any, recipe, *, types: Mapping[str, str] | None = None, calibrator: Calibrator | None = None,
              progress: Callable | None = None) -> Fit:
    """Run ``recipe``'s steps in order on ``params`` (see the module docstring).

    Args:
        params: a tree of tensors (not modified).
        recipe: a :class:`~qtransform.Recipe` (or a :class:`~qtransform.Plan` resolved upstream).
        types: module type name by path, for ``Recipe.type_rules``.
        calibrator: runs the model for steps that need statistics.
        progress: ``progress(iterable, desc=..., total=...)``, e.g. ``tqdm.tqdm``.

    Returns:
        :class:`~qtransform.Fit`: the tensors the steps changed (as the last step left them) and the
        quantization parameters still valid at the end.
    """
    plan = as_plan(recipe, params, types=types)
    check_steps(plan.steps, calibrated=calibrator is not None)
    flat = dict(_tree.flatten_with_paths(params)[0])
    current, qparams, changed = dict(flat), {}, set()
    for i, step in enumerate(plan.steps):
        at = f"recipe.steps[{i}] ({step.name})"
        algo = ALGORITHMS[step.name]
        stats = _collect(algo, step, plan, dict(current), calibrator, at)  # copies: steps never change the tree
        fit = algo.fn(dict(current), plan, context=Context(stats=stats, progress=progress), **step.options)
        _check_fit(fit, at, plan, current)
        for path in fit.params:
            qparams.pop(path, None)
        current.update(fit.params)
        changed.update(fit.params)
        qparams.update(fit.qparams)
    return Fit(params={p: current[p] for p in flat if p in changed}, qparams=qparams)


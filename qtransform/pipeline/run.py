"""Running a recipe's steps in order: the one pipeline behind ``quantize_tree``, the bridge,
the command line and quantize-on-load.

``run_steps(params, recipe)`` resolves the recipe once (a :class:`~qtransform.Plan`), checks
every step before any work (known algorithm, valid options, calibration available where a
step needs it), then runs the steps in order. Each step sees the tree as the steps before it
left it; a step that changes a tensor drops the quantization parameters earlier steps
fitted for it (they described the old tensor). The result is one :class:`~qtransform.Fit`:
the changed tensors and the quantization parameters still valid.

Steps that need data get it from a *calibrator*, supplied by whoever can run the model (the
bridge runs forward passes with hooks): ``site_stats(params, sites) -> {Site: statistics}`` for
:class:`~qtransform.SiteStats` steps, called on the tree as it stands before that step, and
``blockwise(params, plan, fit_block) -> Fit`` for :class:`~qtransform.BlockInputs` steps, which
calls ``fit_block(block, params)`` for each block in order and quantizes each block before computing the
next one's inputs. Online rotations that earlier steps recorded (``Fit.online``) are handed to the
calibrator as ``online=`` (only when there are some: calibrators without the option still serve
recipes without online rotations), which applies them while the model runs, and to the steps as
``context.online``. A calibrator whose methods take a ``step`` keyword is told which pass each call
serves (:func:`serving`): the index of the recipe step, or ``"activations"`` for the statistics of the
static activation quantizers (a calibrator that keeps one stream of activations per pass, as the
streamed driver does, keys them by it).

>>> import torch, qtransform as qt
>>> spec = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False, zero_point_domain="float")
>>> params = {"fc.weight": torch.randn(8, 64, generator=torch.Generator().manual_seed(0))}
>>> fit = qt.run_steps(params, qt.Recipe(default=spec, steps=[qt.Step("hqq", iters=5)]))
>>> sorted(fit.qparams), fit.params
(['fc.weight'], {})
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from .. import _pytree
from ..algorithms import ALGORITHMS, Block, BlockInputs, Context, Fit, ModelLoss, SiteStats
from ..algorithms.base import FACTS, needs_data
from ..algorithms.outputs import check_against
from ..observers import Observer, init_stats
from ..parallel import SERIAL
from ..rotation.online import ONLINE_ROLES
from ..spec import Plan, Site, Step, as_plan
from ..tensor import QParams, conform_qparams, dequantize, quantize

__all__ = ["Calibrator", "run_steps", "check_steps", "check_plan_facts", "serving"]


class Calibrator(Protocol):
    """What runs the model for the steps that need data (the bridge provides one)."""

    def site_stats(self, params: Mapping[str, torch.Tensor], sites: Mapping[Site, Any], *,
                   online: Mapping | None = None) -> Mapping[Site, Any]:
        """``sites`` maps each site to empty statistics (``init_stats(...)``); returns them with every
        calibration batch's activations at that site folded in (``observe``), the model's tensors
        taken from ``params``, the ``online`` rotations (``{Site: OnlineRotation}``) applied where they
        sit (an input site's statistics are taken after its rotation)."""

    def blockwise(self, params: Mapping[str, torch.Tensor], plan: Plan,
                  fit_block: Callable[[Block, Mapping[str, torch.Tensor]], Fit], *,
                  qparams: Mapping[str, QParams] | None = None, tokens: int | None = None,
                  online: Mapping | None = None) -> Fit:
        """``fit_block(block, params)`` for each block in order (``params`` as the blocks before left
        it), each block then quantized (what the step fitted, else ``qparams`` fitted before it for an
        unchanged tensor, else round to nearest) to compute the next block's inputs; returns the
        blocks' fits combined. ``tokens``: use whole batches, spread over the data, until that many
        tokens (the step's ``BlockInputs.tokens``; ``None``: every batch). ``online``: as for
        :meth:`site_stats`; a block's ``capture`` records module arguments before their rotation.
        ``float_inputs=True`` (passed only when the step's ``BlockInputs.float_inputs`` asks): each block also
        gets the float model's inputs (:attr:`~qtransform.Block.float_inputs`)."""

    def model_loss(self, plan: Plan, *, online: Mapping | None = None) -> Callable:
        """The model's loss on the calibration data for :class:`~qtransform.ModelLoss` steps:
        ``loss(params, i, online=None)`` on batch ``i`` (``len(loss)`` batches), differentiable with
        respect to ``params``, with ``plan``'s activation quantizers (fake quantization, straight-through)
        and the rotations ``online`` (earlier steps') and the call's ``online`` applied."""


def serving(calibrator, method: str, step: int | str) -> dict:
    """``{"step": step}`` when ``calibrator``'s ``method`` takes a ``step`` keyword, else ``{}`` (calibrators
    without it serve every recipe): ``step`` is the index of the recipe step the call serves, or
    ``"activations"`` for the static activation quantizers' statistics."""
    fn = getattr(calibrator, method, None)
    try:
        return {"step": step} if "step" in inspect.signature(fn).parameters else {}
    except (TypeError, ValueError):  # not introspectable: not told
        return {}


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
        algo.check(step.options, path=at)
        if on_load and not algo.one_tensor_at_a_time:
            why = "needs calibration data" if algo.needs is not None else "changes several tensors together"
            local = sorted(n for n, a in ALGORITHMS.items() if a.one_tensor_at_a_time)
            raise ValueError(f"{at}: quantize-on-load runs steps that fit one tensor at a time without data "
                             f"({', '.join(local)}); {step.name!r} {why}. Quantize the model first "
                             "(bridge.quantize or `qtransform quantize`) and load the checkpoint")
        if needs_data(algo, step.options) and calibrated is False:
            what = ("runs block by block on" if isinstance(algo.needs, BlockInputs)
                    else "learns on the model's loss over" if isinstance(algo.needs, ModelLoss)
                    else "needs statistics of activation sites, i.e.")
            raise ValueError(f"{at}: {step.name!r} {what} calibration data; "
                             "pass calibration batches (bridge.quantize(model, recipe, calibration=...), "
                             "`qtransform quantize --calib N`) or a calibrator")


def check_plan_facts(plan: Plan, *, where: str = "recipe.steps") -> None:
    """``ValueError`` naming the first step whose algorithm ``requires`` a model fact (``Plan.groups``,
    ``Plan.layout``) that ``plan`` does not have and the step's options do not give."""
    for i, step in enumerate(plan.steps):
        for fact in ALGORITHMS[step.name].requires:
            if getattr(plan, fact, None) is None and step.options.get(fact) is None:
                raise ValueError(f"{where}[{i}] ({step.name}): needs the model's {FACTS[fact]} (Plan.{fact}), which "
                                 f"this plan does not have: bridge.plan fills it from the model's architecture "
                                 f"table (bridge.arch); for a tree alone, pass Recipe.plan(tree, {fact}=...)")


def _sites(algo, arguments: Mapping, plan: Plan, at: str) -> dict:
    sites = {}
    for site, want in algo.needs.sites(plan, **arguments).items():
        if not isinstance(site, Site):
            raise TypeError(f"{at}: SiteStats.sites must return {{Site: observer or statistics}}, got key {site!r}")
        sites[site] = want if isinstance(getattr(want, "observer", None), Observer) else init_stats(observer=want)
    return sites


def _run_step(algo, step: Step, plan: Plan, current: dict, calibrator: Calibrator | None, progress, at: str,
              qparams: Mapping[str, QParams], online: Mapping, reference: Mapping, index: int) -> Fit:
    """One step on the current tree (copies of the dict: steps never change the tree they are handed)."""
    rotated = {"online": dict(online)} if online else {}  # calibrators without the option serve the others
    known = {"qparams": dict(qparams), "reference": {**current, **reference}}
    arguments = algo.arguments(step.options, path=at)  # its options dataclass built once (else the keywords)
    if isinstance(algo.needs, BlockInputs):
        def fit_block(block: Block, params: Mapping) -> Fit:
            fit = algo.fn(dict(params), plan, context=Context(block=block, progress=progress, online=dict(online),
                                                              **known), **arguments)
            fit = _check_fit(fit, f"{at} block {block.name}", plan, current, declared=algo.outputs)
            outside = sorted(set(fit.params) - set(block.paths))
            if outside:
                raise ValueError(f"{at} block {block.name}: returned tensors outside the block: {outside[:5]}")
            return fit

        tokens = algo.needs.tokens(**arguments) if algo.needs.tokens is not None else None
        more = {} if tokens is None else {"tokens": tokens}  # calibrators without the option still serve others
        if algo.needs.float_inputs is not None and algo.needs.float_inputs(**arguments):
            more["float_inputs"] = True
        return calibrator.blockwise(dict(current), plan, fit_block, qparams=dict(qparams), **more, **rotated,
                                    **serving(calibrator, "blockwise", index))
    if isinstance(algo.needs, ModelLoss):
        loss = calibrator.model_loss(plan, **rotated)
        return algo.fn(dict(current), plan, context=Context(loss=loss, progress=progress, online=dict(online),
                                                            parallel=getattr(calibrator, "parallel", SERIAL), **known),
                       **arguments)
    stats = _collect(algo, step, arguments, plan, current, calibrator, at, rotated, index)
    return algo.fn(dict(current), plan, context=Context(stats=stats, progress=progress, online=dict(online), **known),
                   **arguments)


def _collect(algo, step: Step, arguments: Mapping, plan: Plan, current: Mapping, calibrator: Calibrator | None,
             at: str, rotated, index: int):
    if not needs_data(algo, step.options):
        return None
    if isinstance(algo.needs, SiteStats):
        return calibrator.site_stats(dict(current), _sites(algo, arguments, plan, at), **rotated,
                                     **serving(calibrator, "site_stats", index))
    raise TypeError(f"{at}: unknown need {type(algo.needs).__name__}")


def _check_fit(fit, at: str, plan: Plan, current: Mapping[str, torch.Tensor], before: Mapping = {}, *,
               declared: Sequence[str] = ()) -> Fit:
    """``fit`` checked against the tree and the plan, its quantization parameters in the form their specs store
    (:func:`qtransform.conform_qparams`: cast where exact, refused by path otherwise)."""
    if not isinstance(fit, Fit):
        raise TypeError(f"{at}: the algorithm returned {type(fit).__name__}, not a qtransform.Fit")
    for site, rot in fit.online.items():
        where = f"{at}: online rotation at {site.module} ({site.role})"
        if site in before:
            raise ValueError(f"{where}: an earlier step already rotates there; rotate once")
        if site.role == "input" and not isinstance(current.get(f"{site.module}.weight"), torch.Tensor):
            raise ValueError(f"{where}: {site.module}.weight is not a tensor of the tree (online input rotations "
                             "go on linear layers whose weight holds the rotation)")
        if site.role == "key" and site.module not in plan.attention:
            raise ValueError(f"{where}: not an attention module of the plan ({list(plan.attention)[:3]})")
        if site.role not in ONLINE_ROLES:
            raise ValueError(f"{where}: online rotations sit at a linear's input or an attention module's "
                             "queries and keys (roles 'input', 'key')")
    for path, t in fit.params.items():
        old = current.get(path)
        if not isinstance(old, torch.Tensor):
            raise ValueError(f"{at}: returned a tensor for {path!r}, which is not a tensor of the tree")
        if t.shape != old.shape or t.dtype != old.dtype:
            raise ValueError(f"{at}: {path}: returned shape {tuple(t.shape)} and dtype {t.dtype} for a tensor of "
                             f"{tuple(old.shape)} {old.dtype}; steps keep shapes and dtypes")
    check_against(fit.outputs, current, plan, at=at)
    undeclared = [k for k in fit.outputs if k not in declared]
    if undeclared:
        raise ValueError(f"{at}: returned {undeclared[0]!r} outputs, which the step does not declare "
                         f"(register_algorithm(..., outputs=({undeclared[0]!r},)))")
    for path, qp in fit.qparams.items():
        spec = plan.specs.get(path)
        if spec is None:
            raise ValueError(f"{at}: returned qparams for {path!r}, which the recipe leaves unquantized")
        if not isinstance(qp, QParams) or qp.spec != spec:
            raise ValueError(f"{at}: {path}: qparams were made for {getattr(qp, 'spec', qp)}, the plan asks for {spec}")
    new = {}
    for path, qp in fit.qparams.items():
        shape = (fit.params.get(path) if path in fit.params else current[path]).shape
        conformed = conform_qparams(qp, shape, path=f"{at}: {path}")
        if conformed is not qp:
            new[path] = conformed
    return dataclasses.replace(fit, qparams={**fit.qparams, **new}) if new else fit


def run_steps(params: Any, recipe, *, types: Mapping[str, str] | None = None, calibrator: Calibrator | None = None,
              progress: Callable | None = None, qparams: Mapping[str, QParams] | None = None) -> Fit:
    """Run ``recipe``'s steps in order on ``params`` (see the module docstring).

    Args:
        params: a tree of tensors (not modified).
        recipe: a :class:`~qtransform.Recipe` (or a :class:`~qtransform.Plan` resolved upstream).
        types: module type name by path, for ``Recipe.type_rules``.
        calibrator: runs the model for steps that need statistics.
        progress: ``progress(iterable, desc=..., total=...)``, e.g. ``tqdm.tqdm``.
        qparams: parameters the caller fixed for paths no step fits (``quantize_tree(qparams=...)``):
            block-by-block steps quantize the blocks before the next one's inputs with them.

    Returns:
        :class:`~qtransform.Fit`: the tensors the steps changed (as the last step left them), the
        quantization parameters still valid at the end and the online rotations recorded.
    """
    plan = as_plan(recipe, params, types=types)
    check_steps(plan.steps, calibrated=calibrator is not None)
    _check_calibrator(plan.steps, calibrator)
    check_plan_facts(plan)
    flat = dict(_pytree.flatten_with_paths(params)[0])
    total, reference = Fit(), {}
    for i, step in enumerate(plan.steps):
        at = f"recipe.steps[{i}] ({step.name})"
        current = {**flat, **total.params}
        try:
            known = {**{p: q for p, q in (qparams or {}).items() if p not in total.params}, **total.qparams}
            fit = _run_step(ALGORITHMS[step.name], step, plan, current, calibrator, progress, at, known, total.online,
                            reference, i)
        except (ValueError, TypeError) as e:  # name the step in errors raised while it runs
            if type(e) not in (ValueError, TypeError) or str(e).startswith("recipe.steps["):
                raise
            raise type(e)(f"{at}: {e}") from e
        fit = _check_fit(fit, at, plan, current, total.online, declared=ALGORITHMS[step.name].outputs)
        reference = _references(fit, current, reference)
        total = total.then(fit)
    return total


def _references(fit: Fit, current: Mapping, reference: Mapping) -> dict:
    """The float tensors the quantization should approximate after ``fit`` (``Context.reference``): a tensor
    returned on the grid of the qparams fitted with it was rounded by the step (the reference stays the tensor
    it was given); one changed otherwise (smoothed, rotated) is the new reference."""
    out = dict(reference)
    for path, t in fit.params.items():
        qp = fit.qparams.get(path)
        on_grid = qp is not None and torch.allclose(dequantize(quantize(t, qp, path=path), dtype=t.dtype), t,
                                                    rtol=1e-5, atol=0)
        out[path] = out.get(path, current[path]) if on_grid else t
    return out


def _check_calibrator(steps: Sequence[Step], calibrator) -> None:
    for i, step in enumerate(steps):
        needs = ALGORITHMS[step.name].needs if needs_data(ALGORITHMS[step.name], step.options) else None
        method = ("blockwise" if isinstance(needs, BlockInputs) else "model_loss" if isinstance(needs, ModelLoss)
                  else "site_stats" if needs is not None else None)
        if method is not None and not callable(getattr(calibrator, method, None)):
            raise TypeError(f"recipe.steps[{i}] ({step.name}): the calibrator ({type(calibrator).__name__}) has no "
                            f"{method}() method, which this step needs (see qtransform.Calibrator)")


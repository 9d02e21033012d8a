"""The algorithm contract: steps that return new weights *and* quantization parameters.

An algorithm is a pure function

    ``fn(params, plan, *, context, options) -> Fit``

* ``params``: the flat parameter tree ``{path: tensor}`` as the steps before it left it (a
  copy of the dict; the tensors must not be modified in place);
* ``plan``: the recipe resolved for the tree (:class:`~qtransform.Plan`): ``plan.specs`` are
  the paths to quantize with their specs;
* ``context``: what the pipeline hands over (:class:`Context`): the statistics it asked for,
  and a progress wrapper;
* ``options``: its options, an instance of its options dataclass (``options=`` below), built and checked
  once by the caller; the defaults live there alone, ``fn`` reads ``options.x`` (a step registered
  without one receives its options as keywords instead: ``fn(params, plan, *, context, **options)``);
* the result, :class:`Fit`, holds updated tensors for any paths it changes (a weight, or a
  weight *and* the norm before it), quantization parameters for any paths it fits, and the
  online rotations the changed weights now expect at run time (``Fit.online``: QuaRot's ``R3``,
  ``R4``; see :mod:`qtransform.rotation.online`). Later steps see the model with them applied
  (``context.online``; the calibrator applies them).

An algorithm declares what it needs from calibration (``needs``): nothing (``None``: RTN,
HQQ), statistics of named activation sites (:class:`SiteStats`: SmoothQuant, AWQ's scales),
which the caller's calibrator collects on the tree as the previous steps left it, or the
inputs of one block at a time (:class:`BlockInputs`: GPTQ, AWQ's search): the calibrator then
calls the algorithm once per block (``context.block``, a :class:`Block`), each block's inputs
being the outputs of the blocks before it as already fitted and quantized.
``local=True`` says each path's result depends on that tensor alone, so the step can run
one tensor at a time while a checkpoint loads. ``requires`` names the model facts of the plan it
cannot run without (``Plan.groups``, ``Plan.layout``). Its options are a frozen keyword-only
dataclass (``options=``), which one checker (:mod:`.options`) validates for every algorithm alike:
names, types and ranges, the message naming the path and the step.

>>> import dataclasses, torch, qtransform as qt
>>> @dataclasses.dataclass(frozen=True, kw_only=True)
... class Shrink:
...     factor: float = 0.5
>>> def shrink(params, plan, *, context, options):
...     new = {p: params[p] - options.factor * (params[p] - params[p].mean(-1, keepdim=True)) for p in plan.specs}
...     return qt.Fit(params=new)
>>> algo = qt.register_algorithm("shrink_demo", shrink, local=True, options=Shrink)
>>> params = {"fc.weight": torch.tensor([[1.0, 3.0]])}
>>> fit = algo(params, qt.QuantSpec(format="int8"), factor=0.5)
>>> fit.params["fc.weight"].tolist(), qt.apply_fit(params, fit)["fc.weight"].tolist()
([[1.5, 2.5]], [[1.5, 2.5]])
>>> _ = qt.ALGORITHMS.unregister("shrink_demo")
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import torch

from .. import _pytree
from ..parallel import SERIAL, Parallel
from ..registry import Registry
from ..spec import as_plan
from .fit import Fit, apply_fit
from .outputs import OUTPUT_KINDS
from .options import check_options as _check_options
from .options import option_fields

__all__ = ["Fit", "Context", "SiteStats", "BlockInputs", "ModelLoss", "Block", "Algorithm", "ALGORITHMS", "register_algorithm", "get_algorithm",
           "check_algorithm_options", "apply_fit"]


class SiteStats(NamedTuple):
    """The step needs statistics of activation sites: ``sites(plan, options=...)`` returns
    ``{Site: observer}`` (an observer name, dict or instance, for observers that need no spec) or
    ``{Site: empty statistics}`` (``qt.init_stats(spec, observer=...)``, e.g. activation ranges);
    the step receives ``context.stats`` = ``{Site: statistics}`` folded over the calibration data.
    ``wanted(options=...) -> bool``, when given, says whether these options need them at all (``lowrank``
    without ``weighted`` runs without data; ``None``: always). These helpers, like :class:`BlockInputs`'s, receive
    the options as the step does (:meth:`Algorithm.arguments`: its options dataclass as ``options=``, else keywords)."""

    sites: Callable[..., Mapping]
    wanted: Callable[..., bool] | None = None


class BlockInputs(NamedTuple):
    """The step runs one block at a time on that block's calibration inputs (``context.block``).

    Its :class:`Fit` for a block may only touch that block's tensors; the calibrator quantizes the block with
    the parameters fitted so far (round to nearest where none were) before computing the next block's inputs.
    ``tokens(options=...) -> int | None``: how many calibration tokens the step uses (whole batches spread over
    the data; ``None``: all). ``float_inputs(options=...) -> bool``: when true, the float model's inputs of each
    block as well (:attr:`Block.float_inputs`: AutoRound's and GPTAQ's targets)."""

    tokens: Callable[..., int | None] | None = None
    float_inputs: Callable[..., bool] | None = None


class ModelLoss(NamedTuple):
    """The step minimises the model's loss on the calibration data: ``context.loss(params, i, online=None)``
    is the loss (a scalar tensor, differentiable with respect to ``params`` under ``torch.func.grad``) of
    the model on calibration batch ``i`` (``0 <= i < len(context.loss)``) with its tensors taken from
    ``params``, the plan's activation quantizers applied as fake quantization with straight-through
    gradients, and the online rotations of earlier steps plus ``online`` (``{Site: OnlineRotation}``)
    in place."""


class Block(NamedTuple):
    """One block of a model, handed to a :class:`BlockInputs` step.

    Attributes:
        name: the block's module path (``"model.layers.3"``).
        paths: the tree paths of its tensors.
        inputs: per calibration batch, the block's ``(args, kwargs)`` (outputs of the blocks before it).
        run: ``run(params) -> [output per batch]``: the block on its inputs with its tensors taken from
            ``params`` (``{path: tensor}``; missing paths keep the current tree's); differentiable with respect to
            ``params`` (``torch.func.grad`` through it gives the true gradient).
        site_stats: ``site_stats(params, {Site: empty statistics}) -> {Site: statistics}``: the block on
            its inputs with hooks, for sites inside it; on several ranks also ``owners=`` (``{Site: rank}``): each
            site's statistics reduced to its owner only (the others get no entry for it).
        capture: ``capture(params, modules, sites=None, *, inputs=None) -> (inputs, stats)``: one run of the
            block on its inputs (or on ``inputs``, a list of batches such as ``[block.float_inputs[i]]``) that
            records, for each module path in ``modules`` (inside the block), its ``(args, kwargs)`` per batch
            (``{module: [...]}``), and folds ``sites`` like ``site_stats`` (over this rank's batches).
        call: ``call(module, params, args, kwargs, *, activations=False) -> output``: the module at path ``module``
            (inside the block, or the block itself) on ``args``/``kwargs``, its tensors taken from ``params``
            (missing paths keep the current tree's): a pure, differentiable function of ``params``; with
            ``activations=True`` the plan's activation quantizers fake-quantize their modules' inputs and outputs
            on the way (parameters fitted to each activation, straight-through gradients: a learned step trains
            under the activation quantization the model will run with).
        tokens: the calibration tokens in ``inputs`` over all batches, counted by the caller, who knows which
            input holds the hidden states (the bridge: ``bridge.calibrate.blocks.batch_tokens``); ``None``: not
            counted, and the steps that sample rows by it (``awq``, ``smoothquant`` with ``alpha="auto"``) keep
            every row.
        parallel: the processes running this step on disjoint shares of the calibration data
            (:class:`qtransform.Parallel`; :data:`qtransform.SERIAL` for one). ``inputs``, ``run``, ``capture``
            and ``call`` are this rank's share; ``site_stats`` and ``tokens`` are over all ranks' data.
        float_inputs: if the step asked (``BlockInputs.float_inputs``), per batch the block's ``(args, kwargs)`` in
            the float model (the blocks before it as the earlier steps left them, unquantized), batch for batch as
            ``inputs``; else ``None``. ``float_outputs()``: the block's output tensors on them (a step's targets),
            run once and passed on by the caller as the next block's float inputs (``None``: use ``call``).
    """

    name: str
    paths: tuple[str, ...]
    inputs: Sequence[Any]
    run: Callable[[Mapping[str, torch.Tensor]], list]
    site_stats: Callable[[Mapping[str, torch.Tensor], Mapping], Mapping]
    capture: Callable[..., tuple] | None = None
    call: Callable[..., Any] | None = None
    tokens: int | None = None
    parallel: Parallel = SERIAL
    float_inputs: Sequence[Any] | None = None
    float_outputs: Callable[[], Sequence[torch.Tensor]] | None = None


class Context(NamedTuple):
    """What the pipeline hands a step: ``stats`` (for :class:`SiteStats` steps), ``block`` (for
    :class:`BlockInputs` steps), ``loss`` (for :class:`ModelLoss` steps), ``progress`` (``progress(iterable, desc=..., total=...)``, e.g.
    ``tqdm.tqdm``, or ``None``) and ``online``, the online rotations earlier steps recorded
    (``{Site: OnlineRotation}``: the statistics and block inputs were taken with them applied), and
    ``parallel``, the processes running the same step (:class:`qtransform.Parallel`: a :class:`ModelLoss`
    step may split its batches among them; ``stats`` are already reduced over them); ``qparams``, the parameters
    earlier steps fitted (valid for the current tensors), and ``reference``, the float tensor each path's
    quantization approximates (what a rounding step such as GPTQ was given, else the current one: ``lowrank``'s)."""

    stats: Mapping | None = None
    progress: Callable | None = None
    block: Block | None = None
    online: Mapping = {}
    loss: Callable | None = None
    parallel: Parallel = SERIAL
    qparams: Mapping = {}
    reference: Mapping = {}

    def track(self, iterable: Iterable, *, desc: str = "", total: int | None = None) -> Iterable:
        """``iterable`` wrapped by the progress bar, if any."""
        if self.progress is None:
            return iterable
        return self.progress(iterable, desc=desc, total=len(iterable) if total is None and
                             hasattr(iterable, "__len__") else total)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Algorithm:
    """A registered algorithm (see the module docstring).

    Calling it runs it alone: ``algo(params, recipe, **options) -> Fit`` (a recipe's steps run
    in order through :func:`qtransform.run_steps`).
    """

    name: str
    fn: Callable
    needs: SiteStats | BlockInputs | None = None
    local: bool = False
    check_options: Callable | None = None
    description: str = ""
    requires: tuple[str, ...] = ()
    options: type | None = None
    outputs: tuple[str, ...] = ()

    @property
    def one_tensor_at_a_time(self) -> bool:
        """It fits one tensor at a time without data (quantize-on-load runs it; a streamed run goes shard to shard
        with it)."""
        return self.local and self.needs is None

    def __call__(self, params: Any, recipe, *, types: Mapping[str, str] | None = None, stats: Mapping | None = None,
                 progress: Callable | None = None, **options) -> Fit:
        """Run this algorithm alone on ``params`` for ``recipe`` (a Recipe, QuantSpec or Plan); a
        :class:`SiteStats` algorithm takes its statistics as ``stats``."""
        arguments = self.arguments(options)
        if isinstance(self.needs, (BlockInputs, ModelLoss)):
            how = "block by block on" if isinstance(self.needs, BlockInputs) else "on the model's loss over"
            raise ValueError(f"algorithm {self.name!r} runs {how} calibration data: run it in a "
                             "recipe (qt.run_steps with a calibrator, bridge.quantize(..., calibration=...))")
        if needs_data(self, options) and stats is None:
            raise ValueError(f"algorithm {self.name!r} needs statistics of activation sites: pass stats=")
        plan = as_plan(recipe, params, types=types)
        flat = dict(_pytree.flatten_with_paths(params)[0])
        fit = self.fn(flat, plan, context=Context(stats=stats, progress=progress), **arguments)
        if not isinstance(fit, Fit):
            raise TypeError(f"algorithm {self.name!r} returned {type(fit).__name__}, not a qtransform.Fit")
        return fit

    def check(self, options: Mapping[str, Any], *, path: str | None = None):
        """Raise ``ValueError``/``TypeError`` naming the option when ``options`` do not fit: its ``options``
        dataclass (:func:`qtransform.algorithms.options.check_options`: names, types, ranges; returns the
        built options) or its ``check_options`` (without either, options are checked when it runs)."""
        if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
            raise TypeError(f"{path + ': ' if path else ''}{self.name}: options must map option names to values, "
                            f"got {options!r}")
        if self.options is not None:
            return _check_options(self.options, options, step=self.name, path=path)
        if self.check_options is not None:
            self.check_options(path=path, **options)
        return None

    def arguments(self, options: Mapping[str, Any], *, path: str | None = None) -> dict:
        """The keywords ``fn`` and the helpers of ``needs`` receive for ``options`` (a recipe step's), checked
        by :meth:`check`: ``{"options": <its options dataclass built>}``, or the options themselves for an
        algorithm without one."""
        built = self.check(options, path=path)
        return {"options": built} if self.options is not None else dict(options)

    def option_fields(self) -> list[tuple[str, str, Any]]:
        """``[(name, type, default)]`` of its options (empty without an ``options`` dataclass)."""
        return option_fields(self.options) if self.options is not None else []


def needs_data(algo: Algorithm, options: Mapping[str, Any]) -> bool:
    """Whether ``algo`` with ``options`` needs calibration data (see :attr:`SiteStats.wanted`)."""
    wanted = getattr(algo.needs, "wanted", None)
    return algo.needs is not None and (wanted is None or bool(wanted(**algo.arguments(options))))


def _check_algorithm(name: str, algo) -> None:
    if not isinstance(algo, Algorithm):
        raise TypeError(f"register_algorithm: expected an Algorithm, got {type(algo).__name__}")
    if algo.needs is not None and not isinstance(algo.needs, (SiteStats, BlockInputs, ModelLoss)):
        raise TypeError(f"register_algorithm {name}: needs must be None, SiteStats, BlockInputs or ModelLoss, got "
                        f"{type(algo.needs).__name__}")


#: The model facts a :class:`~qtransform.Plan` may carry for the steps, and what each is.
FACTS = {"groups": "smoothing groups", "layout": "residual-stream layout"}

#: The registry: algorithm name -> :class:`Algorithm`.
ALGORITHMS = Registry("algorithm", check=_check_algorithm)


def register_algorithm(name: str, fn: Callable, *, needs: SiteStats | BlockInputs | None = None, local: bool = False,
                       check_options: Callable | None = None, description: str = "", requires: Iterable[str] = (),
                       options: type | None = None, outputs: Iterable[str] = (), replace: bool = False) -> Algorithm:
    """Register ``fn`` (see the module docstring) as the step ``name``; returns the :class:`Algorithm`.

    ``options``: the frozen keyword-only dataclass of ``fn``'s options (fields typed, ranges in
    :func:`~qtransform.algorithms.options.option` metadata); recipes are checked with it before any
    work starts, the same way for every algorithm, and ``fn`` receives it built (``options=``).
    ``check_options(*, path=None, **options)``, for algorithms without one (``fn`` receives their options as
    keywords), raises ``ValueError``/``TypeError`` for options ``fn`` does not take. ``requires``
    names the model facts of the :class:`~qtransform.Plan` the step cannot run without (``"groups"``,
    ``"layout"``; an option of the same name, given explicitly, stands in): a plan without them is
    refused before any work. ``outputs`` names the registered kinds of step output (:mod:`.outputs`) it may
    return in :attr:`Fit.outputs`; :func:`~qtransform.run_steps` refuses any other.
    """
    if not callable(fn):
        raise TypeError(f"register_algorithm: fn must be callable, got {type(fn).__name__}")
    if check_options is not None and not callable(check_options):
        raise TypeError(f"register_algorithm: check_options must be callable, got {type(check_options).__name__}")
    if options is not None and (not isinstance(options, type) or not dataclasses.is_dataclass(options)):
        raise TypeError(f"register_algorithm: options must be a dataclass type, got {options!r}")
    if options is not None and check_options is not None:
        raise TypeError("register_algorithm: give options (a dataclass) or check_options, not both")
    if not isinstance(local, bool):
        raise TypeError(f"register_algorithm: local must be a bool, got {local!r}")
    requires = (requires,) if isinstance(requires, str) else tuple(requires)
    bad = [r for r in requires if r not in FACTS]
    if bad:
        raise ValueError(f"register_algorithm {name}: requires must name plan facts among {list(FACTS)}, got {bad}")
    outputs = (outputs,) if isinstance(outputs, str) else tuple(outputs)
    for kind in outputs:
        OUTPUT_KINDS[kind]  # a ValueError listing the registered kinds
    algo = Algorithm(name=name, fn=fn, needs=needs, local=local, check_options=check_options,
                     description=description, requires=requires, options=options, outputs=outputs)
    return ALGORITHMS.register(name, algo, replace=replace)


def get_algorithm(name: str) -> Algorithm:
    """The algorithm registered as ``name``, with a clear error listing the known names."""
    return ALGORITHMS[name]


def check_algorithm_options(name: str, options: Mapping[str, Any], *, path: str | None = None) -> None:
    """Raise ``ValueError``/``TypeError`` naming the option when ``options`` do not fit the
    algorithm ``name`` (its ``check_options``). Without one, options are checked when it runs.

    >>> check_algorithm_options("rtn", {"iters": 3})
    Traceback (most recent call last):
    ...
    ValueError: rtn: unknown option(s) ['iters']; known: ['observer']
    """
    get_algorithm(name).check(options, path=path)

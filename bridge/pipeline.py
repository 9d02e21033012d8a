"""The bridge's pipeline: model -> tree -> plan -> steps (calibrated on the model) -> quantized tree -> modules.

One pipeline serves :func:`quantize`, the command line and the benchmarks; quantize-on-load runs
the same steps one tensor at a time (:mod:`bridge.hf`). Each arrow is a function:
:func:`bridge.extract`, :func:`plan`, :func:`qtransform.quantize_tree` (which runs the recipe's
steps, with a :class:`~bridge.calibrate.ModelCalibrator` for the steps that need data), and
:func:`bridge.to_module`.

>>> import torch, qtransform as qt
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
>>> qmodel = quantize(model, qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)))
>>> [type(m).__name__ for m in qmodel], type(model[0]).__name__
(['QLinear', 'ReLU', 'QLinear'], 'Linear')
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, NamedTuple

from torch import nn

import qtransform as qt

from .calibrate import ModelCalibrator
from .tree import extract, module_types, to_module, weight_paths

__all__ = ["plan", "Quantized", "quantize_params", "quantize"]


def plan(model: nn.Module, recipe) -> qt.Plan:
    """The recipe resolved once for ``model``'s whole tree (with module types, for ``type_rules``).

    Only weights of modules a quantized module can replace (Linear, transformers' Conv1D, Conv2d,
    ConvTranspose2d, Embedding, EmbeddingBag) can be quantized: another tensor that the recipe's
    ``default`` would select is left in full precision (rule ``"skipped (...)"``); one that an
    explicit rule selects is an error naming it.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    given = isinstance(recipe, qt.Plan)  # resolved upstream: checked against this model, not re-resolved
    resolved = qt.as_plan(recipe, extract(model)) if given else qt.as_recipe(recipe).plan(
        extract(model), types=module_types(model))
    quantizable = set(weight_paths(model))
    matches = {}
    for path, m in resolved.items():
        if m.spec is not None and path not in quantizable:
            if given or m.rule != "default":
                what = f"a tensor of a {m.module_type}" if m.module_type else "a tensor"
                raise ValueError(f"{path}: recipe {m.rule} selects {what} that is not the weight of a quantizable "
                                 "module; only the weights of Linear, Conv1D, Conv2d, ConvTranspose2d, Embedding "
                                 "and EmbeddingBag modules can be quantized")
            m = qt.Match(None, "skipped (default: not the weight of a quantizable module)", m.module_type)
        matches[path] = m
    return qt.Plan(resolved.recipe, matches)


class Quantized(NamedTuple):
    """What the pipeline made of a model: the tree before (``params``, the model's own tensors), the
    quantized tree after the steps (``qtree``), and the ``plan``."""

    params: dict
    qtree: dict
    plan: qt.Plan


def quantize_params(model: nn.Module, recipe, *, calibration: Iterable | None = None,
                    qparams: Mapping | None = None, progress: Callable | None = None, generator=None) -> Quantized:
    """Run the pipeline up to the quantized tree (the model is not changed).

    Args:
        model: the float model.
        recipe: a :class:`~qtransform.Recipe` or :class:`~qtransform.QuantSpec` (or a plan of :func:`plan`).
        calibration: batches for the steps that need data (see :class:`~bridge.calibrate.ModelCalibrator`).
        qparams: precomputed quantization parameters by path (paths the steps do not fit).
        progress: ``progress(iterable, desc=..., total=...)``, e.g. ``tqdm.tqdm``.
        generator: ``torch.Generator`` or seed for stochastic rounding.
    """
    p = plan(model, recipe)
    meta = next((path for path, t in extract(model).items() if getattr(t, "is_meta", False)), None)
    if meta is not None:
        raise ValueError(f"{meta}: the model's tensors are on the meta device (no values to quantize); load its "
                         "weights first, or quantize while loading (from_pretrained with a QTransformConfig)")
    if not p.specs:
        raise ValueError(f"the recipe selects no tensor of this {type(model).__name__} to quantize "
                         f"({len(p)} tensors, e.g. {next(iter(p.items()), ('-', ''))[0]!r}: "
                         f"{next(iter(p.values()), qt.Match(None, 'no tensors')).rule})")
    calibrator = None if calibration is None else ModelCalibrator(model, calibration, progress=progress)
    params = extract(model)
    qtree = qt.quantize_tree(params, p, qparams=qparams, calibrator=calibrator, progress=progress, generator=generator)
    return Quantized(params, qtree, p)


def quantize(model: nn.Module, recipe, *, inplace: bool = False, kernel: str = "auto",
             calibration: Iterable | None = None, qparams: Mapping | None = None, progress: Callable | None = None,
             generator=None) -> nn.Module:
    """``extract -> plan -> steps -> quantize_tree -> to_module`` in one call (see :func:`quantize_params`).

    Returns a new model (unquantized tensors the steps left alone are shared with ``model``, not
    copied), or ``model`` itself with ``inplace=True``.
    """
    r = quantize_params(model, recipe, calibration=calibration, qparams=qparams, progress=progress,
                        generator=generator)
    changed: dict[str, Any] = {p: v for p, v in r.qtree.items() if v is not r.params.get(p)}
    return to_module(model, changed, inplace=inplace, kernel=kernel, plan=r.plan)

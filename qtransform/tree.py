"""Whole parameter trees: quantize (running the recipe's steps), dequantize, observe.

>>> import torch, qtransform as qt
>>> params = {"fc.weight": torch.randn(8, 64), "fc.bias": torch.randn(8)}
>>> qtree = qt.quantize_tree(params, qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)))
>>> type(qtree["fc.weight"]).__name__, type(qtree["fc.bias"]).__name__
('QTensor', 'Tensor')
>>> qt.dequantize_tree(qtree)["fc.weight"].shape
torch.Size([8, 64])
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from . import _pytree
from .algorithms import Fit, apply_fit
from .observers import choose_qparams, compute_qparams, init_stats, merge_stats, observe
from .pipeline import Calibrator, run_steps
from .spec import Plan, Recipe, as_plan
from .tensor import QParams, QTensor, conform_qparams, dequantize, quantize
from .tensor.checks import check_out_dtype

__all__ = ["quantize_tree", "dequantize_tree", "observe_tree", "merge_stats_tree", "qparams_tree",
           "is_qtensor", "flatten_tree"]


def is_qtensor(x) -> bool:
    return isinstance(x, QTensor)


def flatten_tree(tree: Any) -> dict[str, Any]:
    """``{dotted path: leaf}`` of a (possibly nested) tree, QTensor leaves kept whole.

    >>> import torch, qtransform as qt
    >>> sorted(qt.flatten_tree({"a": {"w": torch.ones(1)}, "b": [torch.ones(1)]}))
    ['a.w', 'b.0']
    """
    return dict(_pytree.flatten_with_paths(tree, is_leaf=is_qtensor)[0])


def quantize_tree(params: Any, recipe: Recipe | Any, *, qparams: Mapping[str, QParams] | None = None,
                  types: Mapping[str, str] | None = None, calibrator: Calibrator | None = None,
                  progress: Callable | None = None, generator=None, with_info: bool = False) -> Any:
    """Run the recipe's steps, then quantize every leaf the recipe selects.

    Args:
        params: a tree of tensors (a state dict, nested dicts, lists...).
        recipe: a :class:`Recipe`, a single :class:`QuantSpec` (applied as the default), or a
            :class:`Plan` already resolved for ``params``.
        qparams: precomputed parameters by path (e.g. from calibration); other selected paths
            get what the steps fitted, or round to nearest from their min/max.
        types: module type name by path, for ``Recipe.type_rules``.
        calibrator: runs the model for steps that need calibration data (see :func:`run_steps`).
        progress: progress wrapper handed to the steps (``tqdm.tqdm``).
        generator: ``torch.Generator`` or int seed for stochastic rounding.
        with_info: also return the steps' combined :class:`Fit`: ``(tree, fit)``, with what they
            reported (``fit.info``: ``{path: {name: value}}``, GPTQ's layer losses, SmoothQuant's
            α...) and the online rotations the tree expects at run time (``fit.online``).

    Returns:
        A tree of the same structure with :class:`QTensor` leaves where quantized and the tensors
        the steps changed (a smoothed norm, say) in place. Errors name the path; the input tree
        is never modified.
    """
    plan = as_plan(recipe, params, types=types)
    if qparams is not None and not isinstance(qparams, Mapping):
        raise TypeError(f"quantize_tree: qparams must map tree paths to QParams, got {type(qparams).__name__}")
    given = dict(qparams or {})
    keys = [p for p in given if not isinstance(p, str)]
    if keys:
        raise TypeError(f"quantize_tree: qparams must be keyed by tree paths (str), got the key {keys[0]!r}")
    bad = [p for p, q in given.items() if not isinstance(q, QParams)]
    if bad:
        raise TypeError(f"quantize_tree: qparams[{bad[0]!r}] must be a QParams, got {type(given[bad[0]]).__name__}")
    unknown = sorted(set(given) - set(plan))
    if unknown:
        raise ValueError(f"quantize_tree: qparams given for paths not in the tree: {unknown[:5]}")
    for path, qp in given.items():  # checked before any step runs
        match = plan[path]
        if match.spec is None:
            raise ValueError(f"{path}: qparams given but the recipe leaves this path unquantized ({match.rule})")
        if qp.spec != match.spec:
            raise ValueError(f"{path}: qparams were made for {qp.spec}, the recipe asks for {match.spec}")
    if given:  # in the form their specs store (cast where exact): what is quantized here can be saved and reloaded
        shapes = {p: leaf.shape for p, leaf in _pytree.flatten_with_paths(params)[0] if p in given}
        given = {p: conform_qparams(qp, shapes[p], path=p) for p, qp in given.items()}
    fit = run_steps(params, plan, calibrator=calibrator, progress=progress, qparams=given) if plan.steps else Fit()
    clash = sorted(set(given) & (set(fit.qparams) | set(fit.params)))
    if clash:
        raise ValueError(f"quantize_tree: qparams given for {clash[:5]}, which the recipe's steps also fit")
    fitted = {**fit.qparams, **given}

    def one(path: str, leaf):
        match = plan.get(path)
        if match is None or match.spec is None:
            return leaf
        qp = fitted.get(path)
        if qp is None:
            qp = choose_qparams(leaf, match.spec, path=path)
        return quantize(leaf, qp, generator=generator, path=path)

    if not isinstance(with_info, bool):
        raise TypeError(f"quantize_tree: with_info must be True or False, got {with_info!r}")
    out = _pytree.map_with_path(one, apply_fit(params, fit))
    return (out, fit) if with_info else out


def dequantize_tree(qtree: Any, *, dtype: torch.dtype | None = None) -> Any:
    """Replace every :class:`QTensor` leaf by its dequantized tensor (in ``dtype``, a floating dtype, if given)."""
    if dtype is not None:
        check_out_dtype(dtype, name="dequantize_tree: dtype")
    return _pytree.tree_map(lambda x: dequantize(x, dtype=dtype) if is_qtensor(x) else x, qtree,
                          is_leaf=is_qtensor)


def observe_tree(stats: Mapping[str, Any] | None, tensors: Mapping[str, torch.Tensor],
                 recipe: Recipe | Any, *, observer=None, **options) -> dict[str, Any]:
    """Fold a batch of named tensors (e.g. captured activations) into per-path range statistics.

    ``stats`` is ``None`` for the first batch. Paths the recipe leaves unquantized are skipped.
    ``observer`` (default ``minmax``) and ``options`` as for :func:`~qtransform.init_stats`.
    """
    tensors = dict(tensors)
    if isinstance(recipe, Plan):
        unknown = sorted(set(tensors) - set(recipe))
        if unknown:
            raise ValueError(f"observe_tree: tensors for paths not in the plan: {unknown[:5]}")
        specs = {p: s for p, s in recipe.specs.items() if p in tensors}
    else:
        specs = as_plan(recipe, tensors).specs
    out = dict(stats or {})
    for path, spec in specs.items():
        prev = out.get(path)
        if prev is None:
            prev = init_stats(spec, observer=observer, **options)
        out[path] = observe(prev, tensors[path], path=path)
    return out


def merge_stats_tree(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Merge two per-path statistics dicts (e.g. from two processes)."""
    out = dict(a)
    for path, s in b.items():
        out[path] = merge_stats(out[path], s, path=path) if path in out else s
    return out


def qparams_tree(stats: Mapping[str, Any]) -> dict[str, QParams]:
    """``compute_qparams`` for every path of a statistics dict."""
    return {path: compute_qparams(s, path=path) for path, s in stats.items()}

"""Tree transforms: quantize, dequantize and observe whole parameter trees.

>>> import torch, qtransform as qt
>>> params = {"fc.weight": torch.randn(8, 64), "fc.bias": torch.randn(8)}
>>> qtree = qt.quantize_tree(params, qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)))
>>> type(qtree["fc.weight"]).__name__, type(qtree["fc.bias"]).__name__
('QTensor', 'Tensor')
>>> qt.dequantize_tree(qtree)["fc.weight"].shape
torch.Size([8, 64])
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from . import _tree
from .observe import init_stats, merge_stats, observe
from .qparams import choose_qparams, compute_qparams
from .qtypes import QParams, QTensor
from .quantize import dequantize, quantize
from .recipe import Recipe, as_recipe

__all__ = ["quantize_tree", "dequantize_tree", "observe_tree", "merge_stats_tree",
           "qparams_tree", "is_qtensor"]


def is_qtensor(x) -> bool:
    return isinstance(x, QTensor)


def quantize_tree(params: Any, recipe: Recipe | Any, *, qparams: Mapping[str, QParams] | None = None,
                  types: Mapping[str, str] | None = None, generator=None) -> Any:
    """Quantize every leaf the recipe selects; other leaves are returned as they are.

    Args:
        params: a tree of tensors (a state dict, nested dicts, lists...).
        recipe: a :class:`Recipe` or a single :class:`QuantSpec` (applied as the default).
        qparams: precomputed parameters by path (from calibration or an algorithm such as
            HQQ or GPTQ); other selected paths are fitted to the tensor itself.
        types: module type name by path, for ``Recipe.type_rules``.
        generator: ``torch.Generator`` or int seed for stochastic rounding.

    Returns:
        A tree of the same structure with :class:`QTensor` leaves where quantized. Errors name
        the path; the input tree is never modified.
    """
    recipe = as_recipe(recipe)
    plan = recipe.plan(params, types=types)
    qparams = dict(qparams or {})
    unknown = sorted(set(qparams) - set(plan))
    if unknown:
        raise ValueError(f"quantize_tree: qparams given for paths not in the tree: {unknown[:5]}")

    def one(path: str, leaf):
        match = plan.get(path)
        if match is None or match.spec is None:
            if path in qparams:
                raise ValueError(f"{path}: qparams given but the recipe leaves this path unquantized "
                                 f"({match.rule if match else 'not a tensor'})")
            return leaf
        qp = qparams.get(path)
        if qp is None:
            qp = choose_qparams(leaf, match.spec, path=path)
        elif qp.spec != match.spec:
            raise ValueError(f"{path}: qparams were made for {qp.spec}, the recipe asks for {match.spec}")
        return quantize(leaf, qp, generator=generator, path=path)

    return _tree.map_with_path(one, params)


def dequantize_tree(qtree: Any, *, dtype: torch.dtype | None = None) -> Any:
    """Replace every :class:`QTensor` leaf by its dequantized tensor."""
    return _tree.tree_map(lambda x: dequantize(x, dtype=dtype) if is_qtensor(x) else x, qtree,
                          is_leaf=is_qtensor)


def observe_tree(stats: Mapping[str, Any] | None, tensors: Mapping[str, torch.Tensor],
                 recipe: Recipe | Any) -> dict[str, Any]:
    """Fold a batch of named tensors (e.g. captured activations) into per-path statistics.

    ``stats`` is ``None`` for the first batch. Paths the recipe leaves unquantized are skipped.
    """
    recipe = as_recipe(recipe)
    out = dict(stats or {})
    for path, match in recipe.plan(dict(tensors)).items():
        if match.spec is None:
            continue
        prev = out.get(path, init_stats(match.spec))
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

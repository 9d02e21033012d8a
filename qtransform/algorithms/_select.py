"""Which leaves of a parameter tree an algorithm works on (shared by every algorithm)."""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Iterable, Mapping

import torch

from .. import _tree
from ..recipe import as_recipe
from ..spec import QuantSpec

__all__ = ["select"]


def select(params: Any, recipe, *, types: Mapping[str, str] | None = None,
           paths: Iterable[str] | None = None, accept: Callable[[QuantSpec], bool] = lambda s: True,
           progress: Callable | None = None) -> Iterable[tuple[str, torch.Tensor, QuantSpec]]:
    """``(path, tensor, spec)`` for every leaf the recipe quantizes with a spec ``accept`` takes.

    ``paths`` (globs) narrows the selection; ``progress`` (e.g. ``tqdm.tqdm``) wraps the result.
    """
    recipe = as_recipe(recipe)
    if isinstance(paths, str):
        paths = [paths]
    globs = None if paths is None else list(paths)
    if globs is not None and any(not isinstance(g, str) for g in globs):
        raise TypeError(f"paths must be glob strings, got {globs!r}")
    leaves = dict(_tree.flatten_with_paths(params)[0])
    chosen = [
        (path, leaves[path], m.spec) for path, m in recipe.plan(params, types=types).items()
        if m.spec is not None and accept(m.spec)
        and (globs is None or any(fnmatch.fnmatchcase(path, g) for g in globs))
    ]
    return progress(chosen) if progress is not None else chosen

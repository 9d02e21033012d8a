"""Which leaves of a plan an algorithm works on (shared by the algorithms)."""

from __future__ import annotations

import fnmatch
from typing import Callable, Iterable, Mapping

import torch

from ..spec import Plan, QuantSpec

__all__ = ["select"]


def select(params: Mapping[str, torch.Tensor], plan: Plan, *, paths: Iterable[str] | None = None,
           accept: Callable[[QuantSpec], bool] = lambda s: True,
           progress: Callable | None = None, desc: str = "") -> Iterable[tuple[str, torch.Tensor, QuantSpec]]:
    """``(path, tensor, spec)`` for every path ``plan`` quantizes with a spec ``accept`` takes.

    ``params`` is the flat tree; ``paths`` (globs) narrows the selection; ``progress`` (e.g.
    ``tqdm.tqdm``) wraps the result.
    """
    if isinstance(paths, str):
        paths = [paths]
    globs = None if paths is None else list(paths)
    if globs is not None and any(not isinstance(g, str) for g in globs):
        raise TypeError(f"paths must be glob strings, got {globs!r}")
    chosen = [(path, params[path], spec) for path, spec in plan.specs.items()
              if accept(spec) and (globs is None or any(fnmatch.fnmatchcase(path, g) for g in globs))]
    return progress(chosen, desc=desc, total=len(chosen)) if progress is not None else chosen

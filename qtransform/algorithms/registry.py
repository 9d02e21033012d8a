"""Algorithms by name, for recipes and the command line.

An algorithm is ``fn(params, recipe, *, types=None, paths=None, progress=None, **options)
-> {path: QParams}``: it computes parameters for the paths it handles, and
``qt.quantize_tree(params, recipe, qparams=...)`` quantizes with them (every other selected
path gets round-to-nearest there). Registered: ``"rtn"`` (round-to-nearest from the spec's
observer) and ``"hqq"`` (:func:`qtransform.algorithms.hqq.qparams_tree`).

>>> import torch, qtransform as qt
>>> from qtransform.algorithms import ALGORITHMS, get_algorithm
>>> sorted(ALGORITHMS)
['hqq', 'rtn']
>>> spec = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False,
...                     zero_point_domain="float")
>>> params = {"fc.weight": torch.randn(4, 64)}
>>> qps = get_algorithm("hqq")(params, spec, iters=5)
>>> qtree = qt.quantize_tree(params, spec, qparams=qps)
"""

from __future__ import annotations

import types as _types
from typing import Any, Callable, Iterable, Mapping

from ..qparams import choose_qparams
from ..qtypes import QParams
from . import hqq
from ._select import select

__all__ = ["ALGORITHMS", "register_algorithm", "get_algorithm", "check_algorithm_options", "rtn_qparams_tree"]


def rtn_qparams_tree(params: Any, recipe, *, types: Mapping[str, str] | None = None,
                     paths: Iterable[str] | None = None, progress: Callable | None = None) -> dict[str, QParams]:
    """Round-to-nearest parameters (``choose_qparams``) for every path the recipe quantizes."""
    return {path: choose_qparams(w, spec, path=path)
            for path, w, spec in select(params, recipe, types=types, paths=paths, progress=progress)}


def _no_options(*, path: str | None = None, **options) -> None:
    if options:
        raise ValueError(f"{path + ': ' if path else ''}algorithm 'rtn' takes no options, got {sorted(options)}")


_REGISTRY: dict[str, Callable] = {"rtn": rtn_qparams_tree, "hqq": hqq.qparams_tree}
#: name -> ``check(*, path=None, **options)`` raising on options the algorithm does not take.
_CHECKS: dict[str, Callable] = {"rtn": _no_options, "hqq": hqq.check_options}

#: Read-only view: algorithm name -> ``fn(params, recipe, **options) -> {path: QParams}``.
ALGORITHMS: Mapping[str, Callable] = _types.MappingProxyType(_REGISTRY)


def register_algorithm(name: str, fn: Callable, *, replace: bool = False,
                       check_options: Callable | None = None) -> Callable:
    """Add ``fn`` under ``name`` (``replace=True`` to overwrite). Returns ``fn``.

    ``check_options(*, path=None, **options)``, when given, raises ``ValueError``/``TypeError``
    for options ``fn`` does not take; :func:`check_algorithm_options` calls it before any work.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_algorithm: name must be a non-empty string, got {name!r}")
    if not callable(fn):
        raise TypeError(f"register_algorithm: fn must be callable, got {type(fn).__name__}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"register_algorithm: {name!r} is already registered (pass replace=True)")
    if check_options is not None and not callable(check_options):
        raise TypeError(f"register_algorithm: check_options must be callable, got {type(check_options).__name__}")
    _REGISTRY[name] = fn
    _CHECKS.pop(name, None)
    if check_options is not None:
        _CHECKS[name] = check_options
    return fn


def check_algorithm_options(name: str, options: Mapping[str, Any], *, path: str | None = None) -> None:
    """Raise ``ValueError``/``TypeError`` naming the option when ``options`` do not fit the
    algorithm ``name``: the ``check_options`` it was registered with (``"rtn"`` takes none;
    ``"hqq"``: :func:`hqq.check_options`). Without one, options are checked when it is called.

    >>> check_algorithm_options("rtn", {"iters": 3})
    Traceback (most recent call last):
    ...
    ValueError: algorithm 'rtn' takes no options, got ['iters']
    """
    get_algorithm(name)
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise TypeError(f"{path + ': ' if path else ''}algorithm options must map option names to values, "
                        f"got {options!r}")
    check = _CHECKS.get(name)
    if check is not None:
        check(path=path, **options)


def get_algorithm(name: str) -> Callable:
    """The algorithm registered as ``name``, with a clear error listing the known names."""
    if not isinstance(name, str):
        raise TypeError(f"algorithm must be a name (str), got {type(name).__name__}")
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None

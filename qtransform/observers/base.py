"""Observers: statistics of tensors as pure folds, registered by name.

An observer is a frozen dataclass holding its options, with four pure functions:

* ``init(spec)`` -> empty statistics (a pytree: tensor leaves, ``spec`` and the observer
  itself as static context; ``None`` fields before the first batch);
* ``batch(stats, x)`` -> the statistics of one batch alone, folded in by ``update`` =
  ``merge(stats, batch(stats, x))``;
* ``merge(a, b)`` -> combined statistics: associative and commutative, with the empty
  statistics as identity, so folds split across batches, processes and machines combine;
* ``finalize(stats)`` -> what the statistics are for (a ``(lo, hi)`` range per block, a
  Hessian, per-channel magnitudes...).

Each observer also declares how its fields reduce across processes (``reduction``:
``"sum"``, ``"max"``, ``"min"``, or ``"merge"`` for fields that must be gathered and merged,
such as histograms), ready for ``torch.distributed``. Range observers (``minmax``,
``percentile``, ``mse``) are tied to a :class:`~qtransform.QuantSpec` and feed
:func:`~qtransform.compute_qparams`; others (``hessian``, ``channel``) need none. A new observer
is one file: subclass :class:`Observer`, decorate with :func:`register_observer`, and the
property tests of the merge laws pick it up.

>>> import torch, qtransform as qt
>>> spec = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
>>> s = qt.observe(qt.init_stats(spec), torch.tensor([[1.0, -2.0], [0.5, 4.0]]))
>>> s = qt.observe(s, torch.tensor([[3.0, 0.0], [0.0, 0.0]]))
>>> s.min.flatten().tolist(), s.max.flatten().tolist()
([-2.0, 0.0], [3.0, 4.0])
>>> h = qt.observe(qt.init_stats(observer="hessian"), torch.ones(4, 3))
>>> qt.finalize_stats(h).tolist()[0], int(h.count)
([1.0, 1.0, 1.0], 4)
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, Mapping

import torch

from .. import _pytree
from .._checks import check_float_tensor, func_differentiated, where
from ..registry import Registry
from ..spec import QuantSpec

__all__ = ["Observer", "OBSERVERS", "REDUCTIONS", "register_observer", "make_observer", "init_stats",
           "observe", "merge_stats", "finalize_stats", "is_empty"]

#: How a statistics field combines across processes.
REDUCTIONS = ("sum", "max", "min", "merge")


class Observer(abc.ABC):
    """Base of the observers (subclasses are frozen, keyword-only dataclasses of options).

    Class attributes: ``name`` (registry key), ``reduction`` (``{field: one of REDUCTIONS}``),
    ``needs_spec`` (statistics per block of a QuantSpec's granularity), ``gives_range``
    (``finalize`` returns ``(lo, hi)`` grids for :func:`~qtransform.compute_qparams`).
    """

    name: ClassVar[str]
    reduction: ClassVar[Mapping[str, str]]
    needs_spec: ClassVar[bool] = False
    gives_range: ClassVar[bool] = False

    @abc.abstractmethod
    def init(self, spec: QuantSpec | None = None):
        """Empty statistics."""

    @abc.abstractmethod
    def batch(self, stats, x: torch.Tensor, *, path: str | None = None):
        """The statistics of the batch ``x`` alone (``stats`` gives the static context)."""

    @abc.abstractmethod
    def merge(self, a, b, *, path: str | None = None):
        """Both statistics combined (both non-empty, same observer and spec)."""

    @abc.abstractmethod
    def finalize(self, stats, *, path: str | None = None) -> Any:
        """The result the statistics are for."""

    def update(self, stats, x: torch.Tensor, *, path: str | None = None, donate: bool = False):
        """``stats`` with the batch ``x`` folded in (pure: neither input changes; with ``donate=True`` the caller
        gives ``stats`` up, and an observer may build the result in its buffers, as JAX's donated arguments)."""
        return merge_stats(stats, self.batch(stats, x, path=path), path=path)

    def range(self, stats, spec: QuantSpec, *, path: str | None = None):
        """Range observers: grid-shaped ``(lo, hi)`` to quantize with ``spec``."""
        raise TypeError(f"{where(path)}the {self.name} observer gives no quantization range")


def _check_observer(name: str, cls) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Observer)):
        raise TypeError(f"register_observer: expected an Observer subclass, got {cls!r}")
    bad = {k: v for k, v in dict(getattr(cls, "reduction", {})).items() if v not in REDUCTIONS}
    if bad or not getattr(cls, "reduction", None):
        raise ValueError(f"register_observer: {name}.reduction must map every statistics field to one of "
                         f"{list(REDUCTIONS)}, got {getattr(cls, 'reduction', None)!r}")


#: The registry: observer name -> Observer subclass.
OBSERVERS = Registry("observer", check=_check_observer)


def register_observer(cls: type, *, replace: bool = False) -> type:
    """Register an :class:`Observer` subclass under ``cls.name`` (usable as a class decorator)."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_observer: {getattr(cls, '__name__', cls)!r} needs a class attribute `name` "
                         f"(a non-empty string: the name recipes use), got {name!r}")
    OBSERVERS.register(name, cls, replace=replace)
    return cls


def make_observer(observer=None, **options) -> Observer:
    """An observer instance from a name (``"percentile"``) with ``options``, a dict
    ``{"name": ..., **options}``, or an instance (then no options). ``None`` is ``minmax``.

    >>> import qtransform as qt
    >>> qt.make_observer("percentile", percentile=99.9)
    Percentile(bins=2048, percentile=99.9)
    """
    if isinstance(observer, Observer):
        if options:
            raise ValueError(f"observer options {sorted(options)} given with an observer instance")
        return observer
    if isinstance(observer, Mapping):
        d = dict(observer)
        name = d.pop("name", None)
        clash = sorted(set(d) & set(options))
        if clash:
            raise ValueError(f"observer option(s) {clash} given twice")
        return make_observer(name if name is not None else "minmax", **d, **options)
    name = "minmax" if observer is None else observer
    cls = OBSERVERS[name]
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"observer {name!r}: unknown option(s) {unknown}; known: {sorted(fields)}")
    return cls(**options)


def is_empty(stats) -> bool:
    """No batch observed yet (every tensor field is ``None``)."""
    return not _pytree.tree_leaves(stats)


def _check_stats(stats, what: str, path) -> None:
    if not isinstance(getattr(stats, "observer", None), Observer):
        raise TypeError(f"{where(path)}{what}: stats must come from init_stats/observe, got {type(stats).__name__}")


def init_stats(spec: QuantSpec | None = None, *, observer=None, **options):
    """Empty statistics of ``observer`` (a name, dict or instance; ``minmax`` by default) for ``spec``.

    Range observers need the :class:`~qtransform.QuantSpec` whose blocks they summarize; the
    others take none. ``options`` go to the observer (``percentile=99.9``, ``bins=1024``...).
    """
    if spec is not None and not isinstance(spec, QuantSpec):
        raise TypeError(f"init_stats: spec must be a QuantSpec or None, got {type(spec).__name__}")
    if spec is None and observer is None:
        raise ValueError("init_stats: give a QuantSpec (range observers) or an observer name")
    obs = make_observer(observer, **options)
    if obs.needs_spec and spec is None:
        raise ValueError(f"init_stats: the {obs.name} observer summarizes the blocks of a QuantSpec; pass spec=")
    return obs.init(spec if obs.needs_spec else None)


def observe(stats, x: torch.Tensor, *, path: str | None = None, donate: bool = False):
    """Fold one batch ``x`` into ``stats`` (returns new statistics; inputs unchanged).

    Range statistics are kept per block of the spec's granularity, so their grid must agree
    between batches (per-tensor and per-channel activation stats do for any batch size).
    ``donate=True``: the caller will not use ``stats`` again (a fold over its own statistics), so the
    result may reuse its buffers (the ``hessian`` observer adds each batch in place: no second
    ``(in, in)`` float64 matrix). Never donate statistics someone else holds.
    """
    _check_stats(stats, "observe", path)
    check_float_tensor(x, path=path)
    if func_differentiated(x):
        raise ValueError(f"{where(path)}observe: torch.func differentiates x, but statistics and the parameters "
                         "fitted from them (choose_qparams, compute_qparams) carry no gradient; pass x.detach() "
                         "to fit parameters without one (under autograd, statistics of a tensor that requires grad "
                         "are taken detached, as every observer's), or learn them: qt.fake_quantize(x, qparams, "
                         "range_grad=True) (the scale following x's range), qtransform.learn.fake_quantize "
                         "(learned ranges)")
    if donate:
        return stats.observer.update(stats, x, path=path, donate=True)
    return stats.observer.update(stats, x, path=path)


def merge_stats(a, b, *, path: str | None = None):
    """Combine two statistics of the same observer and spec (associative and commutative)."""
    _check_stats(a, "merge_stats", path)
    _check_stats(b, "merge_stats", path)
    if type(a) is not type(b) or a.observer != b.observer:
        raise TypeError(f"{where(path)}merge_stats: cannot merge statistics of {a.observer} with {b.observer}")
    if a.spec != b.spec:
        raise ValueError(f"{where(path)}merge_stats: statistics of different specs ({a.spec} vs {b.spec})")
    if is_empty(a):
        return b
    if is_empty(b):
        return a
    return a.observer.merge(a, b, path=path)


def finalize_stats(stats, *, path: str | None = None):
    """What the statistics are for: ``(lo, hi)`` grids of a range observer, a Hessian, per-channel
    magnitudes... (see each observer)."""
    _check_stats(stats, "finalize_stats", path)
    if is_empty(stats):
        raise ValueError(f"{where(path)}finalize_stats: no data observed yet (call observe first)")
    return stats.observer.finalize(stats, path=path)

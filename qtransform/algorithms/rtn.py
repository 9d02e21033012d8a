"""``rtn``: round to nearest, with the quantization range chosen by an observer.

Each selected tensor gets ``choose_qparams(w, spec, observer=...)``: ``minmax`` (default,
clips nothing), ``percentile`` or ``mse`` (:mod:`qtransform.observers`). A recipe without
steps quantizes this way with ``minmax``.

>>> import torch, qtransform as qt
>>> w = torch.cat([torch.linspace(-1, 1, 63), torch.tensor([9.0])]).reshape(1, 64)
>>> spec = qt.QuantSpec(format="int4", granularity=qt.PerChannel(0))
>>> mse = qt.get_algorithm("rtn")({"fc.weight": w}, spec, observer="mse").qparams["fc.weight"]
>>> bool(mse.scale < qt.choose_qparams(w, spec).scale)  # the outlier is clipped
True
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..observers import choose_qparams, make_observer
from .base import Fit, register_algorithm
from .options import option, options_checker, received

__all__ = ["step", "Options", "check_options", "check_range_observer"]


def check_range_observer(value, at: str | None = None) -> None:
    """``ValueError`` (prefixed ``at: `` when given) unless ``value`` makes an observer that gives a
    quantization range."""
    pre = f"{at}: " if at else ""
    try:
        obs = make_observer(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{pre}observer: {e}") from None
    if not obs.gives_range:
        raise ValueError(f"{pre}observer {obs.name!r} gives no quantization range (use minmax, percentile or mse)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """``rtn``'s options: ``observer``, a name (``"mse"``), a dict ``{"name": ..., **options}`` or an
    observer instance (default ``"minmax"``)."""

    observer: Any = option(None, doc="the range observer: minmax, percentile, mse or {name: ..., ...}")

    def __post_init__(self):
        if self.observer is not None:
            check_range_observer(self.observer)


check_options = options_checker("rtn", Options)


def step(params, plan, *, context, options: Options) -> Fit:
    """Round-to-nearest parameters for every path the plan quantizes."""
    obs = make_observer(received(Options, options, step="rtn").observer)
    return Fit(qparams={path: choose_qparams(params[path], spec, observer=obs, path=path)
                        for path, spec in context.track(plan.specs.items(), desc="rtn")})


register_algorithm("rtn", step, local=True, options=Options,
                   description="round to nearest (observer: minmax, percentile or mse)")

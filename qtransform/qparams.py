"""``compute_qparams``: statistics -> quantization parameters.

>>> import torch, qtransform as qt
>>> spec = qt.QuantSpec(format="uint8", symmetric=False)
>>> qp = qt.compute_qparams(qt.observe(qt.init_stats(spec), torch.tensor([-1.0, 3.0])), spec)
>>> round(qp.scale.item(), 6), qp.zero_point.item()
(0.015686, 64)
"""

from __future__ import annotations

from ._checks import where
from .observe import init_stats, observe
from .qtypes import HistogramStats, MinMaxStats, QParams
from .scales import from_range
from .search import mse_range, percentile_range
from .spec import QuantSpec

__all__ = ["compute_qparams", "choose_qparams"]


def compute_qparams(stats, spec: QuantSpec | None = None, *, path: str | None = None) -> QParams:
    """Quantization parameters from observed statistics.

    ``spec`` defaults to the spec the statistics were made with; a different spec must
    use the same granularity and observer (e.g. another format or scale dtype).
    """
    if not isinstance(stats, (MinMaxStats, HistogramStats)):
        raise TypeError(f"{where(path)}compute_qparams: stats must come from init_stats/observe, "
                        f"got {type(stats).__name__}")
    spec = stats.spec if spec is None else spec
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"{where(path)}compute_qparams: spec must be a QuantSpec, got {type(spec).__name__}")
    if stats.min is None:
        raise ValueError(f"{where(path)}compute_qparams: no data observed yet (call observe first)")
    if spec.granularity != stats.spec.granularity or spec.observer != stats.spec.observer:
        raise ValueError(f"{where(path)}compute_qparams: statistics were gathered for {stats.spec.granularity} "
                         f"with the {stats.spec.observer} observer; spec asks for {spec.granularity} with "
                         f"{spec.observer}")
    if spec.observer == "minmax":
        lo, hi = stats.min, stats.max
    elif spec.observer == "percentile":
        lo, hi = percentile_range(stats, spec)
    else:
        lo, hi = mse_range(stats, spec)
    return from_range(lo, hi, spec, path=path)


def choose_qparams(x, spec: QuantSpec, *, path: str | None = None) -> QParams:
    """Quantization parameters fitted to ``x`` alone (weights, dynamic activations)."""
    return compute_qparams(observe(init_stats(spec), x, path=path), spec, path=path)

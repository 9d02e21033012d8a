"""``compute_qparams``: range statistics -> quantization parameters; ``choose_qparams`` for one tensor.

>>> import torch, qtransform as qt
>>> spec = qt.QuantSpec(format="uint8", symmetric=False)
>>> qp = qt.compute_qparams(qt.observe(qt.init_stats(spec), torch.tensor([-1.0, 3.0])), spec)
>>> round(qp.scale.item(), 6), qp.zero_point.item()
(0.015686, 64)
>>> x = torch.cat([torch.linspace(0, 1, 999), torch.tensor([100.0])])
>>> qp = qt.choose_qparams(x, spec, observer="percentile", percentile=99.0)
>>> round(qp.scale.item() * 255, 2)  # 99% of the values kept: the outlier is clipped
1.0
"""

from __future__ import annotations

from .._checks import where
from ..spec import QuantSpec
from ..tensor import QParams
from .base import init_stats, is_empty, observe

__all__ = ["compute_qparams", "choose_qparams"]


def compute_qparams(stats, spec: QuantSpec | None = None, *, path: str | None = None) -> QParams:
    """Quantization parameters from the statistics of a range observer (``minmax``, ``percentile``,
    ``mse``).

    ``spec`` defaults to the spec the statistics were made with; a different spec must use the
    same grid (granularity, padding, micro-exponent sub-block), e.g. another format or scale
    dtype: the MSE search scores its candidates with the spec given here.
    """
    observer = getattr(stats, "observer", None)
    if observer is None or not hasattr(observer, "gives_range"):
        raise TypeError(f"{where(path)}compute_qparams: stats must come from init_stats/observe, "
                        f"got {type(stats).__name__}")
    if not observer.gives_range:
        raise TypeError(f"{where(path)}compute_qparams: the {observer.name} observer gives no quantization "
                        "range; use qt.finalize_stats for its result")
    spec = stats.spec if spec is None else spec
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"{where(path)}compute_qparams: spec must be a QuantSpec, got {type(spec).__name__}")
    if is_empty(stats):
        raise ValueError(f"{where(path)}compute_qparams: no data observed yet (call observe first)")
    grid = lambda s: (s.granularity, s.pad, s.fmt.sub_block)  # noqa: E731  what the statistics' shape follows
    if grid(spec) != grid(stats.spec):
        raise ValueError(f"{where(path)}compute_qparams: statistics were gathered on another grid "
                         f"({stats.spec.granularity}, pad={stats.spec.pad}, sub-block {stats.spec.fmt.sub_block}); "
                         f"spec asks for ({spec.granularity}, pad={spec.pad}, sub-block {spec.fmt.sub_block})")
    lo, hi = observer.range(stats, spec, path=path)
    return QParams.from_range(lo, hi, spec, path=path)


def choose_qparams(x, spec: QuantSpec, *, observer=None, path: str | None = None, **options) -> QParams:
    """Quantization parameters fitted to ``x`` alone (weights, dynamic activations).

    ``observer`` (default ``"minmax"``) and its ``options`` choose the range, as for
    :func:`~qtransform.init_stats`.
    """
    return compute_qparams(observe(init_stats(spec, observer=observer, **options), x, path=path), spec, path=path)

"""Choosing smoothing scales on calibration data: the quantized layer output error of candidates.

For a :class:`~qtransform.algorithms.smoothing.SmoothGroup` with input rows ``X`` (``(N, C)``, what
enters its linears) and candidate scales ``S`` (``(A, prev)``, one row per candidate), the error of
candidate ``a`` is the squared error of the group's outputs when activations and weights are both
fake-quantized after smoothing, against the float outputs:

    ``err[a] = sum over linears ‖ Qa(X / s_a) · Qw(W · diag(s_a))ᵀ − X · Wᵀ ‖²``

``Qw`` is each weight's spec (the plan's; ``None``: not quantized), ``Qa`` the activation spec. A
static activation spec's range is the range of *all* calibration rows (``lo``/``hi`` per channel,
divided by ``s``), as a calibrated static quantizer would see it, while the error is measured on a
sample of rows; a dynamic spec fits each row sample itself (per token, per tensor...).

:func:`sample_stats` are empty statistics of a fold that keeps every ``stride``-th row of each
batch and the per-channel range of all rows (an observer for ``Block.site_stats``; its merge
concatenates samples, so it is not registered among the commutative observers).

>>> import torch, qtransform as qt
>>> from qtransform.algorithms.smoothing import SmoothGroup
>>> x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)); x[:, 3] *= 100
>>> params = {"n.weight": torch.ones(8), "fc.weight": torch.randn(16, 8, generator=torch.Generator().manual_seed(1))}
>>> stats = qt.finalize_stats(qt.observe(sample_stats(1), x))
>>> cand = torch.stack([torch.ones(8), x.abs().amax(0).sqrt()])  # no smoothing; alpha = 0.5 without weights
>>> err = layer_errors(stats, params, SmoothGroup("n", ("fc",)), cand, activation=qt.QuantSpec(format="int8"),
...                    weight_specs={"fc": qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))})
>>> bool(err[1] < err[0])
True
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, NamedTuple

import torch

from .._checks import check_finite, where
from .._tree import pytree_dataclass
from ..granularity import PerChannel, PerTensor
from ..observers import Observer, choose_qparams
from ..spec import QuantSpec
from ..tensor import fake_quantize
from .smoothing import SmoothGroup, group_shape, logical_weight, to_input

__all__ = ["RowSample", "RowSampleStats", "Rows", "sample_stats", "check_activation", "layer_errors"]


@pytree_dataclass(static=("spec", "observer"))
class RowSampleStats:
    """``rows`` (sampled, float32 ``(n, C)``), per-channel ``lo``/``hi`` over all rows, ``count`` rows seen."""

    rows: torch.Tensor | None = None
    lo: torch.Tensor | None = None
    hi: torch.Tensor | None = None
    count: torch.Tensor | None = None
    spec: QuantSpec | None = None
    observer: Observer | None = None


class Rows(NamedTuple):
    """A finalized sample: ``rows`` ``(n, C)`` and the range ``lo``/``hi`` ``(C,)`` of every row seen."""

    rows: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowSample(Observer):
    """Every ``stride``-th row (features along the last axis) of each batch, and the range of all rows."""

    stride: int = 1

    name = "row_sample"
    reduction = {"rows": "merge", "lo": "min", "hi": "max", "count": "sum"}

    def __post_init__(self):
        if not isinstance(self.stride, int) or isinstance(self.stride, bool) or self.stride < 1:
            raise ValueError(f"row_sample: stride must be an int >= 1, got {self.stride!r}")

    def init(self, spec=None):
        return RowSampleStats(observer=self)

    def batch(self, stats, x, *, path=None):
        check_finite(x, path=path)
        a = x.detach().to(torch.float32).reshape(-1, x.shape[-1])
        count = torch.tensor(a.shape[0], dtype=torch.int64, device=x.device)
        return dataclasses.replace(stats, rows=a[::self.stride].clone(), lo=a.amin(0), hi=a.amax(0), count=count)

    def merge(self, a, b, *, path=None):
        if a.lo.shape != b.lo.shape:
            raise ValueError(f"{where(path)}merge_stats: {a.lo.shape[0]} and {b.lo.shape[0]} channels")
        return dataclasses.replace(a, rows=torch.cat([a.rows, b.rows]), lo=torch.minimum(a.lo, b.lo),
                                   hi=torch.maximum(a.hi, b.hi), count=a.count + b.count)

    def finalize(self, stats, *, path=None) -> Rows:
        return Rows(stats.rows, stats.lo, stats.hi)


def sample_stats(stride: int = 1) -> RowSampleStats:
    """Empty :class:`RowSample` statistics keeping every ``stride``-th row."""
    return RowSample(stride=stride).init()


def check_activation(spec, *, where_: str = "activation") -> QuantSpec:
    """The activation spec of a search: a :class:`QuantSpec` or its dict; a static one must be per
    tensor or per feature (``PerChannel(-1)``) of the (tokens, features) matrix."""
    if isinstance(spec, Mapping):
        try:
            spec = QuantSpec.from_dict(dict(spec))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where_}: {e}") from None
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"{where_}: expected a QuantSpec or its dict form, got {type(spec).__name__}")
    g = spec.granularity
    if not spec.dynamic and not (isinstance(g, PerTensor) or (isinstance(g, PerChannel) and g.axis in (-1, 1))):
        raise ValueError(f"{where_}: a static activation spec must be per tensor or per feature "
                         f"(PerChannel(-1)), got {g}; per-token scales need dynamic=True")
    return spec


def _fq(x: torch.Tensor, spec: QuantSpec | None, *, range_rows: torch.Tensor | None = None) -> torch.Tensor:
    if spec is None:
        return x
    fit = x if range_rows is None else torch.cat([x, range_rows])
    return fake_quantize(x, choose_qparams(fit, spec))


def layer_errors(sample: Rows, params: Mapping[str, torch.Tensor], group: SmoothGroup, candidates: torch.Tensor, *,
                 activation: QuantSpec, weight_specs: Mapping[str, QuantSpec | None]) -> torch.Tensor:
    """The quantized output error of every candidate (see the module docstring).

    Args:
        sample: the input rows of the group's linears and the range of all rows (:class:`Rows`).
        params: flat tree holding the group's tensors (not modified).
        group: the group.
        candidates: ``(A, prev)`` positive scales, one row per candidate.
        activation: the activation spec (see :func:`check_activation`).
        weight_specs: ``{linear module path: spec of its stored weight}``; missing or ``None``: not quantized.

    Returns:
        ``(A,)`` float64 sums of squared errors over the sampled rows and the group's outputs.
    """
    shape = group_shape(params, group)
    x, lo, hi = (t.to(torch.float32) for t in sample)
    if x.dim() != 2 or x.shape[1] != shape.channels or lo.shape != (shape.channels,) or hi.shape != lo.shape:
        raise ValueError(f"smoothing group of {group.prev!r}: sample rows {tuple(x.shape)} and range "
                         f"{tuple(lo.shape)} do not fit its {shape.channels} input channels")
    if candidates.dim() != 2 or candidates.shape[1] != shape.prev:
        raise ValueError(f"smoothing group of {group.prev!r}: candidates of shape {tuple(candidates.shape)}, "
                         f"expected (A, {shape.prev})")
    static = not activation.dynamic
    weights = {lin: logical_weight(params[f"{lin}.weight"], group.transposed).detach().to(torch.float32)
               for lin in group.linears}
    refs = {lin: x @ w.T for lin, w in weights.items()}
    s_in = to_input(candidates.to(torch.float32), group, shape)
    errors = []
    for s in s_in:  # one candidate at a time keeps memory at one layer's size; each step is vectorized
        xs = x / s
        xq = _fq(xs, activation, range_rows=torch.stack([lo / s, hi / s]) if static else None)
        err = torch.zeros((), dtype=torch.float64, device=x.device)
        for lin, w in weights.items():
            ws = w * s
            spec = weight_specs.get(lin)
            stored = ws.T if group.transposed else ws
            wq = logical_weight(_fq(stored, spec), group.transposed)
            err = err + (xq @ wq.T - refs[lin]).double().pow(2).sum()
        errors.append(err)
    return torch.stack(errors)

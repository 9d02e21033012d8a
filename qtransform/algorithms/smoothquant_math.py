"""SmoothQuant's tensor math: the scales (:func:`scales`, :func:`smooth`) and, for ``alpha="auto"``,
choosing them on calibration data (:func:`search_alpha`) by the quantized layer output error of candidates.
:mod:`.smoothquant` registers the step.

For a :class:`~qtransform.algorithms.smoothing.SmoothGroup` with input rows ``X`` (``(N, C)``, what
enters its linears) and candidate scales ``S`` (``(A, prev)``, one row per candidate), the error of
candidate ``a`` is the squared error of the group's outputs (but its float routers'; a stacked experts weight's
over every row through every expert) when activations and weights are both fake-quantized after smoothing,
against the float outputs:

    ``err[a] = sum over linears ‖ Qa(X / s_a) · Qw(W · diag(s_a))ᵀ − X · Wᵀ ‖²``

``Qw`` is each weight's spec (the plan's; ``None``: not quantized), ``Qa`` the activation spec. A
static activation spec's range is the range given with the sample (``lo``/``hi`` per channel, divided
by ``s``): of *all* calibration rows, as a calibrated static quantizer would see it, while the error is
measured on a sample of rows; in :func:`search_alpha`'s held-out score, of the other fold's sequences only
(rows outside it are clipped, as unseen text would be). A dynamic spec fits each row sample itself.

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
from typing import Mapping, NamedTuple, Sequence

import torch

from .._checks import check_finite, where
from .._pytree import pytree_dataclass
from ..granularity import PerChannel, PerTensor
from ..observers import Observer, choose_qparams
from ..spec import QuantSpec
from ..tensor import fake_quantize
from .smoothing import (SmoothGroup, as_groups, fold, group_shape, logical_weight, member_transposed, quantized_linears,
                        to_input, to_prev, weight_absmax, weight_path)

__all__ = ["RowSample", "RowSampleStats", "Rows", "sample_stats", "check_activation", "layer_errors", "EPS", "scales",
           "smooth", "search_alpha", "Choice", "SCORES", "folds"]

#: Floor of the activation and weight maxima in :func:`scales`.
EPS = 1e-5


@pytree_dataclass(static=("spec", "observer"))
class RowSampleStats:
    """``rows`` (sampled, float32 ``(n, C)``), per-channel ``lo``/``hi`` over all rows, ``count`` rows seen;
    ``unit`` (int64 ``(n,)``): the sequence each sampled row comes from, ``unit_lo``/``unit_hi`` ``(U, C)``: the
    range of each sequence's rows (sequences numbered in the order seen)."""

    rows: torch.Tensor | None = None
    lo: torch.Tensor | None = None
    hi: torch.Tensor | None = None
    count: torch.Tensor | None = None
    unit: torch.Tensor | None = None
    unit_lo: torch.Tensor | None = None
    unit_hi: torch.Tensor | None = None
    spec: QuantSpec | None = None
    observer: Observer | None = None


class Rows(NamedTuple):
    """A finalized sample: ``rows`` ``(n, C)`` and the range ``lo``/``hi`` ``(C,)`` of every row seen; optionally
    ``unit`` ``(n,)``, the sequence of each row, and ``unit_lo``/``unit_hi`` ``(U, C)``, each sequence's range
    (what the held-out score of :func:`search_alpha` splits)."""

    rows: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    unit: torch.Tensor | None = None
    unit_lo: torch.Tensor | None = None
    unit_hi: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowSample(Observer):
    """Every ``stride``-th row (features along the last axis) of each batch, the range of all rows, and of each
    sequence's rows (a sequence: one ``(T, C)`` slice of a ``(..., T, C)`` batch; a 2-D batch is one sequence)."""

    stride: int = 1

    name = "row_sample"
    reduction = {"rows": "merge", "lo": "min", "hi": "max", "count": "sum", "unit": "merge", "unit_lo": "merge",
                 "unit_hi": "merge"}

    def __post_init__(self):
        if not isinstance(self.stride, int) or isinstance(self.stride, bool) or self.stride < 1:
            raise ValueError(f"row_sample: stride must be an int >= 1, got {self.stride!r}")

    def init(self, spec=None):
        return RowSampleStats(observer=self)

    def batch(self, stats, x, *, path=None):
        check_finite(x, path=path)
        a = x.detach().to(torch.float32).reshape(-1, x.shape[-1])
        count = torch.tensor(a.shape[0], dtype=torch.int64, device=x.device)
        t = x.shape[-2] if x.dim() >= 3 else a.shape[0]  # rows per sequence
        per = a.reshape(-1, t, a.shape[1])
        unit = torch.arange(0, a.shape[0], self.stride, device=x.device) // t
        return dataclasses.replace(stats, rows=a[::self.stride].clone(), lo=a.amin(0), hi=a.amax(0), count=count,
                                   unit=unit, unit_lo=per.amin(1), unit_hi=per.amax(1))

    def merge(self, a, b, *, path=None):
        if a.lo.shape != b.lo.shape:
            raise ValueError(f"{where(path)}merge_stats: {a.lo.shape[0]} and {b.lo.shape[0]} channels")
        return dataclasses.replace(a, rows=torch.cat([a.rows, b.rows]), lo=torch.minimum(a.lo, b.lo),
                                   hi=torch.maximum(a.hi, b.hi), count=a.count + b.count,
                                   unit=torch.cat([a.unit, b.unit + a.unit_lo.shape[0]]),
                                   unit_lo=torch.cat([a.unit_lo, b.unit_lo]), unit_hi=torch.cat([a.unit_hi, b.unit_hi]))

    def finalize(self, stats, *, path=None) -> Rows:
        return Rows(stats.rows, stats.lo, stats.hi, stats.unit, stats.unit_lo, stats.unit_hi)


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
    return fake_quantize(x, choose_qparams(x if range_rows is None else range_rows, spec))


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
    x, lo, hi = (t.to(torch.float32) for t in sample[:3])
    if x.dim() != 2 or x.shape[1] != shape.channels or lo.shape != (shape.channels,) or hi.shape != lo.shape:
        raise ValueError(f"smoothing group of {group.prev!r}: sample rows {tuple(x.shape)} and range "
                         f"{tuple(lo.shape)} do not fit its {shape.channels} input channels")
    if candidates.dim() != 2 or candidates.shape[1] != shape.prev:
        raise ValueError(f"smoothing group of {group.prev!r}: candidates of shape {tuple(candidates.shape)}, "
                         f"expected (A, {shape.prev})")
    static = not activation.dynamic
    weights = {lin: logical_weight(params[weight_path(group, lin)], member_transposed(group, lin)).detach().to(
        torch.float32) for lin in quantized_linears(group)}  # routers read the input in float: no error of theirs
    refs = {lin: x @ w.transpose(-2, -1) for lin, w in weights.items()}  # stacked: every row through every expert
    s_in = to_input(candidates.to(torch.float32), group, shape)
    errors = []
    for s in s_in:  # one candidate at a time keeps memory at one layer's size; each step is vectorized
        xs = x / s
        xq = _fq(xs, activation, range_rows=torch.stack([lo / s, hi / s]) if static else None)
        err = torch.zeros((), dtype=torch.float64, device=x.device)
        for lin, w in weights.items():
            ws = w * s
            spec = weight_specs.get(lin)
            stored = logical_weight(ws, member_transposed(group, lin))
            wq = logical_weight(_fq(stored, spec), member_transposed(group, lin))
            err = err + (xq @ wq.transpose(-2, -1) - refs[lin]).double().pow(2).sum()
        errors.append(err)
    return torch.stack(errors)


def scales(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha, *, eps: float = EPS) -> torch.Tensor:
    """SmoothQuant's scales ``max(a, eps)^α / max(w, eps)^(1−α)``, divided by their geometric mean.

    ``act_absmax`` and ``weight_absmax`` have shape ``(C,)``; ``alpha`` is a float in ``[0, 1]`` or a
    tensor of them broadcasting against ``(..., C)`` (e.g. ``(A, 1)`` for a grid: result ``(A, C)``).
    Computed in float32 (or float64 for float64 inputs) in the log domain.
    """
    dt = torch.promote_types(torch.promote_types(act_absmax.dtype, weight_absmax.dtype), torch.float32)
    alpha = torch.as_tensor(alpha, dtype=dt, device=act_absmax.device)
    log_s = (alpha * act_absmax.to(dt).clamp(min=eps).log()
             - (1 - alpha) * weight_absmax.to(dt).clamp(min=eps).log())
    return (log_s - log_s.mean(-1, keepdim=True)).exp()


def _group_scales(params, group: SmoothGroup, act_absmax: torch.Tensor, alpha) -> torch.Tensor:
    shape = group_shape(params, group)
    if tuple(act_absmax.shape) != (shape.channels,):
        raise ValueError(f"smoothing group of {group.prev!r}: activation maxima of shape "
                         f"{tuple(act_absmax.shape)}, its linears read {shape.channels} channels")
    return scales(to_prev(act_absmax.float(), group, shape), to_prev(weight_absmax(params, group), group, shape),
                  alpha)


def smooth(params: Mapping[str, torch.Tensor], groups: Sequence, act_absmax: Sequence[torch.Tensor], *,
           alpha: float = 0.5) -> dict[str, torch.Tensor]:
    """Smooth ``groups`` of the flat tree ``params`` with a fixed ``alpha`` (pure; ``params`` unchanged).

    Args:
        params: ``{path: tensor}``.
        groups: :class:`~qtransform.algorithms.smoothing.SmoothGroup` or their dicts, smoothed in order
            (a group sees the tensors as the groups before it left them).
        act_absmax: per group, ``max |x|`` per input channel of its linears (``(C,)``), e.g.
            ``finalize_stats(channel statistics).absmax``.
        alpha: migration strength in ``[0, 1]``.

    Returns:
        ``{path: tensor}``: every tensor the groups changed.

    >>> import torch
    >>> params = {"ln.weight": torch.ones(2), "ln.bias": torch.ones(2), "fc.weight": torch.ones(3, 2)}
    >>> new = smooth(params, [{"prev": "ln", "linears": ["fc"]}], [torch.tensor([16.0, 1.0])], alpha=1.0)
    >>> new["ln.weight"].tolist(), new["ln.bias"].tolist(), new["fc.weight"][0].tolist()
    ([0.25, 4.0], [0.25, 4.0], [4.0, 0.25])
    """
    _check_alpha(alpha, None, auto=False)
    groups = as_groups(groups)
    if len(act_absmax) != len(groups):
        raise ValueError(f"smooth: {len(groups)} groups but {len(act_absmax)} activation maxima")
    current, changed = dict(params), {}
    for g, a in zip(groups, act_absmax):
        new = fold(current, g, _group_scales(current, g, a, float(alpha)))
        current.update(new)
        changed.update(new)
    return changed


class Choice(NamedTuple):
    """What :func:`search_alpha` chose: ``alpha`` (``None``: no smoothing), its ``scales`` (``None`` too),
    the candidates' ``alphas`` and ``errors`` (no smoothing first, then the grid)."""

    alpha: float | None
    scales: torch.Tensor | None
    alphas: tuple[float | None, ...]
    errors: torch.Tensor


#: How :func:`search_alpha` scores a candidate: on held-out sequences (the default) or on the calibration rows
#: themselves.
SCORES = ("heldout", "calibration")


def folds(sample: Rows, k: int = 2) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The held-out splits of ``sample``: ``(held rows, lo, hi)`` per fold, where the sequences that have sampled
    rows are dealt to ``k`` folds in turn, and ``lo``/``hi`` is the range of every *other* sequence (the rows a
    static quantizer calibrated without the fold would cover). Empty when fewer than two sequences have rows."""
    if sample.unit is None or sample.unit_lo is None:
        return []
    seen = torch.unique(sample.unit)
    if seen.numel() < 2:
        return []
    fold_of = torch.full((sample.unit_lo.shape[0],), -1, dtype=torch.int64, device=seen.device)
    fold_of[seen] = torch.arange(seen.numel(), device=seen.device) % k
    out = []
    for f in range(k):
        fit = fold_of != f
        held = fold_of[sample.unit] == f
        if held.any() and fit.any():
            out.append((sample.rows[held], sample.unit_lo[fit].amin(0), sample.unit_hi[fit].amax(0)))
    return out


def search_alpha(sample: Rows, params: Mapping[str, torch.Tensor], group, *, activation=None,
                 weight_specs: Mapping[str, QuantSpec | None] | None = None, grid: int = 11,
                 score: str = "calibration") -> Choice:
    """α for one group minimising its quantized output error (auto-SmoothQuant), on the sample or held out.

    The candidates are no smoothing and the scales of every α in ``linspace(0, 1, grid)``. ``score="heldout"``:
    the calibration sequences are dealt to two folds (:func:`folds`); for each fold the candidates'
    scales and the static activation range come from the *other* fold's sequences, and :func:`layer_errors` is
    measured on the fold's rows (which may fall outside that range, as new text does); the two folds' errors are
    summed. ``score="calibration"`` (default): scales, range and error all from every row (also the fallback of
    ``"heldout"`` when fewer than two sequences were sampled). The
    first candidate with the smallest score wins; its scales are then computed from all rows. ``activation``:
    the activation spec (default int8 per tensor, static); ``weight_specs``: ``{linear path: spec}`` (default:
    weights not quantized).
    """
    group = SmoothGroup.from_value(group)
    activation = check_activation(QuantSpec(format="int8") if activation is None else activation)
    _check_int("grid", grid, 2, None)
    if score not in SCORES:
        raise ValueError(f"smoothquant: score must be one of {list(SCORES)}, got {score!r}")
    alphas = torch.linspace(0, 1, grid, dtype=torch.float64)
    opts = dict(activation=activation, weight_specs=weight_specs or {})

    def candidates(lo, hi):
        cand = _group_scales(params, group, torch.maximum(lo.abs(), hi.abs()), alphas[:, None])
        return torch.cat([torch.ones_like(cand[:1]), cand])

    splits = folds(sample) if score == "heldout" else []
    if splits:
        errors = sum(layer_errors(Rows(rows, lo, hi), params, group, candidates(lo, hi), **opts)
                     for rows, lo, hi in splits)
    else:
        errors = layer_errors(sample, params, group, candidates(sample.lo, sample.hi), **opts)
    best = int(torch.argmin(errors))
    grid_alphas = tuple(round(float(a), 12) for a in alphas)
    chosen = candidates(sample.lo, sample.hi)[best].float() if best else None
    return Choice(None if best == 0 else grid_alphas[best - 1], chosen, (None, *grid_alphas), errors)


def _check_int(name, v, lo, path) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{where(path)}smoothquant: {name} must be an int >= {lo}, got {v!r}")


def _check_alpha(alpha, path, *, auto: bool = True) -> None:
    if isinstance(alpha, str):
        ok = auto and alpha == "auto"
    else:
        ok = isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and 0 <= alpha <= 1  # NaN fails
    if not ok:
        also = ' or "auto"' if auto else ""
        raise ValueError(f"{where(path)}smoothquant: alpha must be a number in [0, 1]{also}, got {alpha!r}")

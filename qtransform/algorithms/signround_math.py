"""SignRound's learned quantizer of one weight (Cheng et al., "Optimize weight rounding via signed gradient
descent", intel's AutoRound): pure functions over tensors and specs.

For a weight ``W`` quantized by ``spec``, each block (group) ``b`` has its range ``[min_b, max_b]``; SignRound
learns per weight a rounding offset ``V`` and per group two clipping factors ``alpha``, ``beta``::

    lo_b = alpha_b * min_b,   hi_b = beta_b * max_b                      (the learned range)
    s_b, z_b = the format's own parameters for [lo_b, hi_b]            (QParams.from_range)
    W~ = (clamp(round(W / s_b + V * step + z_b), qmin, qmax) - z_b) * s_b

``round`` is the format's element rounding (integers, NF4's codebook, a minifloat's grid) and ``step`` the
distance between the grid points around ``W / s`` (1 for integer codes, so ``V`` is AutoRound's offset "in
units of the scale"; on the non-uniform grids of NF4 and the minifloats ``V = +-0.5`` reaches the neighbouring
grid point as it does on integers). ``V`` starts at 0 and stays in ``[-0.5, 0.5]``, ``alpha`` and ``beta`` start
at 1 and stay in ``[0.5, 1]``: at the start ``W~`` is round to nearest with min-max ranges.

Gradients (:func:`learned_fake_quantize`) are straight-through: ``round`` passes the gradient unchanged inside
``[qmin, qmax]`` and none outside; the scale carries the gradient of the continuous range it stands for
(``ds/ds_ideal = s / s_ideal``, ``s_ideal`` = the range width over the code span, or ``max|range|``: the same
for float scales, and AutoRound's ``floor_ste`` of the exponent for power-of-two and E8M0 scales), while its
*value* is exactly what the format stores (rounded up to fp16, a power of two, an fp8 block scale). The integer
zero point ``z = qmin - round(lo / s)``: ``zero_point="ste"`` (AutoRound's ``round_ste``) gives it the gradient
of ``qmin - lo / s``, so the clipped weights at the bottom of the range pull on ``alpha`` and those at the top
on ``beta`` differently; ``zero_point="round"`` treats it as a constant, the gradient then reaches ``alpha`` and
``beta`` only through the scale, the same sign for both, and signed gradient descent moves them in lockstep.
Float and offset zero points are continuous already (the option does not apply).

Where the factors do not apply as two: a symmetric spec has one scale for ``max(-lo, hi)`` (AutoRound's
``int_sym``: ``min_scale`` clips the negative side, ``max_scale`` the positive side, the larger one sets the
scale), so only the factor of the side that sets it moves; MX and other E8M0 shared exponents take the same
``max|range|`` (AutoRound's MXFP ``max_scale``) with a straight-through exponent; NVFP4's two-level scales keep
the float weight's global scale (AutoRound's ``weight_global_scale``) and learn the fp8 block scales under it;
the casts (bf16, fp16: scale 1) learn only ``V``.

:func:`sign_step` is the signed gradient step with its clamping; :func:`finalize` quantizes with the learned
``V``, ``alpha``, ``beta`` through the format's own codec (``quantize``/``dequantize``).

>>> import torch, qtransform as qt
>>> w = torch.tensor([[-1.0, -0.2, 0.3, 0.9]])
>>> spec = qt.QuantSpec(format="uint2", granularity=qt.PerGroup(4), symmetric=False)
>>> lq = prepare_weight(w, spec)
>>> t = minmax_init(lq)
>>> (learned_fake_quantize(lq, t) * 3 / 1.9).round().tolist()  # round to nearest: scale 1.9/3, zero point 2
[[-2.0, 0.0, 0.0, 1.0]]
>>> w2, qp = finalize(lq, t._replace(offset=torch.tensor([[0.0, 0.0, 0.5, 0.0]])))  # 0.3 rounds up
>>> (w2 * 3 / 1.9).round().tolist(), qp.spec == spec, qp.zero_point.tolist()
([[-2.0, 0.0, 1.0, 1.0]], True, [[2]])
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._checks import check_finite, check_float_tensor, where
from ..formats.scaling import FP8_E4M3_MAX, FP8_E4M3_TINY, UnitScheme
from ..spec import QuantSpec
from ..tensor import QParams, blocks, dequantize, quantize
from ..tensor.quantize import element_range
from ..learn.ranges import from_qparams, stored_effective

__all__ = ["Learned", "Prepared", "ZERO_POINTS", "OFFSET_RANGE", "FACTOR_RANGE", "prepare_weight", "minmax_init", "clip_init",
           "learned_fake_quantize", "sign_step", "finalize"]

ZERO_POINTS = ("ste", "round")
OFFSET_RANGE = (-0.5, 0.5)
FACTOR_RANGE = (0.5, 1.0)


class Learned(NamedTuple):
    """The trainable state of one weight: ``offset`` (``V``, the weight's shape), ``alpha``, ``beta`` (the
    group grid, ``ceil(shape / block)``), all float32."""

    offset: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor


class Prepared(NamedTuple):
    """What :func:`prepare_weight` computes once per weight (the float weight blocked, its ranges, the tilings)."""

    weight: torch.Tensor        # float32 blocked view (the element tiling)
    wmin: torch.Tensor          # per element block (sub-blocks for MX4/6/9), float32
    wmax: torch.Tensor
    tiles: blocks.Tiling        # the element tiling (sub-blocks where the format has them)
    groups: blocks.Tiling       # the group tiling (alpha, beta)
    spec: QuantSpec
    global_scale: torch.Tensor | None  # NVFP4: the float weight's, kept
    uniform: bool               # the element grid's step is 1 everywhere (integer codes)
    ranged: bool                # the scale follows the range (False for the casts: alpha, beta unused)
    dtype: torch.dtype
    path: str | None
    start: QParams | None = None  # given parameters (GPTQ's): used as they are where alpha = beta = 1


def prepare_weight(w: torch.Tensor, spec: QuantSpec, *, path: str | None = None, start: QParams | None = None) -> Prepared:
    """The float weight ``w`` (any rank the spec tiles: a 2-D linear, 3-D stacked experts with a stacked spec)
    prepared for :func:`learned_fake_quantize`. ``start``: parameters to start from instead of min-max ranges
    (GPTQ's, with ``w`` its unrounded weight): the ranges are those they stand for (their lowest and highest
    codes dequantized), and where ``alpha = beta = 1`` the parameters are ``start``'s exactly, so the start
    is ``start``'s round to nearest of ``w``. ``ValueError`` naming ``path`` for a spec that does not tile
    ``w``, a dynamic spec, non-finite data, a ``start`` of another spec or grid."""
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"{where(path)}spec must be a QuantSpec, got {type(spec).__name__}")
    check_float_tensor(w, path=path)
    check_finite(w, path=path)
    if spec.dynamic:
        raise ValueError(f"{where(path)}signround learns static weight parameters; spec {spec} is dynamic")
    tiles = blocks.tiling(w.shape, spec, sub_block=True, path=path)
    groups = blocks.tiling(w.shape, spec, path=path)
    xb = blocks.view(w.detach().to(torch.float32), tiles)
    dims = blocks.reduce_dims(tiles)
    wmin, wmax = xb.amin(dim=dims), xb.amax(dim=dims)
    g = None
    if start is not None:
        wmin, wmax = _start_range(start, spec, tiles, groups, path)
        g = start.global_scale
    elif spec.scale_dtype == "float8_e4m3fn":
        g = QParams.from_range(wmin, wmax, spec, path=path).global_scale
    uniform = bool((spec.fmt.codec.half_spacing(torch.tensor([0.0, 0.3, 1.7, 5.0])) == 0.5).all())
    ranged = not isinstance(spec.fmt.scheme, UnitScheme)
    return Prepared(xb, wmin, wmax, tiles, groups, spec, g, uniform, ranged, w.dtype, path, start)


def _start_range(qp: QParams, spec: QuantSpec, tiles, groups, path) -> tuple[torch.Tensor, torch.Tensor]:
    """The range ``[lo, hi]`` per group that ``qp`` stands for: its lowest and highest codes dequantized."""
    if not isinstance(qp, QParams) or qp.spec != spec:
        raise ValueError(f"{where(path)}signround: the start's parameters must be QParams of spec {spec}, got "
                         f"{getattr(qp, 'spec', type(qp).__name__)}")
    if tiles.grid != groups.grid or tuple(qp.scale.shape) != tuple(groups.grid):
        raise ValueError(f"{where(path)}signround: a start from given parameters needs one scale per group "
                         f"(grid {tuple(groups.grid)}), got scale {tuple(qp.scale.shape)} for spec {spec}")
    r = from_qparams(qp, path=path)
    return r.lo, r.hi


def minmax_init(lq: Prepared) -> Learned:
    """``V = 0``, ``alpha = beta = 1``: round to nearest with min-max ranges."""
    ones = torch.ones(lq.groups.grid, dtype=torch.float32, device=lq.weight.device)
    return Learned(torch.zeros(lq.tiles.shape, dtype=torch.float32, device=lq.weight.device), ones, ones.clone())


def clip_init(lq: Prepared, *, candidates: int = 11, zero_point: str = "ste") -> Learned:
    """``V = 0`` and, per group, ``alpha = beta = c`` for the ``c`` of ``linspace(1, 0.5, candidates)`` whose round
    to nearest has the least squared error on the group's weights (the first such ``c``: 1 wins ties): the
    start of a clipping search, within the factors' range. Where the factors do not apply (the casts) it is
    :func:`minmax_init`.

    >>> import torch, qtransform as qt
    >>> w = torch.tensor([[-0.1, 0.0, 0.1, 0.2, 0.3, -0.2, 0.15, 4.0]])
    >>> lq = prepare_weight(w, qt.QuantSpec(format="uint2", granularity=qt.PerGroup(8), symmetric=False))
    >>> t = clip_init(lq)
    >>> float(t.beta) < 1.0, bool((learned_fake_quantize(lq, t) - w).square().sum()
    ...                            <= (learned_fake_quantize(lq, minmax_init(lq)) - w).square().sum())
    (True, True)
    """
    if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 1:
        raise ValueError(f"clip_init: candidates must be an int >= 1, got {candidates!r}")
    start = minmax_init(lq)
    if not lq.ranged:
        return start
    factors = torch.linspace(1.0, FACTOR_RANGE[0], candidates).tolist()
    errs = []
    with torch.no_grad():
        for c in factors:
            factor = torch.full_like(start.alpha, c)
            y, _ = _forward(lq, Learned(start.offset, factor, factor), zero_point)
            errs.append(_to_groups((y - lq.weight).square().sum(dim=blocks.reduce_dims(lq.tiles)), lq))
    best = torch.tensor(factors, dtype=start.alpha.dtype)[torch.stack(errs).argmin(0)]  # argmin: the first least
    return Learned(start.offset, best, best.clone())


def _to_groups(t: torch.Tensor, lq: Prepared) -> torch.Tensor:
    """A tensor on the element tiling's grid summed onto the group grid (MX4/6/9's pairs)."""
    for axis, (a, b) in enumerate(zip(lq.tiles.grid, lq.groups.grid)):
        if a != b:
            t = t.unflatten(axis, (b, a // b)).sum(axis + 1)
    return t


def _to_tiles(t: torch.Tensor, lq: Prepared) -> torch.Tensor:
    """A group-grid tensor repeated onto the element tiling's grid (MX4/6/9's pairs)."""
    if lq.tiles.grid == lq.groups.grid:
        return t
    for axis, (a, b) in enumerate(zip(lq.tiles.grid, lq.groups.grid)):
        if a != b:
            t = t.repeat_interleave(a // b, dim=axis)
    return t


def _qparams(lo: torch.Tensor, hi: torch.Tensor, lq: Prepared) -> QParams:
    """The format's parameters for the ranges ``[lo, hi]`` (no gradient); NVFP4 keeps ``lq.global_scale``."""
    spec = lq.spec
    if lq.global_scale is None:
        return QParams.from_range(lo, hi, spec, path=lq.path)
    elem_max = spec.fmt.codec.qrange(symmetric=True, restricted=False)[1]
    block = (torch.maximum(-lo, hi) / elem_max / lq.global_scale).clamp(FP8_E4M3_TINY, FP8_E4M3_MAX)
    return QParams(scale=block.to(torch.float8_e4m3fn), global_scale=lq.global_scale, spec=spec)


def _pick(keep: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.where(keep, a, b)`` in ``a``'s dtype (fp8 scales picked through float32, exactly)."""
    if a.dtype.is_floating_point and a.element_size() == 1:
        return torch.where(keep, a.to(torch.float32), b.to(torch.float32)).to(a.dtype)
    return torch.where(keep, a, b.to(a.dtype))


def _range(lq: Prepared, t: Learned):
    """The learned ranges on the element grid, their parameters, and the differentiable ``(scale, zero point)``."""
    lo, hi = lq.wmin * _to_tiles(t.alpha, lq), lq.wmax * _to_tiles(t.beta, lq)
    qp = _qparams(lo.detach(), hi.detach(), lq)
    if lq.start is not None:  # the given parameters where the factors stand at 1 (the start, exactly)
        keep = (t.alpha.detach() == 1) & (t.beta.detach() == 1)
        qp = QParams(scale=_pick(keep, lq.start.scale, qp.scale), zero_point=None if qp.zero_point is None
                     else _pick(keep, lq.start.zero_point, qp.zero_point), global_scale=qp.global_scale, spec=qp.spec)
    s, z = stored_effective(qp, lo, hi)
    return qp, s, z


def _zero_point_mode(zero_point: str) -> None:
    if zero_point not in ZERO_POINTS:
        raise ValueError(f"zero_point must be one of {list(ZERO_POINTS)}, got {zero_point!r}")


def _forward(lq: Prepared, t: Learned, zero_point: str):
    """The learned quantizer on the blocked view: ``(W~ blocked, QParams)``."""
    _zero_point_mode(zero_point)
    spec, p = lq.spec, lq.tiles
    qp, s, z = _range(lq, t)
    if z is not None and zero_point == "round" and spec.zero_point_domain == "int":
        z = z.detach()
    s, z = blocks.expand(s, p), None if z is None else blocks.expand(z, p)
    offset = spec.zero_point_domain == "offset"
    xb = lq.weight
    u = (xb - z) / s if offset and z is not None else (xb / s if z is None else xb / s + z)
    v = blocks.view(t.offset, p)
    if not lq.uniform:  # V in units of the grid step around W / s
        v = v * (2 * spec.fmt.codec.half_spacing(u.detach()))
    u = u + v
    lo, hi = element_range(spec)
    uc = u if lo is None else u.clamp(lo, hi)
    rounding = "half_even" if spec.rounding == "stochastic" else spec.rounding
    g = spec.fmt.codec.round(u.detach(), rounding=rounding, lo=lo, hi=hi)
    uq = uc + (g - uc).detach()
    if z is None:
        y = uq * s
    else:
        y = uq * s + z if offset else (uq - z) * s
    return y, qp


def learned_fake_quantize(lq: Prepared, t: Learned, *, zero_point: str = "ste") -> torch.Tensor:
    """``W~`` (``lq``'s weight shape and dtype), differentiable with respect to ``t``'s tensors (see the module
    docstring); its value is what :func:`finalize` stores."""
    y, _ = _forward(lq, t, zero_point)
    return blocks.unview(y, lq.tiles).to(lq.dtype)


def sign_step(t: Learned, grad: Learned, *, lr: float, minmax_lr: float | None = None) -> Learned:
    """One signed gradient descent step: ``V - lr * sign(dL/dV)`` clamped to ``[-0.5, 0.5]``, ``alpha`` and
    ``beta`` by ``minmax_lr`` (``lr`` when ``None``) clamped to ``[0.5, 1]``; a ``None`` gradient leaves that
    tensor as it is (``minmax=False``).

    >>> t = Learned(torch.tensor([0.45, -0.2]), torch.tensor([0.55]), torch.tensor([1.0]))
    >>> g = Learned(torch.tensor([-1.0, 0.0]), torch.tensor([3.0]), torch.tensor([-2.0]))
    >>> [x.tolist() for x in sign_step(t, g, lr=0.1)]
    [[0.5, -0.20000000298023224], [0.5], [1.0]]
    """
    minmax_lr = lr if minmax_lr is None else minmax_lr

    def one(x, dx, step, bounds):
        return x if dx is None else (x - step * torch.sign(dx)).clamp(*bounds)

    return Learned(one(t.offset, grad.offset, lr, OFFSET_RANGE), one(t.alpha, grad.alpha, minmax_lr, FACTOR_RANGE),
                   one(t.beta, grad.beta, minmax_lr, FACTOR_RANGE))


def finalize(lq: Prepared, t: Learned, *, zero_point: str = "ste") -> tuple[torch.Tensor, QParams]:
    """The weight quantized with the learned ``V``, ``alpha``, ``beta`` through the format's codec: ``(weight on
    the grid, QParams)``, the weight ``dequantize(quantize(...))`` in ``lq``'s dtype, ``QParams.spec`` the spec.
    (``zero_point`` only shapes gradients: the values are the same either way.)"""
    with torch.no_grad():
        y, qp = _forward(lq, Learned(*(x.detach() for x in t)), zero_point)
        y = blocks.unview(y, lq.tiles)
        q = quantize(y, qp, generator=0, path=lq.path)
        return dequantize(q, dtype=lq.dtype), qp

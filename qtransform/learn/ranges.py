"""Learnable quantization parameters: a tensor's per-block ranges, whose stored form is the format's own.

A :class:`LearnedRange` holds, per block of the spec's grid (sub-blocks for MX4/6/9), the range ``[lo, hi]``
that the quantization parameters stand for, as float32 leaves beside the weights. The parameters that are
*stored* are always the format's for that range (:func:`to_qparams`: ``QParams.from_range``: a scale rounded
up to fp16, a power of two, an E8M0 exponent, NVFP4's fp8 block scales under the global scale of the largest
range, an integer zero point), so whatever trains can be saved, reloaded and packed as it is.

:func:`fake_quantize` is, forward, *bit for bit* ``dequantize(quantize(w, to_qparams(r)))``; backward (and in
forward mode) it is straight-through in ``w`` (1 inside the range, 0 where clipped) and LSQ's in the range:
the step size ``s`` and zero point ``z`` are functions of ``[lo, hi]`` (``s = (hi - lo) / (qmax - qmin)``,
``max(-lo, hi) / D`` symmetric, ``z = qmin - lo / s``), their stored values rounded with a straight-through
gradient (``ds/d s_ideal = s / s_ideal``), so ``dL/dhi`` is LSQ's ``dL/ds`` over the code span, and LSQ+'s
zero-point gradient reaches ``lo`` (``zero_point="ste"``, the integer zero point's rounding passed straight
through; ``"round"``: a constant). The clipping factors SignRound learns are one parameterisation of the same
ranges (:mod:`qtransform.algorithms.signround_math` uses :func:`stored_effective` below).

>>> import torch, qtransform as qt
>>> from qtransform import learn
>>> w = torch.tensor([[-1.0, -0.2, 0.3, 0.9]])
>>> spec = qt.QuantSpec(format="uint2", granularity=qt.PerGroup(4), symmetric=False, scale_dtype="float16")
>>> r = learn.learnable(w, spec)
>>> torch.equal(learn.fake_quantize(w, r), qt.dequantize(qt.quantize(w, qt.choose_qparams(w, spec))))
True
>>> g = torch.func.grad(lambda r: learn.fake_quantize(w, r).square().sum())(r)
>>> bool(g.hi.abs().sum() > 0), bool(g.lo.abs().sum() > 0)
(True, True)
"""

from __future__ import annotations

import torch

from .._checks import check_finite, check_float_tensor, differentiated, under_transform, where
from .._pytree import pytree_dataclass
from ..formats.scaling import UnitScheme
from ..spec import QuantSpec
from ..tensor import QParams, blocks
from ..tensor.quantize import element_range, fake_quantize_grid

__all__ = ["LearnedRange", "ZERO_POINTS", "learnable", "from_qparams", "to_qparams", "fake_quantize",
           "stored_effective", "ranged"]

#: How an integer zero point's rounding is differentiated: ``"ste"`` passes it straight through (LSQ+, AutoRound's
#: ``round_ste``), ``"round"`` treats the rounded zero point as a constant.
ZERO_POINTS = ("ste", "round")


@pytree_dataclass(static=("spec",))
class LearnedRange:
    """The learnable quantization parameters of one tensor: ``lo``, ``hi`` (float32, the spec's grid: sub-blocks
    for MX4/6/9) and ``spec`` (static). A pytree: ``torch.func.grad`` returns one of these, ``tree_map`` and
    optimisers see ``lo`` and ``hi`` only."""

    lo: torch.Tensor
    hi: torch.Tensor
    spec: QuantSpec

    def __post_init__(self):
        if not isinstance(self.spec, QuantSpec):
            raise TypeError(f"LearnedRange: spec must be a QuantSpec, got {type(self.spec).__name__}")
        for name in ("lo", "hi"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError(f"LearnedRange: {name} must be a floating torch.Tensor, got {t!r:.60}")
        if self.lo.shape != self.hi.shape:
            raise ValueError(f"LearnedRange: lo {tuple(self.lo.shape)} and hi {tuple(self.hi.shape)} differ in shape")


def ranged(spec: QuantSpec) -> bool:
    """Whether ``spec``'s scale follows a range (not the casts, whose scale is 1: nothing to learn there)."""
    return not isinstance(spec.fmt.scheme, UnitScheme)


def _grid(shape, spec: QuantSpec, path):
    return blocks.tiling(tuple(shape), spec, sub_block=True, path=path)


def learnable(w: torch.Tensor, spec: QuantSpec, *, path: str | None = None) -> LearnedRange:
    """The min-max ranges of ``w``'s blocks: where round to nearest starts (:func:`to_qparams` of it is
    ``qt.choose_qparams(w, spec)``, the ``minmax`` observer's parameters). ``ValueError`` naming ``path`` for a
    dynamic spec (fitted at run time: nothing to learn), a spec that does not tile ``w``, non-finite data."""
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"{where(path)}spec must be a QuantSpec, got {type(spec).__name__}")
    check_float_tensor(w, path=path)
    check_finite(w, path=path)
    if spec.dynamic:
        raise ValueError(f"{where(path)}spec {spec} is dynamic (its parameters are fitted to each input at run "
                         "time): there is no range to learn; use qt.fake_quantize(x, qparams, range_grad=True)")
    p = _grid(w.shape, spec, path)
    xb = blocks.view(w.detach().to(torch.float32), p)
    dims = blocks.reduce_dims(p)
    return LearnedRange(lo=xb.amin(dim=dims), hi=xb.amax(dim=dims), spec=spec)


def from_qparams(qparams: QParams, *, path: str | None = None) -> LearnedRange:
    """The ranges ``qparams`` stand for (their lowest and highest codes dequantized): a start from parameters
    fitted elsewhere (GPTQ's, a calibrated activation range). :func:`to_qparams` of it gives ``qparams`` back
    up to the format's rounding of a scale; :func:`qtransform.learn.exact_range`: exactly."""
    if not isinstance(qparams, QParams):
        raise TypeError(f"{where(path)}from_qparams: expected a QParams, got {type(qparams).__name__}")
    spec = qparams.spec
    if spec.fmt.sub_block is not None:
        raise ValueError(f"{where(path)}from_qparams: {spec.format}'s shared exponents do not stand for one range "
                         "per sub-block; start from the tensor (learnable(w, spec))")
    s, z = (t if t is None else t.detach().to(torch.float32) for t in qparams.effective())
    qlo, qhi = element_range(spec)
    if qlo is None:
        qlo, qhi = spec.fmt.codec.qrange(symmetric=spec.symmetric, restricted=False)
    if spec.symmetric:  # one scale for max(-lo, hi) over the half-width of the code range (int8: 127.5)
        half = (qhi - qlo) / 2
        lo, hi = -half * s, half * s
    elif z is None:
        lo, hi = qlo * s, qhi * s
    elif spec.zero_point_domain == "offset":
        lo, hi = qlo * s + z, qhi * s + z
    else:
        lo, hi = (qlo - z) * s, (qhi - z) * s
    return LearnedRange(lo=lo, hi=hi, spec=spec)


def to_qparams(r: LearnedRange, *, path: str | None = None) -> QParams:
    """The stored parameters of ``r`` (no gradient): the format's for its ranges, as a checkpoint holds them."""
    if not isinstance(r, LearnedRange):
        raise TypeError(f"{where(path)}to_qparams: expected a LearnedRange, got {type(r).__name__}")
    return _stored(r.lo, r.hi, r.spec, path)


def _stored(lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec, path) -> QParams:
    """The format's parameters for the (ordered) ranges, no gradient; a non-finite range refused by path."""
    lo, hi = lo.detach().to(torch.float32), hi.detach().to(torch.float32)
    bad = ~(torch.isfinite(lo) & torch.isfinite(hi))
    if not under_transform(lo) and bool(bad.any()):
        raise ValueError(f"{where(path)}a learned range is not finite at grid index "
                         f"{tuple(int(i) for i in bad.nonzero()[0])} (a diverged step?)")
    return QParams.from_range(torch.minimum(lo, hi), torch.maximum(lo, hi), spec, path=path)


def _ratio(r: torch.Tensor) -> torch.Tensor:
    """``r / r`` (exactly 1) with the gradient of ``r / r.detach()``; 1 without gradient where ``r`` is 0."""
    rd = r.detach()
    pos = (rd > 0) & torch.isfinite(rd)  # a width beyond float32 (a range at its limit): no gradient, never NaN
    return torch.where(pos, r / torch.where(pos, rd, 1.0), 1.0)


def stored_effective(qp: QParams, lo: torch.Tensor, hi: torch.Tensor, *, zero_point: str = "ste"):
    """``qp``'s effective ``(scale, zero point)`` (its stored values exactly) with the gradient of the continuous
    parameters of the range ``[lo, hi]`` it was made for (see the module docstring)."""
    if zero_point not in ZERO_POINTS:
        raise ValueError(f"zero_point must be one of {list(ZERO_POINTS)}, got {zero_point!r}")
    spec = qp.spec
    s_val, z_val = qp.effective()
    if not ranged(spec) or not (differentiated(lo) or differentiated(hi)):  # a cast (scale 1), or no gradient asked
        return s_val, z_val
    zd = spec.zero_point_domain
    if spec.symmetric:
        width = torch.maximum(-lo, hi)
    elif zd == "int":
        width = hi.clamp(min=0) - lo.clamp(max=0)
    else:
        width = hi - lo
    s = s_val * _ratio(width)
    if spec.symmetric or z_val is None or (zero_point == "round" and zd == "int"):
        return s, z_val
    qlo = element_range(spec)[0]
    qlo = spec.fmt.codec.qrange(symmetric=False, restricted=False)[0] if qlo is None else qlo
    if zd == "offset":
        zc = lo - qlo * s
    elif zd == "int":
        zc = qlo - lo.clamp(max=0) / s
    else:
        zc = qlo - lo / s
    return s, z_val + torch.where(torch.isfinite(zc.detach()), zc - zc.detach(), 0.0)


def fake_quantize(w: torch.Tensor, r: LearnedRange, *, zero_point: str = "ste", generator=None,
                  path: str | None = None) -> torch.Tensor:
    """``dequantize(quantize(w, to_qparams(r)))`` bit for bit, differentiable in ``w`` (straight through) and in
    ``r``'s ranges (LSQ/LSQ+, see the module docstring), under ``torch.func.grad``, ``jvp``, ``jacfwd`` and
    ``vmap``. ``ValueError`` naming ``path`` where ``r``'s grid does not fit ``w``."""
    if not isinstance(r, LearnedRange):
        raise TypeError(f"{where(path)}fake_quantize: expected a LearnedRange, got {type(r).__name__}")
    check_float_tensor(w, path=path)
    grid = _grid(w.shape, r.spec, path).grid
    if tuple(r.lo.shape) != grid:
        raise ValueError(f"{where(path)}learned range of grid {tuple(r.lo.shape)} does not fit a tensor of shape "
                         f"{tuple(w.shape)} under {r.spec} (grid {grid})")
    lo, hi = torch.minimum(r.lo, r.hi), torch.maximum(r.lo, r.hi)
    qp = _stored(lo, hi, r.spec, path)
    s, z = stored_effective(qp, lo.to(torch.float32), hi.to(torch.float32), zero_point=zero_point)
    return fake_quantize_grid(w, r.spec, s, z, generator=generator, path=path)

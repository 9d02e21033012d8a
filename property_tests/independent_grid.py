"""An independent check of a round trip: the format's grid and the stored parameters decoded here,
from the formats' definitions, in float64 numpy, without qtransform's codecs, schemes or block views.

* **grid** (element domain): integers ``[qmin, qmax]`` from the bit width and signedness (one less
  at the bottom for a restricted symmetric range), ``k / 2^frac`` for fixed point (MXINT8), every
  finite value of a minifloat from its exponent and mantissa bits, bias and special values
  (``tests/minifloat_reference.py``), or the levels of a codebook;
* **scale** per element (and zero point: an offset ``m``, ``x = code * scale + m``, is the grid shift
  ``-m / scale``): the stored float scale, ``2^(code - 127)`` for E8M0, the fp8 block scale
  times the global scale (two-level), or ``2^(E - shift - (bits - 2))`` per pair for the shared
  micro-exponent formats; broadcast over the granularity's blocks by ``repeat_interleave`` (padding
  cropped);
* **the check**: with ``v = x / scale + zero_point``, the error ``|x - y|`` is at most half the gap
  between the grid points around ``v`` (a full gap for stochastic rounding), times the scale; a value
  beyond the grid's ends by more than half its last gap is *clipped*, which a minmax range allows
  only where the scale rule itself clips (power-of-two ``floor``/``even`` rules and the shared
  micro-exponents: ``|v|`` below the next power of two above the largest grid value; two-level
  fp8 block scales rounded to nearest: ``|v| <= top * (1 + 2^-3)``; plain casts: anything), and
  then the error is the distance to the end of the grid.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

import minifloat_reference as ref
import qtransform as qt
from qtransform.formats import UNIT

__all__ = ["element_grid", "element_scale", "assert_on_grid"]

FLOAT32_MAX = float(np.finfo(np.float32).max)


@functools.lru_cache(maxsize=None)
def _grid(name: str, symmetric: bool, restricted: bool) -> np.ndarray:
    codec = qt.FORMATS[name].codec
    kind = type(codec).__name__
    if kind in ("IntCodec", "SymmetricIntCodec"):
        b = codec.bits
        lo, hi = (-(1 << (b - 1)), (1 << (b - 1)) - 1) if codec.signed else (0, (1 << b) - 1)
        if kind == "SymmetricIntCodec" or (symmetric and restricted):
            lo += 1
        return np.arange(lo, hi + 1, dtype=np.float64)
    if kind == "FixedPointCodec":
        top = (1 << (codec.bits - 1)) - 1
        return np.arange(-top, top + 1, dtype=np.float64) / 2.0 ** codec.frac_bits
    if kind == "MinifloatCodec":
        table = ref.values(codec.exponent_bits, codec.mantissa_bits, codec.bias, codec.special)
        return np.unique(table[np.isfinite(table)])
    if kind == "CodebookCodec":
        return np.unique(np.asarray(codec.values, dtype=np.float64))
    raise AssertionError(f"format {name}: no independent grid for a {kind}; add its definition to "
                         "property_tests/independent_grid.py")


def element_grid(spec: qt.QuantSpec) -> np.ndarray:
    """Every representable element-domain value of ``spec``, ascending (float64)."""
    return _grid(spec.format, spec.symmetric, spec.restricted)


def _block(spec: qt.QuantSpec, shape: tuple[int, ...], *, pairs: bool = False) -> list[int]:
    g, n = spec.granularity, len(shape)
    if isinstance(g, qt.PerTensor):
        return list(shape)
    if isinstance(g, qt.PerChannel):
        return [1 if a == g.axis % n else shape[a] for a in range(n)]
    if isinstance(g, qt.PerGroup):
        size = spec.fmt.sub_block if pairs else g.size
        return [size if a == g.axis % n else 1 for a in range(n)]
    return list(g.shape) + [1] * (n - len(g.shape))


def _spread(t: np.ndarray, block: list[int], shape: tuple[int, ...]) -> np.ndarray:
    """A grid-shaped array repeated over its blocks and cropped to ``shape`` (padding dropped)."""
    for a, (b, n) in enumerate(zip(block, shape)):
        t = np.repeat(t, b, axis=a).take(np.arange(n), axis=a)
    return t


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy()


def element_scale(qp: qt.QParams, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """``(scale, zero_point)`` per element of a ``shape`` tensor, decoded from the stored parameters."""
    spec = qp.spec
    if spec.fmt.family == "microexp":  # E8M0 per block, one micro-exponent bit per pair
        axis = spec.granularity.axis % len(shape)
        ratio = spec.fmt.block // spec.fmt.sub_block
        e = np.repeat(qp.scale.numpy().astype(np.int64), ratio, axis=axis)
        shift = qt.unpack(qp.micro_exponent, 1, e.shape[-1]).numpy().astype(np.int64)
        s = np.exp2((e - 127 - shift - (spec.fmt.codec.bits - 2)).astype(np.float64))
        return _spread(s, _block(spec, shape, pairs=True), shape), np.zeros(shape)
    if spec.scale_dtype == "e8m0":
        s = np.exp2(qp.scale.numpy().astype(np.float64) - 127)
    else:
        s = _np(qp.scale)
    if qp.global_scale is not None:
        s = s * float(qp.global_scale)
    z = np.zeros_like(s) if qp.zero_point is None else _np(qp.zero_point)
    if spec.zero_point_domain == "offset":  # code * s + m: the value of code 0, as a grid shift -m / s
        z = -z / s
    block = _block(spec, shape)
    return _spread(s, block, shape), _spread(z, block, shape)


def _clip_limit(spec: qt.QuantSpec, top: float) -> float:
    """How far beyond the grid a minmax range may leave values, by the scale rule alone."""
    if spec.fmt.scheme is UNIT:  # a plain cast: no range is fitted
        return math.inf
    if spec.fmt.family == "microexp" or (spec.power_of_two and spec.scale_rule in ("floor", "even")):
        return 2.0 ** (math.floor(math.log2(top)) + 1)
    if spec.scale_dtype == "float8_e4m3fn":  # block scales rounded to nearest fp8 (3 mantissa bits)
        return top * (1 + 2.0 ** -3)
    return 0.0


def assert_on_grid(x: torch.Tensor, qp: qt.QParams, y: torch.Tensor) -> None:
    """Raise ``AssertionError`` naming the worst element unless ``y`` (the round trip of ``x``) is
    within half a grid step of ``x`` and clips only what the scale rule allows (see the module)."""
    spec = qp.spec
    shape = tuple(x.shape)
    xs, ys = _np(x), _np(y)
    s, z = element_scale(qp, shape)
    grid = element_grid(spec)
    v = xs / s + z
    first, last = grid[0], grid[-1]
    edge_lo = (grid[1] - grid[0]) / 2 if grid.size > 1 else 0.5
    edge_hi = (grid[-1] - grid[-2]) / 2 if grid.size > 1 else 0.5
    vc = np.clip(v, first, last)
    above = np.clip(np.searchsorted(grid, vc, side="left"), 0, grid.size - 1)
    below = np.clip(np.searchsorted(grid, vc, side="right") - 1, 0, grid.size - 1)
    half = (grid[above] - grid[below]) / 2
    half = np.where(v > last, edge_hi, np.where(v < first, edge_lo, half))
    if spec.rounding == "stochastic":
        half = 2 * half
    tol = (np.abs(v) + np.abs(z)) * 2.0 ** -20  # float32 rounding of the scale, x / scale and the zero point
    clipped = (v > last + edge_hi + tol) | (v < first - edge_lo - tol)
    err = np.abs(ys - xs)
    slack = 2.0 ** -20 * (np.abs(xs) + np.abs(z) * s + half * s) + 2.0 ** -148
    allowed = np.where(clipped, np.abs(v - vc) * s, half * s) + slack
    top = max(abs(first), abs(last))
    limit = _clip_limit(spec, top)
    beyond = clipped & ~(np.abs(v) <= limit * (1 + 2.0 ** -20))
    # y itself decodes to a grid point (a value decoded past float32's maximum saturates to it)
    w = ys / s + z
    i = np.clip(np.searchsorted(grid, w), 0, grid.size - 1)
    gap = np.minimum(np.abs(w - grid[i]), np.abs(w - grid[np.maximum(i - 1, 0)]))
    unrepresentable = (gap > (np.abs(w) + np.abs(z)) * 2.0 ** -20 + 2.0 ** -148 / s) & (np.abs(ys) < FLOAT32_MAX)
    for what, bad in (("clipped beyond what the scale rule allows", beyond), ("off the grid", err > allowed),
                      ("dequantized to a value that is not on the grid", unrepresentable)):
        if bad.any():
            i = np.unravel_index(int(np.argmax(np.where(bad, err - allowed, -np.inf))), shape)
            raise AssertionError(
                f"{spec}: {int(bad.sum())} value(s) {what}; worst at {tuple(int(k) for k in i)}: x = {xs[i]!r}, "
                f"dq = {ys[i]!r}, scale = {s[i]!r}, zero point = {z[i]!r}, element value {v[i]!r} on the grid "
                f"[{first}, {last}], error {err[i]!r} > allowed {allowed[i]!r}")

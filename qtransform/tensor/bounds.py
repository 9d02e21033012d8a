"""Per-element round-trip error bounds, stated by each format's codec.

``|x - dequantize(quantize(x, qp))| <= error_bound(x, qp)`` (up to float32 arithmetic):
inside the representable range the bound is the codec's half grid spacing around
``v = x / scale + zero_point`` (a full spacing for stochastic rounding), times the
scale; beyond it, values saturate to the range's end, which is representable, so the
error is exactly the distance to it (computed in the x domain).

>>> import torch, qtransform as qt
>>> x = torch.tensor([0.3, -1.0, 0.7])
>>> qp = qt.choose_qparams(x, qt.QuantSpec(format="int8"))
>>> bool((qt.dequantize(qt.quantize(x, qp)) - x).abs().le(qt.error_bound(x, qp) * 1.0001).all())
True
"""

from __future__ import annotations

import torch

from . import blocks
from .types import QParams
from .quantize import _blocked, _from_element, _limit, _offset, _to_element, _wide, element_range

__all__ = ["error_bound"]


def error_bound(x: torch.Tensor, qparams: QParams) -> torch.Tensor:
    """Bound on ``|x - dequantize(quantize(x, qparams))|``, elementwise (float32, shape of ``x``)."""
    p, xb, s, z = _blocked(x, qparams, None)
    spec = qparams.spec
    offset = _offset(spec)
    wide = _offset(spec) and _wide(spec, _limit(spec, s, z, torch.float32, xb))
    v = _to_element(xb, s, z, offset=offset, wide=wide)
    lo, hi = element_range(spec)
    vc = v if lo is None else v.clamp(lo, hi)
    half = spec.fmt.codec.half_spacing(vc)
    if spec.rounding == "stochastic":
        half = 2 * half
    # beyond the range the error is the distance to the (representable) end, taken in the x
    # domain: v - clamp(v) would lose most of its digits when v is large and the excess small
    saturated = _from_element(vc, s, z, offset=offset, wide=wide)
    bound = torch.where(vc == v, half * s, (xb - saturated).abs())
    return blocks.unview(bound, p)

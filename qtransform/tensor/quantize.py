"""``quantize`` / ``dequantize`` / ``fake_quantize``: pure, vectorized, transform-friendly.

>>> import torch, qtransform as qt
>>> x = torch.tensor([[0.1, -0.5, 0.25, 1.0]])
>>> spec = qt.QuantSpec(format="int4", granularity=qt.PerChannel(0))
>>> qp = qt.choose_qparams(x, spec)
>>> q = qt.quantize(x, qp)
>>> qt.dequantize(q)  # scale 1/7.5 ("full" range): +amax maps to 7.5 and saturates to 7
tensor([[ 0.1333, -0.5333,  0.2667,  0.9333]])

All three work under ``torch.func.grad``, ``torch.func.vmap`` and ``torch.compile``
and never modify their inputs. ``fake_quantize`` has a straight-through gradient:
1 for inputs inside the representable range, 0 where they are clipped, and the
LSQ gradient with respect to a float32 scale (``round(v) - v`` inside the range).
"""

from __future__ import annotations

import torch

from .. import formats
from .._checks import check_finite, check_float_tensor, differentiated, under_transform, where
from ..spec import QuantSpec
from . import blocks
from .checks import check_out_dtype
from .types import QParams, QTensor

__all__ = ["quantize", "dequantize", "fake_quantize", "fake_quantize_grid", "element_range", "roundtrip_blocks"]


def element_range(spec: QuantSpec) -> tuple[float | None, float | None]:
    """Saturation bounds of the element domain (``(None, None)`` for ``saturate=False``)."""
    if not spec.saturate:
        return None, None
    return spec.fmt.codec.qrange(symmetric=spec.symmetric, restricted=spec.restricted)


def _noise(shape, device, spec: QuantSpec, generator):
    if spec.rounding != "stochastic":
        return None
    if generator is None:
        raise ValueError("rounding='stochastic' needs explicit randomness: pass generator=torch.Generator "
                         "or generator=<int seed> (qtransform never draws from the global RNG)")
    if isinstance(generator, int) and not isinstance(generator, bool):
        generator = torch.Generator(device=device).manual_seed(generator)
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or an int seed, got {type(generator).__name__}")
    return torch.rand(shape, generator=generator, device=device)


def _blocked(x: torch.Tensor, qparams: QParams, path):
    """Validate and return (plan, x blocked, scale, zero point) broadcast over blocks."""
    if not isinstance(qparams, QParams):
        raise TypeError(f"{where(path)}qparams must be a QParams, got {type(qparams).__name__}")
    return _on_grid(x, qparams.spec, *qparams.effective(), path)


def _on_grid(x: torch.Tensor, spec: QuantSpec, s: torch.Tensor, z, path):
    """(plan, x blocked, scale, zero point) broadcast over blocks, from grid-shaped effective parameters."""
    check_float_tensor(x, path=path)
    p = blocks.tiling(x.shape, spec, sub_block=True, path=path)
    if tuple(s.shape) != p.grid:
        raise ValueError(f"{where(path)}qparams scale grid {tuple(s.shape)} does not match x of shape "
                         f"{tuple(x.shape)} under {spec.granularity} (expected grid {p.grid})")
    if s.device != x.device:
        raise ValueError(f"{where(path)}qparams are on {s.device} but x is on {x.device}; move one "
                         "explicitly (qtransform never moves tensors between devices)")
    xb = blocks.view(x.to(torch.float32), p)
    return p, xb, blocks.expand(s, p), None if z is None else blocks.expand(z, p)


def _offset(spec: QuantSpec) -> bool:
    """Whether ``spec``'s zero point is an offset (``code * scale + zero_point``)."""
    return spec.zero_point_domain == "offset"


def _to_element(xb, s, z, *, offset: bool = False, differentiable: bool = False, wide: bool = False):
    if z is None:
        return xb / s
    if offset:  # wide: where x - z overflows (parameters near the largest float), at half size
        v = (xb - z) / s
        return torch.where(torch.isfinite(v), v, (xb * 0.5 - z * 0.5) / (s * 0.5)) if wide else v
    # addcdiv is one pass, but its backward is not exactly 1/s; the STE path divides plainly
    return xb / s + z if differentiable else torch.addcdiv(z, xb, s)


def _from_element(vals, s, z, *, offset: bool = False, inplace: bool = False, wide: bool = False):
    """``(vals - z) * s`` (``vals * s + z`` with ``offset``: for the element grid's integers and a 16-bit
    scale the product is exact in float32, so the sum rounds once, as GGUF's ``d * q + m``; ``wide``
    forms it at half size where the full-size product overflows although the sum need not);
    with ``inplace`` the fresh ``vals`` buffer is reused (two passes, no copies)."""
    if offset and z is not None:
        if wide:  # where the product overflows although the sum need not, at half size
            y = vals * s + z
            return torch.where(torch.isfinite(y), y, (vals * (s * 0.5) + z * 0.5) * 2)
        return vals.mul_(s).add_(z) if inplace else vals * s + z
    if inplace:
        return (vals if z is None else vals.sub_(z)).mul_(s)
    return (vals if z is None else vals - z) * s


_F32_MAX = torch.finfo(torch.float32).max


def _limit(spec: QuantSpec, s: torch.Tensor, z, dtype: torch.dtype, like: torch.Tensor) -> float | None:
    """The largest finite value of ``dtype`` (float32 at most) when a code of ``spec`` may decode
    beyond it, else ``None``.

    Data near the largest float of its dtype can decode a hair beyond it (the code ``qmin`` of a
    "full" symmetric range, a scale rounded up to its storage dtype or to a power of two): such a
    value saturates to the largest finite one, which is closer to the input, instead of
    overflowing to Inf. On CPU a grid-sized check on ``s``, ``z`` (the effective parameters) tells
    whether any code can reach it; elsewhere (no host sync) and under ``vmap``/``compile`` the
    answer is yes. ``saturate=False`` keeps the format's Inf: ``None``.
    """
    if not spec.saturate:
        return None
    limit = min(float(torch.finfo(dtype).max), _F32_MAX)
    if not under_transform(like) and like.device.type == "cpu":
        lo, hi = spec.fmt.codec.qrange(symmetric=False, restricted=False)
        zmax = 0.0 if z is None else float(z.detach().abs().amax())
        smax = float(s.detach().abs().amax())  # an imported scale may be negative (GGUF Q4_0)
        reach = smax * max(abs(lo), abs(hi)) + zmax if _offset(spec) else smax * (max(abs(lo), abs(hi)) + zmax)
        if reach * (1.0 + 2.0 ** -10) <= limit:
            return None
    return limit


def _wide(spec: QuantSpec, limit: float | None) -> bool:
    """Whether an offset spec's ``code * scale`` may overflow before the offset is added: parameters
    near the largest float (``limit`` set), unless they are fp16 (at most ``255 * 65504``)."""
    return _offset(spec) and limit is not None and spec.scale_dtype != "float16"


def _straight_through(vq, g, s, z, limit: float, *, offset: bool = False, spec_wide: bool = False) -> torch.Tensor:
    """``(g - z) * s`` (``g * s + z`` with ``offset``) clamped to ``+-limit``, with the gradient of the same
    form in ``vq`` (``vq`` equals ``g`` forward): the differentiable value is formed at half scale, so it
    cannot overflow, and its forward value cancels exactly (``t - t.detach() == 0``)."""
    value = _from_element(g, s.detach(), None if z is None else z.detach(), offset=offset,
                          wide=offset and spec_wide).clamp(-limit, limit)
    exact = s.detach().abs() >= 2.0 ** -125  # halving a normal scale above 2^-125 is exact
    half = torch.where(exact, s * 0.5, s)
    if offset and z is not None:
        z = z * torch.where(exact, 0.5, 1.0)
    t = _from_element(vq, half, z, offset=offset)
    return value + (t - t.detach()) * torch.where(exact, 2.0, 1.0)


def quantize(x: torch.Tensor, qparams: QParams, *, generator=None, path: str | None = None) -> QTensor:
    """Quantize ``x`` with ``qparams``: ``codes = encode(x / scale + zero_point)``.

    Args:
        x: floating tensor whose shape fits ``qparams`` (same grid).
        qparams: from :func:`compute_qparams`, :func:`choose_qparams` or an algorithm.
        generator: ``torch.Generator`` or int seed; required for stochastic rounding.
        path: tree path, for error messages.

    Returns:
        A :class:`QTensor` with compact codes (sub-byte codes bit-packed along the last axis).
    """
    p, xb, s, z = _blocked(x, qparams, path)
    check_finite(x, path=path)
    spec = qparams.spec
    codec = spec.fmt.codec
    lo, hi = element_range(spec)
    offset = _offset(spec)
    v = _to_element(xb, s, z, offset=offset, wide=offset and _wide(spec, _limit(spec, s, z, torch.float32, xb)))
    codes = codec.encode(v, rounding=spec.rounding, noise=_noise(v.shape, x.device, spec, generator),
                         lo=lo, hi=hi)
    codes = blocks.unview(codes, p)
    if codec.packed:
        codes = formats.pack(codes, codec.bits)
    return QTensor(codes=codes, qparams=qparams, width=x.shape[-1], dtype=x.dtype)


def unpacked_codes(q: QTensor) -> torch.Tensor:
    """The codes of ``q`` in their unpacked container, shape ``q.shape``."""
    codec = q.spec.fmt.codec
    if not codec.packed:
        return q.codes
    codes = formats.unpack(q.codes, codec.bits, q.width, signed=codec.signed)
    return codes if codes.dtype == codec.code_dtype else codes.to(codec.code_dtype)


def dequantize(q: QTensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``(decode(codes) - zero_point) * scale`` (``decode(codes) * scale + zero_point`` for
    ``zero_point_domain="offset"``) in ``q.dtype`` (or ``dtype``, a floating dtype), shape
    ``q.shape``. Values that would round past the largest finite value of ``q.dtype`` saturate to it
    (never Inf, unless the spec says ``saturate=False``)."""
    if not isinstance(q, QTensor):
        raise TypeError(f"dequantize expects a QTensor, got {type(q).__name__}")
    if dtype is not None:
        check_out_dtype(dtype, name="dequantize: dtype")
    spec = q.spec
    codes = unpacked_codes(q)
    p = blocks.tiling(codes.shape, spec, sub_block=True)
    s, z = q.qparams.effective()
    decoded = spec.fmt.codec.decode(codes)  # elementwise: decode before padding (float8 cannot be gathered)
    vals = blocks.view(decoded, p)
    inplace = (not under_transform(vals) and not s.requires_grad and (z is None or not z.requires_grad)
               and decoded.data_ptr() != codes.data_ptr())
    limit = _limit(spec, s, z, q.dtype, vals)
    y = _from_element(vals, blocks.expand(s, p), None if z is None else blocks.expand(z, p), offset=_offset(spec),
                      inplace=inplace, wide=_wide(spec, limit))
    if limit is not None:
        y = y.clamp_(-limit, limit) if inplace else y.clamp(-limit, limit)
    return blocks.unview(y, p).to(q.dtype if dtype is None else dtype)


def roundtrip_blocks(v: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Element-domain values rounded onto the format's grid (half to even, saturating)."""
    lo, hi = element_range(spec)
    rounding = "half_even" if spec.rounding == "stochastic" else spec.rounding
    return spec.fmt.codec.round(v, rounding=rounding, lo=lo, hi=hi)


def fake_quantize(x: torch.Tensor, qparams: QParams, *, generator=None, path: str | None = None,
                  range_grad: bool = False) -> torch.Tensor:
    """``dequantize(quantize(x, qparams))`` with a straight-through gradient.

    Differentiable with respect to ``x`` (1 inside the representable range, 0 where clipped)
    and to a float32 ``qparams.scale`` / float ``zero_point`` (LSQ-style), in reverse mode
    (``torch.func.grad``, ``backward``) and forward mode (``torch.func.jvp``, ``jacfwd``) alike.
    ``range_grad=True`` (for parameters fitted to ``x`` itself, as dynamic quantization fits them): the
    gradient also flows through the scale as a function of ``x``, the scale taken proportional to each
    block's range (``max |x|``; ``max x - min x`` with a zero point), the values unchanged. Parameters
    learned in another form than they are stored (an fp16 or power-of-two scale, an integer zero point):
    :func:`qtransform.learn.fake_quantize`.
    """
    if not isinstance(qparams, QParams):
        raise TypeError(f"{where(path)}qparams must be a QParams, got {type(qparams).__name__}")
    s, z = qparams.effective()
    return fake_quantize_grid(x, qparams.spec, s, z, generator=generator, path=path, range_grad=range_grad)


def fake_quantize_grid(x: torch.Tensor, spec: QuantSpec, scale: torch.Tensor, zero_point: torch.Tensor | None, *,
                       generator=None, path: str | None = None, range_grad: bool = False) -> torch.Tensor:
    """:func:`fake_quantize` with the *effective* float32 ``scale`` and ``zero_point`` given on the grid
    (what ``QParams.effective()`` returns): the values, and the gradients with respect to both, of a
    parameterisation the caller computes (:func:`qtransform.learn.fake_quantize`: learned ranges whose
    stored form is rounded with a straight-through gradient)."""
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"{where(path)}spec must be a QuantSpec, got {type(spec).__name__}")
    p, xb, s, z = _on_grid(x, spec, scale, zero_point, path)
    check_finite(x, path=path)
    if range_grad and differentiated(x):
        dims = blocks.reduce_dims(p)
        r = xb.abs().amax(dim=dims, keepdim=True) if z is None else \
            xb.amax(dim=dims, keepdim=True) - xb.amin(dim=dims, keepdim=True)
        ref = r.detach()
        s = s * torch.where(ref > 0, r / torch.where(ref > 0, ref, 1.0), 1.0)  # an all-zero block: scale as is
    lo, hi = element_range(spec)
    needs_grad = differentiated(x) or differentiated(s) or differentiated(z)
    offset = _offset(spec)
    limit = _limit(spec, s, z, x.dtype, xb)
    v = _to_element(xb, s, z, offset=offset, differentiable=needs_grad,
                    wide=offset and _wide(spec, _limit(spec, s, z, torch.float32, xb)))
    g = spec.fmt.codec.round(v.detach(), rounding=spec.rounding,
                             noise=_noise(v.shape, x.device, spec, generator), lo=lo, hi=hi)
    if not needs_grad:  # nothing to differentiate: the rounded values, rescaled in place
        y = _from_element(g, s, z, offset=offset, inplace=not under_transform(g), wide=_wide(spec, limit))
        if limit is not None:
            y = y.clamp(-limit, limit) if under_transform(g) else y.clamp_(-limit, limit)
        return blocks.unview(y, p).to(x.dtype)
    vc = v if lo is None else v.clamp(lo, hi)
    vq = vc + (g - vc).detach()
    y = _from_element(vq, s, z, offset=offset) if limit is None else \
        _straight_through(vq, g, s, z, limit, offset=offset, spec_wide=_wide(spec, limit))
    return blocks.unview(y, p).to(x.dtype)

"""GGUF block formats and our specs: which of them is which, and the bytes both ways.

A GGUF tensor of logical shape ``(rows, k)`` is stored row by row in blocks along ``k`` (the
last torch axis, GGUF's ``ne0``). The block formats this module maps exactly:

========  ================================================  =============================================
GGUF      block (bytes)                                     our spec (``PerGroup(block)`` along the rows)
========  ================================================  =============================================
Q8_0      fp16 ``d``, 32 int8 ``q``: ``d * q``              int8 sym (restricted or full), fp16 scale
Q4_0      fp16 ``d``, 16 bytes: ``d * (q - 8)``             int4 sym (uint4 sym: zero point 8), fp16 scale
Q4_1      fp16 ``d``, fp16 ``m``, 16 bytes: ``d * q + m``   uint4 asym ``zero_point_domain="offset"``, fp16
MXFP4     E8M0 exponent, 16 bytes of fp4 e2m1               mxfp4
Q4_K      fp16 ``d``, ``dmin``, 6-bit scales and mins per   import only: uint4 g32 offset, float32 scale
          32, 128 bytes: ``d*sc*q - dmin*m`` (256 elems)    ``d*sc`` and offset ``-dmin*m`` (both exact)
Q6_K      6-bit codes, int8 scales per 16, fp16 ``d``:      import only: int6 sym g16, float32 scale
          ``d * sc * (q - 32)``                             ``d*sc`` (exact)
========  ================================================  =============================================

Every 4-bit block stores element ``j`` of a 32-element run in the low nibble of byte ``j`` and
element ``j + 16`` in the high nibble. ``encode_blocks`` writes our codes and parameters as they are
(no re-quantization); ``decode_blocks`` reads GGUF blocks into a :class:`~qtransform.QTensor` whose
:func:`~qtransform.dequantize` gives the bits the ``gguf`` package's dequantization gives.
``quantize_k`` writes Q4_K / Q6_K blocks from float weights (the nearest types for specs GGUF has
no exact block for; a plain round-to-nearest with no-clip scales, not llama.cpp's search).
"""

from __future__ import annotations

import numpy as np
import torch

import qtransform as qt

__all__ = ["BLOCKS", "EXACT_TYPES", "IMPORT_SPECS", "exact_type", "encode_blocks", "decode_blocks", "quantize_k"]

#: GGUF type name -> (elements per block, bytes per block).
BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "MXFP4": (32, 17), "Q4_K": (256, 144),
          "Q6_K": (256, 210)}
#: Block types :func:`encode_blocks` writes from our codes as they are (and the casts' F16 / BF16).
EXACT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "MXFP4")
_CASTS = {"bf16": "BF16", "fp16": "F16"}


def _g(size: int) -> qt.PerGroup:
    return qt.PerGroup(size)


#: GGUF type name -> the spec :func:`decode_blocks` gives.
IMPORT_SPECS = {
    "Q8_0": qt.QuantSpec(format="int8", granularity=_g(32), symmetric_range="restricted", scale_dtype="float16"),
    "Q4_0": qt.QuantSpec(format="int4", granularity=_g(32), scale_dtype="float16"),
    "Q4_1": qt.QuantSpec(format="uint4", granularity=_g(32), symmetric=False, zero_point_domain="offset",
                         scale_dtype="float16"),
    "MXFP4": qt.QuantSpec(format="mxfp4"),
    "Q4_K": qt.QuantSpec(format="uint4", granularity=_g(32), symmetric=False, zero_point_domain="offset"),
    "Q6_K": qt.QuantSpec(format="int6", granularity=_g(16)),
}


def _along_rows(spec: qt.QuantSpec, size: int) -> bool:
    g = spec.granularity
    return isinstance(g, qt.PerGroup) and g.size == size and g.axis in (-1, 1)


def exact_type(spec: qt.QuantSpec) -> str | None:
    """The GGUF block type that holds ``spec`` bit for bit (``None``: none does). Shapes aside: the
    rows must also be a multiple of 32 long (see :func:`encode_blocks`).

    >>> import qtransform as qt
    >>> spec = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False,
    ...                     zero_point_domain="offset", scale_dtype="float16")
    >>> exact_type(spec), exact_type(spec.replace(zero_point_domain="float"))
    ('Q4_1', None)
    """
    if spec.format in _CASTS:  # the bf16 / fp16 casts: their codes are the values
        return _CASTS[spec.format]
    if spec.format == "mxfp4":
        return "MXFP4" if _along_rows(spec, 32) else None
    if not _along_rows(spec, 32) or spec.scale_dtype != "float16":
        return None
    if spec.format == "int8" and spec.symmetric:
        return "Q8_0"
    if spec.format in ("int4", "uint4") and spec.symmetric:
        return "Q4_0"
    if spec.format == "uint4" and spec.zero_point_domain == "offset":
        return "Q4_1"
    return None


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``(rows, k)`` values 0..15 -> ``(rows, k / 2)`` bytes, per 32: ``j`` low, ``j + 16`` high."""
    c = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(codes.shape[0], -1)


def _unnibble(b: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_nibbles`: ``(rows, blocks, 16)`` bytes -> ``(rows, blocks * 32)`` values 0..15."""
    return torch.stack([b & 15, b >> 4], dim=2).reshape(b.shape[0], -1)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``(rows, blocks)`` tensor -> ``(rows, blocks, itemsize)`` raw bytes (little-endian)."""
    t = t.contiguous()
    return t.view(torch.uint8).reshape(*t.shape, t.element_size())


def encode_blocks(q: qt.QTensor, qtype: str, *, path: str = "tensor") -> np.ndarray:
    """GGUF blocks of the 2-D ``q`` (a spec :func:`exact_type` maps to ``qtype``): ``(rows, row bytes)``
    uint8, the codes and parameters as stored (no re-quantization)."""
    if exact_type(q.spec) != qtype:
        raise ValueError(f"{path}: {q.spec} is not GGUF {qtype} (exact type: {exact_type(q.spec)})")
    if qtype == "F16":
        return qt.dequantize(q, dtype=torch.float16).numpy()
    if qtype == "BF16":
        y = qt.dequantize(q, dtype=torch.bfloat16).contiguous()
        return y.view(torch.uint8).reshape(*y.shape[:-1], -1).numpy()
    if len(q.shape) != 2 or q.shape[1] % 32:
        raise ValueError(f"{path}: GGUF {qtype} holds rows of a multiple of 32 elements, got shape {tuple(q.shape)}")
    rows = q.shape[0]
    codes = qt.unpacked_codes(q)
    blocks = codes.shape[1] // 32
    if qtype == "Q8_0":
        parts = [_bytes(q.qparams.scale), codes.view(torch.uint8).reshape(rows, blocks, 32)]
    elif qtype == "Q4_0":
        shift = 8 if q.spec.format == "int4" else 0  # uint4 sym: codes already carry the zero point 8
        z = q.qparams.zero_point
        if shift == 0 and z is not None and not bool((z == 8).all()):
            raise ValueError(f"{path}: uint4 symmetric zero points other than 8 are not GGUF Q4_0")
        nib = _nibbles((codes.to(torch.int16) + shift)).reshape(rows, blocks, 16)
        parts = [_bytes(q.qparams.scale), nib]
    elif qtype == "Q4_1":
        nib = _nibbles(codes).reshape(rows, blocks, 16)
        parts = [_bytes(q.qparams.scale), _bytes(q.qparams.zero_point), nib]
    else:  # MXFP4: E8M0 exponent byte, then the fp4 codes (sign bit 3, the same code points as ggml's table)
        nib = _nibbles(codes).reshape(rows, blocks, 16)
        parts = [q.qparams.scale.reshape(rows, blocks, 1), nib]
    return torch.cat(parts, dim=2).reshape(rows, -1).numpy()


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).squeeze(-1)


def decode_blocks(raw: np.ndarray, qtype: str, shape: tuple[int, int], dtype: torch.dtype = torch.float32, *,
                  path: str = "tensor") -> qt.QTensor:
    """The :class:`~qtransform.QTensor` (spec :data:`IMPORT_SPECS` ``[qtype]``) of GGUF blocks ``raw``
    (``(rows, row bytes)`` uint8) of a tensor of logical ``shape``; ``ValueError`` naming ``path`` when
    the bytes do not fit."""
    if qtype not in IMPORT_SPECS:
        raise ValueError(f"{path}: GGUF type {qtype} has no exact qtransform spec")
    size, nbytes = BLOCKS[qtype]
    if len(shape) != 2:
        raise ValueError(f"{path}: a {qtype} tensor of shape {tuple(shape)}: quantized GGUF tensors here are "
                         "matrices (rows, columns)")
    rows, k = shape
    if k % size or raw.size != rows * k // size * nbytes:
        raise ValueError(f"{path}: {raw.size} bytes do not hold a {qtype} tensor of shape {tuple(shape)}")
    b = torch.from_numpy(np.array(raw, dtype=np.uint8)).reshape(rows, k // size, nbytes)  # a copy: files map read-only
    spec = IMPORT_SPECS[qtype]
    if qtype == "Q8_0":
        codes, fields = b[:, :, 2:].reshape(rows, k).view(torch.int8), {"scale": _f16(b[:, :, :2])}
    elif qtype == "Q4_0":
        codes = (_unnibble(b[:, :, 2:]).to(torch.int8) - 8)
        fields = {"scale": _f16(b[:, :, :2])}
    elif qtype == "Q4_1":
        codes, fields = _unnibble(b[:, :, 4:]), {"scale": _f16(b[:, :, :2]), "zero_point": _f16(b[:, :, 2:4])}
    elif qtype == "MXFP4":
        codes, fields = _unnibble(b[:, :, 1:]), {"scale": b[:, :, 0].contiguous()}
    elif qtype == "Q4_K":
        codes, fields = _decode_q4_k(b, rows, k)
    else:
        codes, fields = _decode_q6_k(b, rows, k)
    codec = spec.fmt.codec
    codes = codes.to(codec.code_dtype)
    stored = qt.pack(codes, codec.bits) if codec.packed else codes.contiguous()
    return qt.QTensor(codes=stored, qparams=qt.QParams(spec=spec, **fields), width=k, dtype=dtype)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins (int32, ``(..., 8)``)."""
    s = s.to(torch.int32)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc, mn


def _decode_q4_k(b, rows, k):
    d, dmin = _f16(b[..., 0:2]).float(), _f16(b[..., 2:4]).float()
    sc, mn = _k_scale_min(b[..., 4:16])
    # float32 d * sc (11 + 6 significant bits) and dmin * m are exact: the values d*sc*q - dmin*m are
    # code * scale + offset with scale d*sc and offset -(dmin*m), rounded once as GGUF rounds them
    scale = (d[..., None] * sc.float()).reshape(rows, -1)
    offset = -(dmin[..., None] * mn.float()).reshape(rows, -1)
    qs = b[..., 16:].reshape(rows, -1, 4, 32)  # 4 runs of 32 bytes: 64 elements each (low, then high nibbles)
    codes = torch.stack([qs & 15, qs >> 4], dim=3).reshape(rows, k)
    return codes, {"scale": scale, "zero_point": offset}


def _decode_q6_k(b, rows, k):
    ql, qh = b[..., :128].to(torch.int32), b[..., 128:192].to(torch.int32)
    sc = b[..., 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[..., 208:210]).float()
    n = ql.shape[1]
    low = torch.stack([ql.reshape(rows, n, 2, 64) & 15, ql.reshape(rows, n, 2, 64) >> 4], dim=3)  # (.., 2, 2, 64)
    high = torch.stack([(qh.reshape(rows, n, 2, 32) >> (2 * j)) & 3 for j in range(4)], dim=3)  # (.., 2, 4, 32)
    codes = (low.reshape(rows, n, 256) | (high.reshape(rows, n, 256) << 4)) - 32
    scale = (d[..., None] * sc).reshape(rows, -1)  # 11 + 8 significant bits: exact in float32
    return codes.reshape(rows, k), {"scale": scale}


def _round_up_f16(x: torch.Tensor) -> torch.Tensor:
    low = x.to(torch.float16)
    up = torch.nextafter(low, torch.full_like(low, float("inf")))
    return torch.where(low.float() < x, up, low)


def quantize_k(w: torch.Tensor, qtype: str) -> np.ndarray:
    """Q4_K or Q6_K blocks of the float ``(rows, k)`` weight ``w`` (``k`` a multiple of 256):
    round to nearest under scales and mins rounded so that no value clips."""
    if qtype not in ("Q4_K", "Q6_K") or w.dim() != 2 or w.shape[1] % 256:
        raise ValueError(f"quantize_k: {qtype} of a (rows, k) weight with k a multiple of 256, got {tuple(w.shape)}")
    rows, k = w.shape
    x = w.detach().to(torch.float32).reshape(rows, k // 256, -1, 32 if qtype == "Q4_K" else 16)
    return (_q4_k(x) if qtype == "Q4_K" else _q6_k(x)).reshape(rows, -1).numpy()


def _q4_k(x):
    lo = x.amin(-1).clamp(max=0)
    hi = x.amax(-1).clamp(min=0)
    dmin = _round_up_f16((-lo).amax(-1) / 63)
    mn = torch.where(dmin[..., None] > 0, torch.ceil(-lo / dmin.float()[..., None].clamp(min=1e-30)), 0).clamp(0, 63)
    off = dmin.float()[..., None] * mn  # value = d*sc*q - off
    need = (hi + off) / 15
    d = _round_up_f16(need.amax(-1) / 63)
    sc = torch.where(d[..., None] > 0, torch.ceil(need / d.float()[..., None].clamp(min=1e-30)), 0).clamp(0, 63)
    s = d.float()[..., None] * sc
    q = torch.where(s[..., None] > 0, torch.round((x + off[..., None]) / s[..., None].clamp(min=1e-30)), 0).clamp(0, 15)
    sc, mn = sc.to(torch.int32), mn.to(torch.int32)
    lo4, hi4 = sc[..., :4], sc[..., 4:]
    mlo, mhi = mn[..., :4], mn[..., 4:]
    scales = torch.cat([lo4 | ((hi4 >> 4) << 6), mlo | ((mhi >> 4) << 6), (hi4 & 15) | ((mhi & 15) << 4)], dim=-1)
    qb = q.to(torch.uint8).reshape(*q.shape[:2], 4, 2, 32)  # pairs of 32-runs share 32 bytes
    qs = (qb[..., 0, :] | (qb[..., 1, :] << 4)).reshape(*q.shape[:2], 128)
    return torch.cat([_bytes(d)[..., :], _bytes(dmin), scales.to(torch.uint8), qs], dim=-1)


def _q6_k(x):
    amax = x.abs().amax(-1)
    need = amax / 31
    d = _round_up_f16(need.amax(-1) / 127)
    sc = torch.where(d[..., None] > 0, torch.ceil(need / d.float()[..., None].clamp(min=1e-30)), 0).clamp(0, 127)
    s = d.float()[..., None] * sc
    c = torch.where(s[..., None] > 0, torch.round(x / s[..., None].clamp(min=1e-30)), 0).clamp(-32, 31)
    u = (c + 32).to(torch.int32).reshape(*x.shape[:2], 256)
    low, high = u & 15, u >> 4
    lb = low.reshape(*x.shape[:2], 2, 2, 64)
    ql = (lb[..., 0, :] | (lb[..., 1, :] << 4)).reshape(*x.shape[:2], 128)
    hb = high.reshape(*x.shape[:2], 2, 4, 32)
    qh = (hb[..., 0, :] | (hb[..., 1, :] << 2) | (hb[..., 2, :] << 4) | (hb[..., 3, :] << 6)).reshape(*x.shape[:2], 64)
    return torch.cat([ql.to(torch.uint8), qh.to(torch.uint8), sc.to(torch.int8).view(torch.uint8), _bytes(d)], dim=-1)

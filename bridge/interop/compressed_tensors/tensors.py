"""Our quantized tensors as compressed-tensors stores them, and back, bit for bit.

One layer's tensors, by storage kind (:data:`bridge.interop.compressed_tensors.config.Mapping.kind`); names are
local to the module (``weight_packed``...), shapes are compressed-tensors' (``(1,)`` per tensor,
``(rows, 1)`` per channel, ``(rows, groups)`` per group):

==========  =====================================================================================
``pack``    ``weight_packed`` int32: codes offset by ``2^(b-1)`` (unsigned), a little-endian bit
            stream of each row in 32-bit words (8 codes of 4 bits per word; dense for 3, 5, 6, 7
            bits); ``weight_shape`` int64; ``weight_scale``; ``weight_zero_point`` (asymmetric:
            packed the same way down the output rows for channel and group scales, int8 otherwise)
``int``     ``weight`` int8 signed codes (``int-quantized``: integer weights with integer
            activations), ``weight_scale``, ``weight_zero_point`` int8
``float``   ``weight`` float8_e4m3fn, ``weight_scale``
``mxfp4``   ``weight_packed`` uint8 (two E2M1 codes a byte, low nibble first), ``weight_scale``
            uint8 E8M0 exponents; ``nvfp4``: fp8 block scales and ``weight_global_scale``, the
            *reciprocal* of our float32 tensor scale (chosen so that it inverts back exactly)
``mxfp6``   ``weight_packed`` uint8: four E2M3 codes in three bytes; ``weight_scale`` uint8
``mxfp8``   ``weight`` float8_e4m3fn, ``weight_scale`` uint8
==========  =====================================================================================

Our unsigned integer formats are compressed-tensors' signed ones shifted by ``2^(b-1)``: a
symmetric ``uint4`` (zero point 8) is a symmetric ``int4``; an asymmetric one keeps its zero
point shifted the same way.

>>> import torch, qtransform as qt
>>> w = torch.randn(4, 64)
>>> q = qt.quantize(w, qt.choose_qparams(w, qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False)))
>>> from bridge.interop.compressed_tensors.config import weight_mapping
>>> m = weight_mapping(q.spec)
>>> parts = to_ct(q, m.kind, args=m.args, where="fc.weight")
>>> sorted((k, tuple(v.shape), str(v.dtype)) for k, v in parts.items())  # doctest: +NORMALIZE_WHITESPACE
[('weight_packed', (4, 8), 'torch.int32'), ('weight_scale', (4, 2), 'torch.float32'),
 ('weight_shape', (2,), 'torch.int64'), ('weight_zero_point', (1, 2), 'torch.int32')]
>>> back = from_ct(parts, m.kind, q.spec, (4, 64), torch.float32, args=m.args, where="fc.weight")
>>> torch.equal(qt.dequantize(back), qt.dequantize(q))
True
"""

from __future__ import annotations

import sys

import torch

import qtransform as qt

from ...checkpoint.layout import abstract_qtensor, check_like

__all__ = ["to_ct", "from_ct", "pack_int32", "unpack_int32", "reciprocal", "ct_scale_shape"]


def _check_host() -> None:
    if sys.byteorder != "little":
        raise ValueError("compressed-tensors: packing int32 words is implemented for little-endian hosts only")


def _packed_len(n: int, bits: int) -> int:
    return qt.pack(torch.zeros((1, n), dtype=torch.uint8), bits).shape[-1]


def pack_int32(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``bits``-bit codes (``(rows, n)``) as compressed-tensors' int32 words ``(rows, ceil(n*bits/32))``."""
    _check_host()
    stream = qt.pack(u.to(torch.uint8), bits)
    words = -(-u.shape[-1] * bits // 32)
    pad = 4 * words - stream.shape[-1]  # the last word's unused bytes (never more than 3)
    return torch.nn.functional.pad(stream, (0, pad)).contiguous().view(torch.int32)


def unpack_int32(w: torch.Tensor, bits: int, n: int, *, where: str = "compressed-tensors") -> torch.Tensor:
    """Inverse of :func:`pack_int32`: ``(rows, n)`` uint8 codes. ``ValueError`` naming ``where`` unless ``w``
    is int32 with exactly the ``ceil(n * bits / 32)`` words ``n`` codes of ``bits`` bits fill (never cut or
    padded to fit: a width that disagrees with ``bits`` is a wrong config or file) and the last word's
    unused bytes are zero."""
    _check_host()
    words = -(-n * bits // 32)
    if w.dtype != torch.int32 or w.dim() != 2 or w.shape[-1] != words:
        raise ValueError(f"{where}: packed tensor of shape {list(w.shape)} and dtype {w.dtype}; {n} codes of {bits} "
                         f"bits a row take {words} int32 words (the file's packing and num_bits disagree)")
    raw, used = w.contiguous().view(torch.uint8), _packed_len(n, bits)
    if bool(raw[..., used:].any()):
        raise ValueError(f"{where}: packed tensor has bits set past its {n} codes of {bits} bits (the file's "
                         "packing and num_bits disagree)")
    return qt.unpack(raw[..., :used].contiguous(), bits, n)


def reciprocal(g: torch.Tensor) -> torch.Tensor:
    """``1 / g`` in float32, shape ``(1,)``, chosen among the nearest floats so that ``1 / (1 / g)``
    gives ``g`` back (compressed-tensors stores NVFP4's tensor scale as its reciprocal)."""
    r = (1.0 / g.double()).float().reshape(1)
    for cand in (r, torch.nextafter(r, r + 1), torch.nextafter(r, r - 1)):
        if torch.equal((1.0 / cand.double()).float().reshape(()), g.reshape(()).float()):
            return cand
    return r


def ct_scale_shape(args: dict, shape) -> tuple[int, ...]:
    """compressed-tensors' shape of the scale of a ``shape`` weight stored with ``args``."""
    rows, cols = shape
    strategy = args["strategy"]
    if strategy == "tensor":
        return (1,)
    if strategy == "channel":
        return (rows, 1)
    if strategy in ("group", "tensor_group"):
        return (rows, -(-cols // args["group_size"]))
    br, bc = args["block_structure"]
    return (-(-rows // br), -(-cols // bc))


def _offset(spec: qt.QuantSpec) -> int:
    """What our codes subtract to be compressed-tensors' signed codes (``2^(b-1)`` for unsigned formats)."""
    codec = spec.fmt.codec
    return 0 if codec.signed else 1 << (codec.bits - 1)


def _int_parts(q: qt.QTensor, where: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Signed (compressed-tensors) codes and zero point (``None`` when symmetric) as int32."""
    spec, bits = q.spec, q.spec.fmt.codec.bits
    off, lo, hi = _offset(spec), -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    codes = qt.unpacked_codes(q).to(torch.int32) - off
    zp = q.qparams.zero_point
    if spec.symmetric:
        if zp is not None and not bool((zp.to(torch.int32) == off).all()):
            raise ValueError(f"{where}: a symmetric {spec.format} with zero points other than {off}")
        return codes, None
    z = zp.to(torch.int32) - off
    if not bool(((z >= lo) & (z <= hi)).all()):
        raise ValueError(f"{where}: zero points outside [{lo + off}, {hi + off}], which compressed-tensors "
                         f"cannot store in {bits} bits")
    return codes, z


def _float_scale(q: qt.QTensor) -> torch.Tensor:
    """The stored scale (float dtypes as they are; power-of-two E8M0 decoded to float32)."""
    s = q.qparams.scale
    return s if s.is_floating_point() else q.qparams.effective()[0]


def to_ct(q: qt.QTensor, kind: str, *, args: dict | None = None, where: str) -> dict[str, torch.Tensor]:
    """compressed-tensors' tensors (local names) of the 2-D weight ``q`` stored as ``kind``
    (``args``: its QuantizationArgs, needed for ``pack``/``int``/``float``)."""
    if len(q.shape) != 2:
        raise ValueError(f"{where}: a {len(q.shape)}-D weight; compressed-tensors stores 2-D weights")
    rows, cols = q.shape
    if kind in ("mxfp4", "nvfp4", "mxfp6", "mxfp8"):
        out = {"weight_packed" if kind != "mxfp8" else "weight": q.codes, "weight_scale": q.qparams.scale}
        if kind == "nvfp4":
            out["weight_global_scale"] = reciprocal(q.qparams.global_scale)
        return out
    if args is None:
        raise TypeError(f"{where}: to_ct needs the QuantizationArgs (args=) of a {kind!r} weight")
    shape = ct_scale_shape(args, q.shape)
    scale = _float_scale(q).reshape(shape)
    if kind == "float":
        return {"weight": q.codes, "weight_scale": scale}
    bits = q.spec.fmt.codec.bits
    codes, zp = _int_parts(q, where)
    if kind == "int":
        out = {"weight": codes.to(torch.int8), "weight_scale": scale}
        if zp is not None:
            out["weight_zero_point"] = zp.to(torch.int8).reshape(shape)
        return out
    half = 1 << (bits - 1)
    out = {"weight_packed": pack_int32(codes + half, bits), "weight_scale": scale,
           "weight_shape": torch.tensor([rows, cols], dtype=torch.int64)}
    if zp is not None:
        zp = zp.reshape(shape)
        if args["strategy"] in ("group", "channel"):
            out["weight_zero_point"] = pack_int32((zp + half).T, bits).T.contiguous()
        else:
            out["weight_zero_point"] = zp.to(torch.int8)
    return out


def _scale_like(t: torch.Tensor, want: torch.Tensor, where: str) -> torch.Tensor:
    """A compressed-tensors scale as our stored scale ``want`` (shape and dtype; E8M0 exponents from
    exact powers of two)."""
    if t.numel() != want.numel():
        raise ValueError(f"{where}: weight_scale has {t.numel()} entries, {tuple(want.shape)} expected")
    t = t.reshape(want.shape)
    if want.dtype == torch.uint8 and t.is_floating_point():  # a power-of-two scale read back as E8M0
        e = torch.log2(t.float())
        if not bool((torch.exp2(torch.round(e)) == t.float()).all()):
            raise ValueError(f"{where}: weight_scale holds values that are not powers of two")
        return (torch.round(e) + 127).to(torch.uint8)
    if t.dtype != want.dtype:
        raise ValueError(f"{where}: weight_scale has dtype {t.dtype}, {want.dtype} expected")
    return t


def _our_codes(signed: torch.Tensor, spec: qt.QuantSpec) -> torch.Tensor:
    """Signed (compressed-tensors) codes ``(rows, n)`` as our stored codes of ``spec``."""
    codec = spec.fmt.codec
    c = (signed.to(torch.int32) + _offset(spec)).to(codec.code_dtype)
    return qt.pack(c, codec.bits) if codec.packed else c


def from_ct(parts: dict, kind: str, spec: qt.QuantSpec, shape, dtype: torch.dtype, *, args: dict | None = None,
            where: str) -> qt.QTensor:
    """Our QTensor (``spec``, logical ``shape``, dequantized ``dtype``) from one layer's
    compressed-tensors tensors ``parts`` (local names) stored as ``kind``. ``ValueError`` naming
    ``where`` for a missing tensor, a shape or dtype that does not fit."""
    want = abstract_qtensor(shape, dtype, spec)
    rows, cols = shape
    try:
        if kind in ("mxfp4", "nvfp4", "mxfp6", "mxfp8"):
            fields = {"scale": parts["weight_scale"].reshape(want.qparams.scale.shape)}
            if kind == "nvfp4":
                fields["global_scale"] = (1.0 / parts["weight_global_scale"].double()).float().reshape(())
            codes = parts["weight" if kind == "mxfp8" else "weight_packed"]
        else:
            fields = {"scale": _scale_like(parts["weight_scale"], want.qparams.scale, where)}
            if kind == "float":
                codes = parts["weight"]
            else:
                bits, half = spec.fmt.codec.bits, 1 << (spec.fmt.codec.bits - 1)
                if kind == "int" and parts["weight"].dtype != torch.int8:
                    raise ValueError(f"{where}: weight has dtype {parts['weight'].dtype}; int-quantized codes are int8")
                signed = parts["weight"].to(torch.int32) if kind == "int" else \
                    unpack_int32(parts["weight_packed"], bits, cols, where=f"{where}_packed").to(torch.int32) - half
                codes = _our_codes(signed, spec)
                zwant = want.qparams.zero_point
                if not spec.symmetric:
                    z = parts["weight_zero_point"]
                    if kind == "pack" and z.dtype == torch.int32:  # packed down the output rows
                        z = unpack_int32(z.T.contiguous(), bits, rows, where=f"{where}_zero_point").T.to(torch.int32) \
                            - half
                    elif z.dtype != torch.int8:
                        raise ValueError(f"{where}_zero_point: dtype {z.dtype}; compressed-tensors stores zero points "
                                         "as int8 (or packed in int32 words)")
                    fields["zero_point"] = (z.to(torch.int32).reshape(zwant.shape) + _offset(spec)).to(zwant.dtype)
                elif zwant is not None:  # our symmetric unsigned formats store their fixed mid-range zero point
                    fields["zero_point"] = torch.full(zwant.shape, _offset(spec), dtype=zwant.dtype)
    except KeyError as e:
        raise ValueError(f"{where}: missing compressed-tensors tensor {e.args[0]!r} for {spec}") from None
    except RuntimeError as e:  # a reshape that does not fit
        raise ValueError(f"{where}: compressed-tensors tensors do not fit a {list(shape)} weight of {spec} ({e})") \
            from None
    q = qt.QTensor(codes=codes.contiguous(), qparams=qt.QParams(spec=spec, **fields), width=cols, dtype=dtype)
    check_like(where, q, want)
    return q

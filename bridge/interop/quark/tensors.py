"""A quantized weight as Quark stores it, and back: names, packing, transposes and scale shapes.

For a linear layer ``M`` with weight ``(out, in)`` Quark's HF format holds ``M.weight`` (the codes),
``M.weight_scale`` and, for integer dtypes, ``M.weight_zero_point`` (zeros when symmetric: its loader
always reads one). Per dtype and scheme:

============  ==========================  ====================  =================================
dtype         ``weight``                  ``weight_scale``      ``weight_zero_point``
============  ==========================  ====================  =================================
int4/uint4    int32, 8 codes a word in    per group:            int4 codes packed like the weight
              AWQ order [0,2,4,6,1,3,5,7]  ``(in/g, out)``;      (per group ``(in/g, out/8)``, per
              (per group: transposed,     per channel ``(out,)``  channel ``(out/8,)``), a scalar
              ``(in, out/8)``; else       per tensor ``()``     int32 per tensor; float32 zero
              ``(out, in/8)``)                                  points unpacked, shaped as the scale
int8/uint8    int8/uint8 (per group       as above              int8/uint8, shaped as the scale
              transposed ``(in, out)``)
fp8           float8 ``(out, in)``        ``()`` or ``(out,)``  none
MX fp4/fp6    uint8: fp4 two a byte       uint8 E8M0            none
              (element 2k low nibble),    ``(out, in/32)``
              fp6 four in three bytes
MX fp8        float8 ``(out, in)``        uint8 ``(out, in/32)``  none
============  ==========================  ====================  =================================

Our codes use the same bit patterns (two's complement nibbles, OCP fp4/fp6 encodings, E8M0
exponents) and the same little-endian sub-byte order for fp4/fp6, so only the layout changes.

>>> import torch, qtransform as qt
>>> w = torch.randn(16, 64)
>>> q = qt.quantize(w, qt.choose_qparams(w, qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))))
>>> parts = to_quark(q, "fc.weight")
>>> {k: (tuple(v.shape), v.dtype) for k, v in parts.items()}
{'weight': ((64, 2), torch.int32), 'weight_scale': ((2, 16), torch.float32), 'weight_zero_point': ((2, 2), torch.int32)}
>>> torch.equal(qt.dequantize(from_quark(parts, q.spec, (16, 64), torch.float32, "fc.weight")), qt.dequantize(q))
True
"""

from __future__ import annotations

import torch

import qtransform as qt

from ...checkpoint.layout import abstract_qtensor

__all__ = ["to_quark", "from_quark", "shape_problem", "symmetric_zero"]


def _nibbles(q: qt.QTensor) -> torch.Tensor:
    return qt.unpack(q.codes, 4, q.width)


def _pack4(nibbles: torch.Tensor) -> torch.Tensor:
    """``(rows, n)`` codes (low 4 bits used) -> ``(rows, n/8)`` int32 words in AWQ order."""
    return qt.pack(nibbles.to(torch.uint8) & 15, 4, container=torch.int32, order="awq")


def _unpack4(words: torch.Tensor, n: int, signed: bool, order: str = "awq") -> torch.Tensor:
    return qt.unpack(words, 4, n, container=torch.int32, order=order, signed=signed)


def symmetric_zero(fmt: str) -> int:
    """The zero point a symmetric ``fmt`` (int4/uint4/int8/uint8) decodes with: 0, or ``2^(N-1)`` unsigned."""
    return 1 << (qt.get_format(fmt).codec.bits - 1) if fmt.startswith("u") else 0


def shape_problem(spec: qt.QuantSpec, shape) -> str | None:
    """Why a weight of ``shape`` quantized with ``spec`` has no Quark layout (``None``: it has one)."""
    if len(shape) != 2:
        return f"a {len(shape)}-D weight; Quark quantizes the 2-D weights of linear layers"
    out, n = shape
    g = spec.granularity
    if isinstance(g, qt.PerGroup) and n % g.size:
        return f"group size {g.size} does not divide the {n} input features (Quark does not pad groups)"
    if spec.format in ("int4", "uint4"):  # codes (and per-channel zero points) packed 8 to an int32
        if not isinstance(g, qt.PerGroup) and n % 8:
            return f"{n} input features are not a multiple of 8 (Quark packs them 8 to an int32)"
        if not isinstance(g, qt.PerTensor) and out % 8:
            return f"{out} output features are not a multiple of 8 (Quark packs them 8 to an int32)"
    return None


def _scale_out(s: torch.Tensor, g) -> torch.Tensor:
    if isinstance(g, qt.PerTensor):
        return s.reshape(())
    if isinstance(g, qt.PerChannel):
        return s.reshape(-1)
    return s


def to_quark(q: qt.QTensor, path: str) -> dict[str, torch.Tensor]:
    """``{"weight", "weight_scale"[, "weight_zero_point"]}`` of the 2-D weight ``q`` in Quark's layout
    (the caller has checked the spec with :func:`~bridge.interop.quark.config.judge` and the shape with
    :func:`shape_problem`)."""
    spec, g = q.spec, q.spec.granularity
    why = shape_problem(spec, q.shape)
    if why is not None:
        raise ValueError(f"{path}: {why}")
    grouped = isinstance(g, qt.PerGroup)
    scale, zp = q.qparams.scale, q.qparams.zero_point
    if spec.format in ("int4", "uint4", "int8", "uint8"):
        rows = spec.granularity
        if zp is None:
            zp = torch.full(scale.shape, symmetric_zero(spec.format), dtype=torch.int32)
        elif spec.zero_point_domain == "offset":  # x = code * s + m  ~  (code - (-m / s)) * s
            zp = -(zp.to(torch.float32) / scale.to(torch.float32))
        if grouped:
            scale, zp = scale.t(), zp.t()
        float_zp = zp.is_floating_point()
        if spec.format in ("int4", "uint4"):
            nib = _nibbles(q)
            weight = _pack4(nib.t() if grouped else nib)
            if not float_zp:
                zp = _pack4(zp) if grouped else (_pack4(zp.reshape(1, -1)).reshape(-1) if isinstance(rows, qt.PerChannel)
                                                 else zp.reshape(()).to(torch.int32))
        else:
            weight = q.codes.t() if grouped else q.codes
            if not float_zp:
                zp = zp.to(q.codes.dtype)
        if not grouped:
            zp = _scale_out(zp, g) if zp.dim() else zp
        return {"weight": weight.contiguous(), "weight_scale": _scale_out(scale, g).contiguous(),
                "weight_zero_point": zp.contiguous()}
    # fp8 (per tensor / channel) and MX (per group of 32): codes as they are
    return {"weight": q.codes.contiguous(), "weight_scale": _scale_out(scale, g).contiguous()}


def _check(name: str, t: torch.Tensor, shape, dtype, path: str) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{path}: Quark tensor {name!r} has shape {tuple(t.shape)} and dtype {t.dtype}; "
                         f"expected shape {tuple(shape)} and dtype {dtype}")


def _check_zero_point(zp: torch.Tensor, scale: torch.Tensor, spec: qt.QuantSpec, g, four: bool, path: str) -> None:
    """The stored zero point has the shape and dtype the scale (already in our layout) and ``spec`` ask for:
    float ones shaped as the scale; 4-bit ones int32 words packed like the weight (a scalar per tensor);
    8-bit ones as the scale, in an integer dtype."""
    grouped = isinstance(g, qt.PerGroup)
    stored = tuple(scale.t().shape) if grouped else tuple(_scale_out(torch.empty(scale.shape, device="meta"), g).shape)
    if zp.is_floating_point():
        _check("weight_zero_point", zp, stored, zp.dtype, path)
    elif four:
        out = scale.shape[0] if grouped else scale.numel()
        want = (stored[0], out // 8) if grouped else (out // 8,) if isinstance(g, qt.PerChannel) else ()
        _check("weight_zero_point", zp, want, torch.int32, path)
    elif zp.dtype not in (torch.int8, torch.uint8, torch.int32):
        raise ValueError(f"{path}: Quark tensor 'weight_zero_point' has dtype {zp.dtype}; expected an 8-bit or int32 "
                         "integer (or a float) dtype")
    else:
        _check("weight_zero_point", zp, stored, zp.dtype, path)


def from_quark(parts, spec: qt.QuantSpec, shape, dtype: torch.dtype, path: str, *, reorder: bool = True) -> qt.QTensor:
    """The QTensor of a ``shape``/``dtype`` weight quantized with ``spec`` from Quark's ``parts``
    (``{"weight", "weight_scale"[, "weight_zero_point"]}``), bit for bit; ``ValueError`` naming
    ``path`` when a tensor is missing or has the wrong shape or dtype. ``reorder=False`` reads 4-bit
    words in sequential order (Quark's ``pack_method: "order"``) instead of the AWQ order."""
    why = shape_problem(spec, shape)
    if why is not None:
        raise ValueError(f"{path}: {why}")
    want = abstract_qtensor(shape, dtype, spec)
    ws, wz = want.qparams.scale, want.qparams.zero_point
    g, grouped = spec.granularity, isinstance(spec.granularity, qt.PerGroup)
    out, n = shape
    for name in ("weight", "weight_scale"):
        if name not in parts:
            raise ValueError(f"{path}: the Quark checkpoint has no {name!r} for this quantized weight")
    scale = parts["weight_scale"]
    _check("weight_scale", scale, ws.t().shape if grouped and spec.format in ("int4", "uint4", "int8", "uint8")
           else _scale_out(torch.empty(ws.shape, device="meta"), g).shape, ws.dtype, path)
    zero_point = None
    if spec.format in ("int4", "uint4", "int8", "uint8"):
        if grouped:
            scale = scale.t()
        scale = scale.reshape(ws.shape).contiguous()
        if "weight_zero_point" not in parts:
            raise ValueError(f"{path}: the Quark checkpoint has no 'weight_zero_point' for this integer weight")
        zp = parts["weight_zero_point"]
        four = spec.format in ("int4", "uint4")
        _check_zero_point(zp, scale, spec, g, four, path)
        if four:
            signed = spec.format == "int4"
            _check("weight", parts["weight"], (n, out // 8) if grouped else (out, n // 8), torch.int32, path)
            order = "awq" if reorder else "sequential"
            codes = _unpack4(parts["weight"], out if grouped else n, signed, order)
            codes = qt.pack((codes.t() if grouped else codes).contiguous(), 4)
        else:
            codes = parts["weight"].t() if grouped else parts["weight"]
        if four and not zp.is_floating_point() and zp.dim():
            zp = _unpack4(zp if grouped else zp.reshape(1, -1), out, signed, order)
        if grouped:
            zp = zp.t()
        if wz is None:  # signed symmetric: Quark's zeros are not ours to keep
            if torch.any(zp != 0):
                raise ValueError(f"{path}: a symmetric {spec.format} weight has non-zero zero points")
        else:
            zero_point = zp.reshape(wz.shape).to(wz.dtype).contiguous()
            if not zp.is_floating_point() and not torch.equal(zero_point.to(zp.dtype), zp.reshape(wz.shape)):
                raise ValueError(f"{path}: zero points outside the {wz.dtype} range of {spec}")
    else:
        codes = parts["weight"]
        scale = scale.reshape(ws.shape).contiguous()
    _check("weight", codes, want.codes.shape, want.codes.dtype, path)
    return qt.QTensor(codes=codes.contiguous(), qparams=qt.QParams(spec=spec, scale=scale, zero_point=zero_point),
                      width=n, dtype=dtype)

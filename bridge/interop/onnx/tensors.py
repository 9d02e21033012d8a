"""Which quantized tensors ONNX's ``DequantizeLinear`` / ``QuantizeLinear`` (opset 21) hold exactly, and
their parts: integer or fp8 codes, the scale, the zero point, ``axis`` and ``block_size``.

ONNX decodes ``y = (x - x_zero_point) * x_scale`` with ``x`` and the zero point of one integer (or fp8)
element type, the scale broadcast per tensor, along one ``axis``, or in blocks of ``block_size`` along
that axis (the scale's dimension there is ``ceil(size / block_size)``, our padded last group). That is
our ``(code - zero_point) * scale``:

==========================  ===============================  ======================================
ours                        ONNX element type                zero point
==========================  ===============================  ======================================
int1 .. int4 / int5 .. int8 INT4 / INT8 (the codes fit)      none (0), or our integer zero points
uint1 .. uint4 / .. uint8   UINT4 / UINT8                    ``2^(bits-1)`` when symmetric, else ours
fp8 e4m3 / e5m2 (+ fnuz)    FLOAT8E4M3FN / E5M2 (FNUZ)       none
==========================  ===============================  ======================================

Scales stay in their dtype (float16 and bfloat16 ones are ``Cast`` to float32 before the
``DequantizeLinear``: exact). ``PerTensor``, ``PerChannel(axis)`` and ``PerGroup(size, axis)`` map; 2-D
``PerBlock`` tiles, float (HQQ) and offset (GGUF) zero points, E8M0 and two-level scales (MX, NVFP4),
NF4 and the other codebooks, fp4/fp6 and block-float formats have no ``DequantizeLinear`` form.
Activations: static quantizers of a layer's input (``QuantizeLinear`` + ``DequantizeLinear``), per tensor
or per feature, whose code range is the whole ONNX type (int4/uint4/int8/uint8 full range, fp8), rounded
half to even as ONNX rounds. Dynamic quantizers (ONNX has only ``DynamicQuantizeLinear``: uint8, per
tensor, asymmetric) and the output and key/value-cache roles are refused.

>>> import torch, qtransform as qt
>>> w = torch.randn(4, 64)
>>> q = qt.quantize(w, qt.choose_qparams(w, qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False)))
>>> p = weight_parts(q, "fc.weight")
>>> p.onnx_type, p.codes.shape, p.scale.shape, p.zero_point.shape, p.axis, p.block_size
('UINT4', (4, 64), (4, 2), (4, 2), 1, 32)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

import qtransform as qt

from ..base import Support

__all__ = ["judge", "weight_parts", "activation_parts", "opset_problem", "Parts", "FP8_TYPES", "DYNAMIC"]

#: Our fp8 formats -> ONNX element type names (``onnx.TensorProto`` attributes).
FP8_TYPES = {"fp8_e4m3": "FLOAT8E4M3FN", "fp8_e5m2": "FLOAT8E5M2", "fp8_e4m3fnuz": "FLOAT8E4M3FNUZ",
             "fp8_e5m2fnuz": "FLOAT8E5M2FNUZ"}
_SCALES = ("float32", "float16", "bfloat16")
_ACT_ROLES = ("input",)
#: The one dynamic activation spec ONNX's ``DynamicQuantizeLinear`` computes (uint8, per tensor, asymmetric).
DYNAMIC = qt.QuantSpec(format="uint8", symmetric=False, dynamic=True)


class Parts(NamedTuple):
    """One ``DequantizeLinear``'s inputs and attributes, as numpy arrays in their storage dtype
    (int4/uint4 codes in int8/uint8 arrays, fp8 codes as their uint8 bit patterns)."""

    onnx_type: str                 # element type of codes and zero point ("INT4", "FLOAT8E4M3FN"...)
    codes: np.ndarray | None       # None for activations
    scale: np.ndarray              # float32, float16 or bfloat16 (as uint16 bits: see scale_dtype)
    scale_dtype: str               # "float32", "float16" or "bfloat16"
    zero_point: np.ndarray | None
    axis: int | None
    block_size: int | None


def _int_type(fmt: qt.Format) -> str:
    bits, signed = fmt.codec.bits, fmt.codec.signed
    return ("INT" if signed else "UINT") + ("4" if bits <= 4 else "8")


def judge(spec: qt.QuantSpec, role: str = "weight") -> Support:
    """Whether ONNX holds a tensor quantized with ``spec`` (``role``: ``"weight"`` or an activation
    site's role) exactly, and under what name; ``"no"`` with the reason otherwise (see the module
    docstring). Nothing is ``"nearest"``: ONNX Runtime reads what it can hold bit for bit."""
    fmt = spec.fmt
    if role != "weight" and role not in _ACT_ROLES:
        return Support("no", f"a {role} quantizer; the ONNX export quantizes layer inputs only (QuantizeLinear "
                             "before the MatMul), not outputs or the key/value cache")
    if fmt.family == "int" and fmt.codec.bits <= 8:
        onnx_type = _int_type(fmt)
    elif spec.format in FP8_TYPES:
        onnx_type = FP8_TYPES[spec.format]
    else:
        return Support("no", f"{spec.format} has no ONNX element type DequantizeLinear decodes (ONNX holds "
                             "int4/uint4/int8/uint8 and fp8 codes with a linear scale)")
    g = spec.granularity
    if isinstance(g, qt.PerBlock):
        return Support("no", "2-D blocks: DequantizeLinear blocks along one axis only (use PerGroup)")
    if spec.scale_dtype not in _SCALES:
        return Support("no", f"{spec.scale_dtype} scales (DequantizeLinear takes a float scale per block)")
    if not spec.symmetric and spec.zero_point_domain != "int":
        return Support("no", f"a {spec.zero_point_domain} zero point: DequantizeLinear's zero point is an integer "
                             "code (quantize with zero_point_domain='int')")
    if role == "weight":
        return Support("exact", f"DequantizeLinear({onnx_type}{', block_size' if isinstance(g, qt.PerGroup) else ''})")
    if spec.dynamic:
        if spec == DYNAMIC:
            return Support("exact", "DynamicQuantizeLinear + DequantizeLinear(UINT8)")
        return Support("no", "a dynamic activation quantizer ONNX cannot compute: DynamicQuantizeLinear is uint8, per "
                             "tensor, asymmetric with an integer zero point and a float32 scale (QuantSpec(format="
                             "'uint8', symmetric=False, dynamic=True)); use that or calibrate a static quantizer")
    if isinstance(g, qt.PerGroup) or (isinstance(g, qt.PerChannel) and g.axis != -1):
        return Support("no", f"a {g} activation quantizer (static QuantizeLinear is per tensor or per feature)")
    if spec.rounding != "half_even":
        return Support("no", f"{spec.rounding} rounding (QuantizeLinear rounds half to even)")
    if fmt.family == "int":
        lo, hi = fmt.codec.qrange(symmetric=spec.symmetric, restricted=spec.symmetric_range == "restricted")
        bits = 4 if fmt.codec.bits <= 4 else 8
        full = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if fmt.codec.signed else (0, (1 << bits) - 1)
        if (lo, hi) != full:
            return Support("no", f"codes clamped to [{lo:g}, {hi:g}]; QuantizeLinear saturates to the whole "
                                 f"{onnx_type} range {list(full)}")
    return Support("exact", f"QuantizeLinear + DequantizeLinear({onnx_type})")


def opset_problem(spec: qt.QuantSpec, opset: int) -> str | None:
    """Why ONNX opset ``opset`` cannot hold a tensor of ``spec`` that opset 21 holds (``None``: it can):
    int4/uint4 element types and ``block_size`` (per group) came in opset 21, fp8 in opset 19.

    >>> opset_problem(qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)), 19)
    'int4 codes need opset 21 (INT4/UINT4 element types), got 19'
    """
    if opset >= 21:
        return None
    if spec.fmt.family == "int" and spec.fmt.codec.bits <= 4:
        return f"{spec.format} codes need opset 21 (INT4/UINT4 element types), got {opset}"
    if isinstance(spec.granularity, qt.PerGroup):
        return f"per-group scales need opset 21 (DequantizeLinear's block_size), got {opset}"
    if spec.format in FP8_TYPES and opset < 19:
        return f"{spec.format} codes need opset 19 (float8 element types), got {opset}"
    return None


def _scale(q_scale: torch.Tensor) -> tuple[np.ndarray, str]:
    name = str(q_scale.dtype).removeprefix("torch.")
    t = q_scale.detach().cpu().contiguous()
    if name == "bfloat16":
        return t.view(torch.uint16).numpy().copy(), name
    return t.numpy().copy(), name


def _zero_point(spec: qt.QuantSpec, zp: torch.Tensor | None, shape, onnx_type: str, where: str) -> np.ndarray | None:
    fmt = spec.fmt
    if fmt.family != "int":
        return None
    np_dtype = np.int8 if onnx_type.startswith("INT") else np.uint8
    if zp is None:
        if fmt.codec.signed:
            return None
        return np.full(shape, 1 << (fmt.codec.bits - 1), dtype=np_dtype)
    z = zp.detach().cpu()
    if z.is_floating_point():
        raise ValueError(f"{where}: float zero points; DequantizeLinear takes integer ones")
    lo, hi = fmt.codec.qmin, fmt.codec.qmax
    if int(z.min()) < lo or int(z.max()) > hi:
        raise ValueError(f"{where}: zero points in [{int(z.min())}, {int(z.max())}] outside the {spec.format} code "
                         f"range [{lo}, {hi}]")
    return z.to(torch.int64).numpy().astype(np_dtype).reshape(shape)


def _layout(spec: qt.QuantSpec, rank: int, scale: np.ndarray) -> tuple[np.ndarray, int | None, int | None]:
    """The scale reshaped for ONNX (scalar, 1-D along ``axis``, or the block grid), axis, block_size."""
    g = spec.granularity
    if isinstance(g, qt.PerTensor):
        return scale.reshape(()), None, None
    if isinstance(g, qt.PerChannel):
        return scale.reshape(-1), g.axis % rank, None
    return scale, g.axis % rank, g.size


def weight_parts(q: qt.QTensor, path: str) -> Parts:
    """The ``DequantizeLinear`` inputs of the quantized tensor ``q`` (stored at ``path``, named in errors);
    ``ValueError`` when :func:`judge` refuses its spec or its zero points leave the code range."""
    spec = q.spec
    s = judge(spec, "weight")
    if s.kind != "exact":
        raise ValueError(f"{path}: {spec}: {s.note}")
    tensors = q.qparams.tensors()
    extra = sorted(set(tensors) - {"scale", "zero_point"})
    if extra:
        raise ValueError(f"{path}: quantization parameters {extra} have no DequantizeLinear input")
    onnx_type = judge_type(spec)
    codes = qt.unpacked_codes(q).detach().cpu().contiguous()
    if codes.dtype.is_floating_point:  # fp8: the bit patterns
        codes_np = codes.view(torch.uint8).numpy().copy()
    else:
        codes_np = codes.numpy().astype(np.int8 if onnx_type.startswith("INT") else np.uint8)
    scale, scale_dtype = _scale(q.qparams.scale)
    scale, axis, block = _layout(spec, codes.dim(), scale)
    zp = _zero_point(spec, q.qparams.zero_point, scale.shape, onnx_type, path)
    return Parts(onnx_type, codes_np, scale, scale_dtype, zp, axis, block)


def judge_type(spec: qt.QuantSpec) -> str:
    """The ONNX element type holding ``spec``'s codes (the spec is one :func:`judge` accepts)."""
    return FP8_TYPES[spec.format] if spec.format in FP8_TYPES else _int_type(spec.fmt)


def activation_parts(qparams: dict, spec: qt.QuantSpec, where: str) -> Parts:
    """The ``QuantizeLinear``/``DequantizeLinear`` inputs of a static activation quantizer whose stored
    tensors are ``qparams`` (``{"scale": ..., "zero_point": ...}``); the zero point is always given (it
    sets ``QuantizeLinear``'s output type): zeros for fp8 and signed symmetric ones."""
    s = judge(spec, "input")
    if s.kind != "exact":
        raise ValueError(f"{where}: {spec}: {s.note}")
    if qparams.get("scale") is None:
        raise ValueError(f"{where}: the checkpoint has no scale for this static activation quantizer")
    onnx_type = judge_type(spec)
    scale, scale_dtype = _scale(qparams["scale"])
    g = spec.granularity
    scale, axis = (scale.reshape(()), None) if isinstance(g, qt.PerTensor) else (scale.reshape(-1), -1)
    if spec.format in FP8_TYPES:
        zp = np.zeros(scale.shape, dtype=np.uint8)  # the bit pattern of +0
    else:
        zp = _zero_point(spec, qparams.get("zero_point"), scale.shape, onnx_type, where)
        if zp is None:
            zp = np.zeros(scale.shape, dtype=np.int8)
    return Parts(onnx_type, None, scale, scale_dtype, zp, axis, None)

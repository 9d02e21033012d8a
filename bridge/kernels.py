"""Forward paths of the quantized modules, chosen per module and device.

=================  ===========================================================  ================
kernel             when                                                         modules
=================  ===========================================================  ================
``int4pack_cpu``   CPU, integer codes of at most 4 bits, per-group scales       QLinear
                   (group 32/64/128/256 along in_features) or per-channel,
                   ``out_features % 16 == 0``: ``aten._weight_int4pack_mm_for_cpu``
``int8pack_cpu``   CPU, 8-bit integer codes, per-channel symmetric scales:      QLinear
                   ``aten._weight_int8pack_mm``
``fp8_scaled_mm``  CUDA with compute capability >= 8.9, float8_e4m3fn weights   QLinear
                   with per-tensor/per-channel scales *and* a float8_e4m3fn
                   input quantizer (real W8A8 fp8): ``torch._scaled_mm``
``gather``         embedding rows: dequantize only the rows looked up           QEmbedding(Bag)
``dequant``        everything: dequantize this one layer's weight, then the     all
                   float op (the reference)
=================  ===========================================================  ================

``module.kernel`` tells which path runs; ``kernel="dequant"`` (or any eligible name) forces
one. The packed CPU kernels compute in bfloat16 (activations and scales are cast to bf16,
accumulation is fp32): their output matches ``F.linear(x, dequantize(q))`` to bf16
rounding. The fp8 path quantizes activations as the module's input quantizer says, so
it matches the fake-quantized reference. Packed weights are derived on first use and
cached per device (never saved: their layout depends on the CPU).

>>> import torch, qtransform as qt
>>> from bridge import QLinear
>>> lin = torch.nn.Linear(256, 64)
>>> spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(128))
>>> m = QLinear.from_float(lin, qt.quantize(lin.weight.detach(), qt.choose_qparams(lin.weight.detach(), spec)))
>>> m.kernel, m.available_kernels()
('int4pack_cpu', ('int4pack_cpu', 'dequant'))
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

import qtransform as qt
from qtransform import scales
from qtransform.formats import IntCodec

__all__ = ["Kernel", "LINEAR_KERNELS", "EMBEDDING_KERNELS", "CONV_KERNELS", "eligible", "choose",
           "INT4_GROUPS", "int4pack_linear", "int8pack_linear", "fp8_linear"]

INT4_GROUPS = (256, 128, 64, 32)


class Kernel(NamedTuple):
    """A forward path: ``check(module, forced) -> reason or None``, ``prepare(module) -> state``,
    ``run(module, state, x, **kw) -> y`` (bias excluded). ``quantizes_input``: ``run`` consumes
    the module's input quantizer itself (a low-precision matmul), so it is not applied before."""

    name: str
    check: Callable
    prepare: Callable | None
    run: Callable
    quantizes_input: bool = False


# ----------------------------------------------------------------------- helpers
def _has_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


def _grid(module):
    """Effective scale grid shape (shapes only; works on meta buffers)."""
    s, _ = scales.effective(module.qweight.qparams)
    return tuple(s.shape)


def _int_codec(module):
    codec = module.spec.fmt.codec
    return codec if isinstance(codec, IntCodec) else None


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.reshape(-1, k)


def _linear_common(module) -> str | None:
    return "transposed (Conv1D) layout" if module.transposed else None


# ----------------------------------------------------------------------- int4 (CPU)
def _int4_check(module, forced: bool) -> str | None:
    if (r := _linear_common(module)) is not None:
        return r
    if module.weight.device.type != "cpu":
        return "not on CPU"
    if not (_has_op("_weight_int4pack_mm_for_cpu") and _has_op("_convert_weight_to_int4pack_for_cpu")):
        return "this torch has no int4pack CPU kernel"
    codec = _int_codec(module)
    if codec is None or codec.bits > 4:
        return f"codes are not integers of at most 4 bits ({module.spec.format})"
    n, k = module.qweight.shape
    if n % 16:
        return f"out_features {n} is not a multiple of 16"
    rows, groups = _grid(module)
    if rows not in (1, n) or k % groups or _int4_group(k, groups) is None:
        return f"scale grid {(rows, groups)} is not per-channel or per-group (32..256) along in_features"
    return None


def _int4_group(k: int, groups: int) -> int | None:
    g = k // groups
    if g in INT4_GROUPS:
        return g
    # coarser scales (per channel / per tensor) repeat onto the largest supported group dividing them
    return next((c for c in INT4_GROUPS if g % c == 0), None)


def _int4_prepare(module):
    q = module.qweight
    codec = _int_codec(module)
    n, k = q.shape
    s, z = scales.effective(q.qparams)
    group = _int4_group(k, s.shape[1])
    nibbles = (qt.unpacked_codes(q).to(torch.int32) - codec.qmin).contiguous()  # 0 .. 2^bits - 1
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 2)
    # the kernel computes (nibble - 8) * scale + zero; ours is (code - zero_point) * scale
    zero = (codec.qmin + 8 - (0.0 if z is None else z)) * s
    rep = (k // group) // s.shape[1]
    s, zero = (t.expand(n, -1).repeat_interleave(rep, dim=1) for t in (s, zero))
    scale_zeros = torch.stack([s.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return {"packed": packed, "group": group, "scale_zeros": scale_zeros}


def int4pack_linear(x: torch.Tensor, packed: torch.Tensor, group: int, scale_zeros: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for an int4pack weight (bf16 compute); ``x``: ``(..., K)`` -> ``(..., N)`` in x.dtype."""
    k = x.shape[-1]
    n = scale_zeros.shape[1]
    x2 = _rows(x, k)
    if x2.shape[0] == 0:
        return x.new_zeros(*x.shape[:-1], n)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16).contiguous(), packed, group, scale_zeros)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def _int4_run(module, st, x, **kw):
    return int4pack_linear(x, st["packed"], st["group"], st["scale_zeros"])


# ----------------------------------------------------------------------- int8 (CPU)
def _int8_shift(codec) -> int:
    return 0 if codec.signed else 128


def _int8_check(module, forced: bool) -> str | None:
    if (r := _linear_common(module)) is not None:
        return r
    if module.weight.device.type != "cpu":
        return "not on CPU"
    if not _has_op("_weight_int8pack_mm"):
        return "this torch has no int8pack kernel"
    codec = _int_codec(module)
    if codec is None or codec.bits != 8:
        return f"codes are not 8-bit integers ({module.spec.format})"
    n, _ = module.qweight.shape
    if _grid(module) not in ((n, 1), (1, 1)):
        return "scales are not per-channel (axis 0) or per-tensor"
    _, z = scales.effective(module.qweight.qparams)
    if z is not None:
        if z.device.type == "meta":
            return "zero points not loaded yet"
        if not bool((z == _int8_shift(codec)).all()):
            return "asymmetric (zero points other than the symmetric one)"
    return None


def _int8_prepare(module):
    q = module.qweight
    n, _ = q.shape
    codes = qt.unpacked_codes(q).to(torch.int16) - _int8_shift(_int_codec(module))
    s, _ = scales.effective(q.qparams)
    return {"codes": codes.to(torch.int8).contiguous(),
            "scale": s.expand(n, 1).reshape(n).to(torch.bfloat16).contiguous()}


def int8pack_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (codes * scale[:, None]).T`` with int8 ``codes`` (N, K) (bf16 compute)."""
    k = x.shape[-1]
    n = codes.shape[0]
    x2 = _rows(x, k)
    if x2.shape[0] == 0:
        return x.new_zeros(*x.shape[:-1], n)
    y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), codes, scale)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def _int8_run(module, st, x, **kw):
    return int8pack_linear(x, st["codes"], st["scale"])


# ----------------------------------------------------------------------- fp8 (GPU)
@functools.lru_cache(maxsize=64)
def _decode_is_cast(spec: qt.QuantSpec) -> bool:
    """The codec's decode of float8_e4m3fn codes is the plain cast (so _scaled_mm may consume them)."""
    codec = spec.fmt.codec
    if codec.code_dtype != torch.float8_e4m3fn:
        return False
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn)
    plain = codes.to(torch.float32)
    ok = torch.isfinite(plain)
    return bool(torch.equal(codec.decode(codes)[ok], plain[ok]))


def _fp8_check(module, forced: bool) -> str | None:
    if (r := _linear_common(module)) is not None:
        return r
    if not hasattr(torch, "_scaled_mm"):
        return "this torch has no _scaled_mm"
    dev = module.weight.device
    if not forced:
        if dev.type != "cuda" or torch.cuda.get_device_capability(dev) < (8, 9):
            return "needs a CUDA device with compute capability >= 8.9"
    q = module.qweight
    if not _decode_is_cast(q.spec) or q.qparams.zero_point is not None or q.qparams.global_scale is not None:
        return f"weights are not plain float8_e4m3fn codes with float scales ({q.spec.format})"
    n, k = q.shape
    if n % 16 or k % 16:
        return "in/out features are not multiples of 16"
    if _grid(module) not in ((n, 1), (1, 1)):
        return "weight scales are not per-tensor or per-channel"
    spec = getattr(module, "input_spec", None)
    if spec is None or not _decode_is_cast(spec) or spec.granularity not in (qt.PerTensor(), qt.PerChannel(0)):
        return "no float8_e4m3fn per-tensor/per-token input quantizer (fp8 _scaled_mm is W8A8)"
    return None


def fp8_linear(x_codes, x_scale, w_codes, w_scale, *, out_dtype: torch.dtype) -> torch.Tensor:
    """``(x_codes * x_scale) @ (w_codes * w_scale).T`` via ``torch._scaled_mm``.

    ``x_codes`` (M, K) and ``w_codes`` (N, K) float8_e4m3fn; scales float32 of shape () / (1, 1)
    (per tensor) or (M, 1) / (N, 1) (per row). Returns (M, N) in ``out_dtype``.
    """
    m, n = x_codes.shape[0], w_codes.shape[0]
    sa, sb = x_scale.to(torch.float32), w_scale.to(torch.float32)
    if sa.numel() == 1 and sb.numel() == 1:
        return torch._scaled_mm(x_codes, w_codes.t(), scale_a=sa.reshape(()), scale_b=sb.reshape(()),
                                out_dtype=out_dtype)
    sa = sa.reshape(-1, 1).expand(m, 1).contiguous()
    sb = sb.reshape(1, -1).expand(1, n).contiguous()
    y = torch._scaled_mm(x_codes, w_codes.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    return y.to(out_dtype)


def _fp8_run(module, st, x, **kw):
    from . import actquant

    k = x.shape[-1]
    x2 = _rows(x, k)
    qp = actquant.qparams_for(module, "input", x2)
    qx = qt.quantize(x2, qp)
    sx, _ = scales.effective(qp)
    q = module.qweight
    sw, _ = scales.effective(q.qparams)
    y = fp8_linear(qx.codes, sx, q.codes, sw, out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], q.shape[0])


# ----------------------------------------------------------------------- dequantize-then-op
def _always(module, forced):
    return None


def _dequant_linear(module, st, x, **kw):
    w = qt.dequantize(module.qweight, dtype=x.dtype)
    return F.linear(x, w.t() if module.transposed else w)


def _gather_check(module, forced: bool) -> str | None:
    q = module.qweight
    n = q.shape[0]
    block0 = q.spec.granularity.block_size(tuple(q.shape))[0]
    for name, t in q.qparams.tensors().items():
        if t.dim() == 0 or t.shape[0] == 1:
            continue
        if block0 != 1 or t.shape[0] != n:
            return f"qparams {name} of shape {tuple(t.shape)} cannot be gathered by row"
    return None


def _dequant_embedding(module, st, x, **kw):
    return module._lookup(x, qt.dequantize(module.qweight, dtype=module.compute_dtype), None, **kw)


def _gather_embedding(module, st, x, **kw):
    q = module.qweight
    rows, inverse = torch.unique(x.reshape(-1), return_inverse=True)
    parts = {}
    for name, t in q.qparams.tensors().items():
        parts[name] = t if (t.dim() == 0 or t.shape[0] == 1) else t.index_select(0, rows)
    sub = qt.QTensor(codes=q.codes.index_select(0, rows), width=q.width, dtype=q.dtype,
                     qparams=qt.QParams(spec=q.spec, **parts))
    return module._lookup(inverse.reshape(x.shape), qt.dequantize(sub, dtype=module.compute_dtype), rows, **kw)


def _dequant_conv(module, st, x, **kw):
    return module._conv(x, qt.dequantize(module.qweight, dtype=x.dtype), **kw)


LINEAR_KERNELS = {k.name: k for k in (
    Kernel("fp8_scaled_mm", _fp8_check, None, _fp8_run, quantizes_input=True),
    Kernel("int4pack_cpu", _int4_check, _int4_prepare, _int4_run),
    Kernel("int8pack_cpu", _int8_check, _int8_prepare, _int8_run),
    Kernel("dequant", _always, None, _dequant_linear),
)}
EMBEDDING_KERNELS = {k.name: k for k in (
    Kernel("gather", _gather_check, None, _gather_embedding),
    Kernel("dequant", _always, None, _dequant_embedding),
)}
CONV_KERNELS = {"dequant": Kernel("dequant", _always, None, _dequant_conv)}


def eligible(module, table: dict[str, Kernel]) -> tuple[str, ...]:
    """Names of the kernels of ``table`` that apply to ``module`` on its device, fastest first."""
    return tuple(name for name, k in table.items() if k.check(module, False) is None)


def choose(module, table: dict[str, Kernel], request: str) -> str:
    """Resolve ``request`` (``"auto"`` or a kernel name) for ``module``; ``ValueError`` if it cannot run."""
    if request == "auto":
        return eligible(module, table)[0]
    if request not in table:
        raise ValueError(f"kernel must be 'auto' or one of {list(table)}, got {request!r}")
    reason = table[request].check(module, True)
    if reason is not None:
        raise ValueError(f"kernel {request!r} cannot run this {type(module).__name__}: {reason}")
    return request

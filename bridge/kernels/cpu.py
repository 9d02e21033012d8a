"""CPU weight-only kernels: PyTorch's packed int4 (``_weight_int4pack_mm_for_cpu``) and int8
(``_weight_int8pack_mm``) matmuls, computing in bfloat16 (output = ``F.linear(x, dequantize(q))`` to
bf16 rounding). Packed weights are derived on first use (or by ``QModule.prepare``) and cached
per device (never saved: their layout depends on the CPU). From ``dense.PREFILL_ROWS`` tokens on,
both dequantize and call ``F.linear`` instead (:mod:`.dense`; float rounding only).

Scale blocks along in_features map onto the int4 kernel's group (32..256): the largest that
divides both the block and in_features, each block's scale repeated over its kernel groups, so a
padded last block (int4 g128 on 576 features: four groups of 128, one of 64) runs here too."""

from __future__ import annotations

import torch

import qtransform as qt

from . import decode, dense
from .base import LINEAR_KERNELS, Kernel, grid, has_op, int_codec, linear_common, register_kernel, rows
from .int4 import (INT4_GROUPS, int4_group, int4_reason, nibbles, packed_linear, per_kernel_group, prefill_state,
                   scale_and_zeros)

__all__ = ["INT4_GROUPS", "int4pack_linear", "int8pack_linear"]


def _int4_check(module, forced: bool) -> str | None:
    if (r := linear_common(module)) is not None:
        return r
    if module.weight.device.type != "cpu":
        return "not on CPU"
    if not (has_op("_weight_int4pack_mm_for_cpu") and has_op("_convert_weight_to_int4pack_for_cpu")):
        return "this torch has no int4pack CPU kernel"
    if (r := int4_reason(module)) is not None:
        return r
    n, _ = module.qweight.shape
    if n % 16:
        return f"out_features {n} is not a multiple of 16"
    return None


def _int4_prepare(module):
    q = module.qweight
    codec = int_codec(module)
    n, k = q.shape
    s, z = q.qparams.effective()
    offset = z is not None and module.spec.zero_point_domain == "offset"
    block = module.spec.granularity.block_size((n, k))[-1]
    group = int4_group(k, block)
    codes = qt.unpacked_codes(q)
    st = {"group": group, **prefill_state(module, group), "decode": None, "packed": None}
    few = decode.DECODE_MAX_ROWS
    if few and decode.decode_available():  # the GEMV kernel for few tokens (AVX2 build)
        zg = None if z is None else per_kernel_group(z, n, k, block, group)
        sg = per_kernel_group(s, n, k, block, group)
        st["decode"] = (decode.prepare_decode(codes, sg, offset=zg, qmin=codec.qmin) if offset else
                        decode.prepare_decode(codes, sg, zg, qmin=codec.qmin))
    limit = dense.PREFILL_ROWS.get("int4pack_cpu")
    if st["decode"] is None or limit is None or few < limit - 1:  # token counts between the two
        st["packed"] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles(q), 2)
        st["scale_zeros"] = scale_and_zeros(q, group)  # (nibble - 8) * scale + zero (see .int4)
    return st


def int4pack_linear(x: torch.Tensor, packed: torch.Tensor, group: int, scale_zeros: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for an int4pack weight (bf16 compute); ``x``: ``(..., K)`` -> ``(..., N)`` in x.dtype."""
    return packed_linear(torch.ops.aten._weight_int4pack_mm_for_cpu, x, packed, group, scale_zeros)


def _int4_run(module, st, x, **kw):
    y = dense.prefill_linear(module, "int4pack_cpu", st, x)
    if y is not None:
        return y
    if st["decode"] is not None and (st["packed"] is None or x.numel() <= decode.DECODE_MAX_ROWS * x.shape[-1]):
        return decode.int4_decode_linear(x, st["decode"])
    return int4pack_linear(x, st["packed"], st["group"], st["scale_zeros"])


def _int8_shift(codec) -> int:
    return 0 if codec.signed else 128


def _int8_check(module, forced: bool) -> str | None:
    if (r := linear_common(module)) is not None:
        return r
    if module.weight.device.type != "cpu":
        return "not on CPU"
    if not has_op("_weight_int8pack_mm"):
        return "this torch has no int8pack kernel"
    codec = int_codec(module)
    if codec is None or codec.bits != 8:
        return f"codes are not 8-bit integers ({module.spec.format})"
    n, k = module.qweight.shape
    if k % 8:  # the aten kernel reads in_features in steps of 8 (wrong results or a crash otherwise)
        return f"in_features {k} is not a multiple of 8"
    if grid(module) not in ((n, 1), (1, 1)):
        return "scales are not per-channel (axis 0) or per-tensor"
    if module.spec.zero_point_domain == "offset":
        return "asymmetric (an offset zero point)"
    _, z = module.qweight.qparams.effective()
    if z is not None:
        if z.device.type == "meta":
            return "zero points not loaded yet"
        if not bool((z == _int8_shift(codec)).all()):
            return "asymmetric (zero points other than the symmetric one)"
    return None


def _int8_prepare(module):
    q = module.qweight
    n, _ = q.shape
    codes = qt.unpacked_codes(q).to(torch.int16) - _int8_shift(int_codec(module))
    s, _ = q.qparams.effective()
    d_scale, d_offset = dense.affine_params(q)
    return {"codes": codes.to(torch.int8).contiguous(),
            "scale": s.expand(n, 1).reshape(n).to(torch.bfloat16).contiguous(),
            "dense": {"codes": module.weight, "dense_scale": d_scale, "dense_offset": d_offset, "signed": True}}


def int8pack_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (codes * scale[:, None]).T`` with int8 ``codes`` (N, K) (bf16 compute)."""
    k = x.shape[-1]
    n = codes.shape[0]
    x2 = rows(x, k)
    if x2.shape[0] == 0:
        return x.new_zeros(*x.shape[:-1], n)
    y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), codes, scale)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def _int8_run(module, st, x, **kw):
    y = dense.prefill_linear(module, "int8pack_cpu", st["dense"], x)
    return int8pack_linear(x, st["codes"], st["scale"]) if y is None else y


register_kernel(LINEAR_KERNELS, Kernel("int4pack_cpu", _int4_check, _int4_prepare, _int4_run))
register_kernel(LINEAR_KERNELS, Kernel("int8pack_cpu", _int8_check, _int8_prepare, _int8_run))

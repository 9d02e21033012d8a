"""What the packed int4 kernels (``int4pack_cpu``, ``int4pack_cuda``) share: which weights they take,
their group, and the ``scale_and_zeros`` operand.

Both aten kernels (``_weight_int4pack_mm_for_cpu`` and the CUDA tinygemm ``_weight_int4pack_mm``)
dequantize a stored nibble ``u`` (0..15) of kernel group ``g`` as ``(u - 8) * scale[g] + zero[g]``,
with ``scale_and_zeros`` of shape ``(K / group, N, 2)``. Our integer codes ``c`` (``qmin..qmax``,
at most 4 bits) are stored as ``u = c - qmin`` and our ``(c - zero_point) * scale`` (or
``c * scale + zero_point`` for an offset zero point) becomes ``zero = (qmin + 8 - zero_point) * scale``
(``(qmin + 8) * scale + zero_point``).

Scale blocks along in_features map onto the kernel's group (32..256): the largest that divides
both the block and in_features, each block's scale repeated over its kernel groups, so a padded
last block (int4 g128 on 576 features: four groups of 128, one of 64) runs too.

>>> import torch, qtransform as qt
>>> w = torch.randn(16, 128)
>>> q = qt.quantize(w, qt.choose_qparams(w, qt.QuantSpec(format="uint4", granularity=qt.PerGroup(64),
...                                                         symmetric=False)))
>>> sz = scale_and_zeros(q, 64).float()
>>> u = nibbles(q).reshape(16, 2, 64)
>>> w_ = ((u - 8) * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]).reshape(16, 128)
>>> bool(torch.allclose(w_, qt.dequantize(q), atol=2e-2 * w.abs().max().item()))
True
"""

from __future__ import annotations

import torch

import qtransform as qt

from . import dense
from .base import grid, int_codec

__all__ = ["packed_linear", "INT4_GROUPS", "int4_reason", "int4_group", "per_kernel_group", "nibbles", "scale_and_zeros",
           "pack_nibble_pairs", "prefill_state"]

#: The group sizes the aten int4 kernels take, largest first.
INT4_GROUPS = (256, 128, 64, 32)


def int4_group(k: int, block: int) -> int | None:
    """The kernel's group: the largest supported size dividing both the scale block along in_features
    and ``k`` (coarser scales, and a padded last block, repeat onto it).

    >>> int4_group(576, 128), int4_group(4096, 4096), int4_group(100, 100)
    (64, 256, None)
    """
    return next((c for c in INT4_GROUPS if block % c == 0 and k % c == 0), None)


def int4_reason(module) -> str | None:
    """Why ``module``'s weight does not fit the int4 kernels (codes, scale grid), or ``None``; devices and
    the kernels' own N/K multiples are the callers' to check."""
    codec = int_codec(module)
    if codec is None or codec.bits > 4:
        return f"codes are not integers of at most 4 bits ({module.spec.format})"
    n, k = module.qweight.shape
    rows, groups = grid(module)
    block = module.spec.granularity.block_size((n, k))[-1]
    if rows not in (1, n) or -(-k // block) != groups or int4_group(k, block) is None:
        return (f"scale grid {(rows, groups)} is not per-channel or per-group along in_features with a group "
                f"that a kernel group of 32..256 divides")
    return None


def per_kernel_group(t: torch.Tensor, n: int, k: int, block: int, group: int) -> torch.Tensor:
    """``(rows, ceil(k / block))`` -> ``(n, k / group)``: each block's value on each of its kernel groups."""
    return t.expand(n, -1).repeat_interleave(block // group, dim=1)[:, : k // group]


def nibbles(q: qt.QTensor) -> torch.Tensor:
    """The stored nibbles ``code - qmin`` (0 .. 2^bits - 1), int32 ``(N, K)``, on ``q``'s device."""
    return (qt.unpacked_codes(q).to(torch.int32) - q.spec.fmt.codec.qmin).contiguous()


def scale_and_zeros(q: qt.QTensor, group: int) -> torch.Tensor:
    """The kernels' ``(K / group, N, 2)`` bf16 ``[scale, zero]`` for integer-coded ``q`` (see the module
    docstring), on ``q``'s device."""
    n, k = q.shape
    codec = q.spec.fmt.codec
    s, z = q.qparams.effective()
    block = q.spec.granularity.block_size((n, k))[-1]
    if z is not None and q.spec.zero_point_domain == "offset":
        zero = (codec.qmin + 8) * s + z
    else:
        zero = (codec.qmin + 8 - (0.0 if z is None else z)) * s
    s_g, zero_g = (per_kernel_group(t, n, k, block, group) for t in (s, zero))
    return torch.stack([s_g.t(), zero_g.t()], dim=-1).to(torch.bfloat16).contiguous()


def pack_nibble_pairs(u: torch.Tensor) -> torch.Tensor:
    """``(N, K)`` nibbles (0..15, any integer dtype) -> ``(N, K / 2)`` uint8, element ``2j`` in the high
    nibble and ``2j + 1`` in the low one: the input ``aten._convert_weight_to_int4pack`` (CUDA, torch >=
    2.5) takes (``matrix_to_m16n8k16_Bint4_layout`` in ``aten/src/ATen/native/cuda/int4mm.cu``).

    >>> pack_nibble_pairs(torch.tensor([[1, 2, 15, 0]]))
    tensor([[ 18, 240]], dtype=torch.uint8)
    """
    u = u.to(torch.int32)
    return ((u[:, 0::2] << 4) | u[:, 1::2]).to(torch.uint8).contiguous()


def prefill_state(module, group: int) -> dict:
    """What :func:`.dense.prefill_linear` needs for ``module``'s weight, scales per kernel ``group``."""
    q = module.qweight
    n, k = q.shape
    block = q.spec.granularity.block_size((n, k))[-1]
    d_scale, d_offset = (per_kernel_group(t, n, k, block, group).contiguous() for t in dense.affine_params(q))
    codec = int_codec(module)
    # 4-bit codes: the buffer holds them two per byte; fewer bits are unpacked per dense call
    return {"dense_scale": d_scale, "dense_offset": d_offset, "codes": module.weight if codec.bits == 4 else None,
            "signed": codec.signed}


def packed_linear(op, x: torch.Tensor, packed: torch.Tensor, group: int, scale_zeros: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` through ``op`` (aten's CPU or CUDA int4pack matmul, bf16 compute): ``x`` ``(..., K)`` ->
    ``(..., N)`` in x.dtype (no rows: zeros)."""
    k = x.shape[-1]
    n = scale_zeros.shape[1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return x.new_zeros(*x.shape[:-1], n)
    y = op(x2.to(torch.bfloat16).contiguous(), packed, group, scale_zeros)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)

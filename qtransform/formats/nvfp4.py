"""NVFP4: FP4 E2M1 elements, blocks of 16 with an FP8 E4M3 scale, one float32 tensor scale.

Two-level scaling (NVIDIA, torchao ``NVFP4Tensor``, compressed-tensors ``tensor_group``):

* tensor scale ``g = amax_tensor / (448 * 6)`` (float32; 1 for an all-zero tensor), so the
  largest block scale lands at the top of the FP8 range;
* block scale ``fp8_e4m3(amax_block / 6 / g)``: rounded to nearest even after clamping to
  ``[2^-6, 448]`` (torchao's bounds: a zero block keeps a normal, non-zero scale);
* elements ``fp4(x / (block_scale * g))`` with saturation at ±6.

4 + 8/16 = 4.5 bits per element, plus 32 bits per tensor. The element domain is FP4's,
so the error bound is FP4's (half a step, relative 1/4 in the normal range) times the
effective scale, with saturation where the rounded block scale came out below
``amax_block / 6``.

>>> import torch, qtransform as qt
>>> x = torch.tensor([[6.0, 3.0, 1.0, -0.5] * 4, [0.75, 0.5, 0.25, 0.0] * 4])
>>> qp = qt.choose_qparams(x, qt.QuantSpec(format="nvfp4"))
>>> qp.scale.float().flatten().tolist(), round(qp.global_scale.item() * 448 * 6, 6)
([448.0, 56.0], 6.0)
>>> qt.dequantize(qt.quantize(x, qp))[:, :4].tolist()
[[6.0, 3.0, 1.0, -0.5], [0.75, 0.5, 0.25, 0.0]]
"""

from __future__ import annotations

from ..granularity import PerGroup
from .base import Format, get_format, register_format

__all__ = ["NVFP4_BLOCK"]

NVFP4_BLOCK = 16

register_format(Format(
    name="nvfp4", codec=get_format("fp4_e2m1").codec, family="nvfp4",
    description="NVFP4: fp4 E2M1, fp8 E4M3 scale per 16, fp32 tensor scale",
    default_granularity=PerGroup(NVFP4_BLOCK), block=NVFP4_BLOCK, scale_dtypes=("float8_e4m3fn",),
    symmetric_only=True))

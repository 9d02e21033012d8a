"""CUDA weight-only int4: PyTorch's tinygemm kernel (``aten._weight_int4pack_mm``, bf16 tensor cores,
compute capability >= 8.0) for QLinear with integer codes of at most 4 bits and per-group/per-channel
scales (the kernel groups of :mod:`.int4`; its ``(nibble - 8) * scale + zero`` is the CPU kernel's).

The operands, as ``aten/src/ATen/native/cuda/int4mm.cu`` (torch >= 2.5) reads them:

- ``_convert_weight_to_int4pack(w, innerKTiles)``: ``w`` uint8 ``(N, K / 2)`` (int32 ``(N, K)`` before
  torch 2.5; pyproject asks for >= 2.6), element ``2j`` of a row
  in the high nibble (:func:`.int4.pack_nibble_pairs`); ``innerKTiles`` 2, 4 or 8 with ``K`` a
  multiple of ``innerKTiles * 16`` (we take the largest that divides).
- ``_weight_int4pack_mm(x, packed, group, scale_and_zeros)``: ``x`` bf16 contiguous ``(M, K)`` (any M),
  ``group`` 32/64/128/256 dividing ``K``, ``scale_and_zeros`` bf16 ``(K / group, N, 2)``; the output
  ``(M, N)`` bf16 with ``N = 8 * packed.size(0)``, so ``N`` must be a multiple of 8.

The weight is dequantized in bf16 inside the kernel (scale and zero are bf16, one bf16 FMA per
weight) and the products accumulate in fp32: the output matches ``F.linear(x, dequantize(q))`` to
bf16 rounding of the activations, the scales/zeros, the dequantized weight and the output.

Many tokens: from :data:`.dense.PREFILL_ROWS` ``["int4pack_cuda"]`` rows on (256, the crossover measured on an
H200 by ``bench/gpu_crossover.py``; ``None``: tinygemm at every token count) it dequantizes and runs ``F.linear``."""

from __future__ import annotations

import torch

from . import dense
from .base import LINEAR_KERNELS, Kernel, has_op, linear_common, register_kernel
from .int4 import int4_group, int4_reason, nibbles, pack_nibble_pairs, packed_linear, prefill_state, scale_and_zeros

__all__ = ["MIN_CAPABILITY", "INNER_K_TILES", "inner_k_tiles", "int4pack_cuda_linear"]

#: bf16 tensor-core MMA (m16n8k16): Ampere and newer.
MIN_CAPABILITY = (8, 0)
#: ``innerKTiles`` values the CUDA packing takes, largest (widest loads) first.
INNER_K_TILES = (8, 4, 2)


def inner_k_tiles(k: int) -> int | None:
    """The largest ``innerKTiles`` with ``k`` a multiple of ``innerKTiles * 16`` (``None``: k % 32 != 0).

    >>> inner_k_tiles(4096), inner_k_tiles(576), inner_k_tiles(96), inner_k_tiles(48)
    (8, 4, 2, None)
    """
    return next((t for t in INNER_K_TILES if k % (t * 16) == 0), None)


def _check(module, forced: bool) -> str | None:
    if (r := linear_common(module)) is not None:
        return r
    dev = module.weight.device
    if dev.type != "cuda":
        return "not on CUDA"
    if not (has_op("_weight_int4pack_mm") and has_op("_convert_weight_to_int4pack")):
        return "this torch has no int4pack CUDA kernel"
    if torch.cuda.get_device_capability(dev) < MIN_CAPABILITY:
        return f"needs compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (bf16 tensor cores)"
    if (r := int4_reason(module)) is not None:
        return r
    n, k = module.qweight.shape
    if n % 8:
        return f"out_features {n} is not a multiple of 8"
    if inner_k_tiles(k) is None:
        return f"in_features {k} is not a multiple of 32"
    return None


def _prepare(module):
    q = module.qweight
    n, k = q.shape
    group = int4_group(k, module.spec.granularity.block_size((n, k))[-1])
    packed = torch.ops.aten._convert_weight_to_int4pack(pack_nibble_pairs(nibbles(q)), inner_k_tiles(k))
    st = {"group": group, "packed": packed, "scale_zeros": scale_and_zeros(q, group)}
    if dense.PREFILL_ROWS.get("int4pack_cuda") is not None:
        st.update(prefill_state(module, group))
    return st


def int4pack_cuda_linear(x: torch.Tensor, packed: torch.Tensor, group: int, scale_zeros: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for a CUDA int4pack weight (bf16 compute); ``x``: ``(..., K)`` -> ``(..., N)`` in x.dtype."""
    return packed_linear(torch.ops.aten._weight_int4pack_mm, x, packed, group, scale_zeros)


def _run(module, st, x, **kw):
    if "dense_scale" not in st and dense.PREFILL_ROWS.get("int4pack_cuda") is not None:
        st.update(prefill_state(module, st["group"]))  # the threshold was set after prepare (bench/gpu_crossover.py)
    y = dense.prefill_linear(module, "int4pack_cuda", st, x)
    return int4pack_cuda_linear(x, st["packed"], st["group"], st["scale_zeros"]) if y is None else y


register_kernel(LINEAR_KERNELS, Kernel("int4pack_cuda", _check, _prepare, _run))

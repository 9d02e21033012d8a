"""Bit packing of sub-byte codes along the last axis.

``pack(codes, bits)`` writes each row of codes as a little-endian bit stream into
uint8: code ``j`` occupies bits ``[bits*j, bits*(j+1))`` of the stream, so 4-bit
element ``2k`` is the low nibble of byte ``k`` and 6-bit codes fill three bytes per
four codes. A row of ``n`` codes takes ``ceil(n * bits / 8)`` bytes.

``container=torch.int32`` packs ``32 // bits`` codes per int32 word (bits 1, 2, 4, 8);
``order="awq"`` stores 4-bit codes in the AWQ order [0, 2, 4, 6, 1, 3, 5, 7] (nibble
``i`` of a word holds code ``order[i]``), as AutoAWQ, Quark and compressed-tensors
checkpoints expect.

>>> import torch, qtransform as qt
>>> codes = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
>>> qt.pack(codes, 4)
tensor([[ 33, 243]], dtype=torch.uint8)
>>> qt.unpack(qt.pack(codes, 4), 4, 4).tolist()
[[1, 2, 3, 15]]
"""

from __future__ import annotations

import torch
from einops import rearrange

__all__ = ["pack", "unpack", "AWQ_ORDER"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_ORDERS = ("sequential", "awq")


def _check(codes_or_packed, bits, container, order, name):
    if not isinstance(codes_or_packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(codes_or_packed).__name__}")
    if codes_or_packed.is_floating_point() or codes_or_packed.is_complex() or codes_or_packed.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {codes_or_packed.dtype}")
    if codes_or_packed.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension (packing runs along the last axis)")
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")
    if container not in (torch.uint8, torch.int32):
        raise ValueError(f"container must be torch.uint8 or torch.int32, got {container}")
    if order not in _ORDERS:
        raise ValueError(f"order must be one of {_ORDERS}, got {order!r}")
    if container == torch.int32 and 32 % bits:
        raise ValueError(f"container=torch.int32 packs 1, 2, 4 or 8 bits, got bits={bits}")
    if order == "awq" and not (container == torch.int32 and bits == 4):
        raise ValueError("order='awq' applies to 4-bit codes in torch.int32 words")


def _group(bits: int, container) -> int:
    """Codes per packing unit: a byte (bits | 8), a word, or 8 codes = ``bits`` bytes."""
    if container == torch.int32:
        return 32 // bits
    return 8 // bits if 8 % bits == 0 else 8


def _fields(bits: int, k: int, byte: int):
    """``(code index, shift)`` of each code with bits in byte ``byte`` of a unit of ``k`` codes:
    the byte holds ``code << shift`` (a negative shift moves the code right)."""
    return [(i, bits * i - 8 * byte) for i in range(k) if bits * i < 8 * (byte + 1) and bits * (i + 1) > 8 * byte]


def _or(parts):
    parts = iter(parts)
    out = next(parts)
    for p in parts:
        out = out | p
    return out


def pack(codes: torch.Tensor, bits: int, *, container: torch.dtype = torch.uint8,
         order: str = "sequential") -> torch.Tensor:
    """Pack integer ``codes`` (only their low ``bits`` bits are used) along the last axis."""
    _check(codes, bits, container, order, "codes")
    n = codes.shape[-1]
    k = _group(bits, container)
    pad = -n % k
    if container == torch.uint8:
        c = codes.to(torch.uint8) & ((1 << bits) - 1)
        if pad:
            c = torch.constant_pad_nd(c, (0, pad))
        c = rearrange(c, "... (units k) -> ... units k", k=k)
        if 8 % bits == 0:  # whole codes per byte
            out = c[..., 0]
            for j in range(1, k):
                out = out | (c[..., j] << (bits * j))
            return out
        # 3, 5, 6, 7 bits: 8 codes fill `bits` bytes, built byte by byte
        out = torch.stack([_or(c[..., i] << s if s >= 0 else c[..., i] >> -s for i, s in _fields(bits, k, j))
                           for j in range(bits)], dim=-1)
        return rearrange(out, "... units b -> ... (units b)")[..., : -(-n * bits // 8)]
    c = codes.to(torch.int64) & ((1 << bits) - 1)
    if pad:
        c = torch.constant_pad_nd(c, (0, pad))
    c = rearrange(c, "... (units k) -> ... units k", k=k)
    if order == "awq":
        c = c[..., list(AWQ_ORDER)]
    shifts = torch.arange(k, device=c.device, dtype=torch.int64) * bits
    word = (c << shifts).sum(-1)  # disjoint bit fields: sum == bitwise or
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def unpack(packed: torch.Tensor, bits: int, numel: int, *, container: torch.dtype | None = None,
           order: str = "sequential", signed: bool = False) -> torch.Tensor:
    """Inverse of :func:`pack`: ``numel`` codes per row (the logical last-axis length).

    Returns uint8 codes (int8, sign-extended, with ``signed=True``).
    """
    container = packed.dtype if container is None else container
    _check(packed, bits, container, order, "packed")
    if packed.dtype != container:
        raise TypeError(f"packed has dtype {packed.dtype}, expected {container}")
    k = _group(bits, container)
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    units = -(-numel // k)
    if container == torch.uint8 and 8 % bits == 0 and packed.shape[-1] == units:  # fast path
        mask = (1 << bits) - 1
        c = torch.stack([(packed >> (bits * j)) & mask for j in range(k)], dim=-1)
        c = rearrange(c, "... units k -> ... (units k)")[..., :numel]
        if signed:
            return (c.to(torch.int8) << (8 - bits)) >> (8 - bits)  # sign-extend
        return c
    if container == torch.int32:
        if packed.shape[-1] != units:
            raise ValueError(f"packed last axis has {packed.shape[-1]} words; {numel} codes of {bits} "
                             f"bits need {units}")
        word = packed.to(torch.int64) & 0xFFFFFFFF
    else:
        expect = -(-numel * bits // 8)
        if packed.shape[-1] != expect:
            raise ValueError(f"packed last axis has {packed.shape[-1]} bytes; {numel} codes of {bits} "
                             f"bits need {expect}")
        pad = units * bits - expect  # a unit of 8 codes is `bits` bytes
        b = torch.constant_pad_nd(packed, (0, pad)) if pad else packed
        b = rearrange(b, "... (units b) -> ... units b", b=bits)
        fields = [[(j, s) for j in range(bits) for i2, s in _fields(bits, k, j) if i2 == i] for i in range(k)]
        c = torch.stack([_or(b[..., j] >> s if s >= 0 else b[..., j] << -s for j, s in f) for f in fields], dim=-1)
        c = rearrange(c, "... units k -> ... (units k)")[..., :numel] & ((1 << bits) - 1)
        if signed:
            return (c.to(torch.int8) << (8 - bits)) >> (8 - bits)  # sign-extend
        return c
    shifts = torch.arange(k, device=word.device, dtype=torch.int64) * bits
    c = (word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    if order == "awq":
        c = c[..., [AWQ_ORDER.index(i) for i in range(k)]]
    c = rearrange(c, "... units k -> ... (units k)")[..., :numel]
    if signed:
        c = c - ((c >> (bits - 1)) << bits)
        return c.to(torch.int8)
    return c.to(torch.uint8)

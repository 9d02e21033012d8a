"""Int4 weight-only linear for decode (1 to a few tokens) on AVX2 CPUs, near the memory bandwidth.

At one token a linear layer is a matrix-vector product: its time is the time to read the weight.
``aten._weight_int4pack_mm_for_cpu`` is compute-bound unpacking nibbles on AVX2 (1.5x to 2.5x fp32
``F.linear`` there); this path streams 4-bit codes (with software prefetch) through a small C++
kernel, ``decode_avx2.cpp``, so it reads a quarter of fp32's bytes per token (cold weights, as in a
real decode step; ``bench/bench_decode.py`` measures it, the tables are in ``bench/results/decode.md``
and ``docs/performance.md``). Two variants:

* default: activations rounded to int16 per (token, group) (scale ``max|x_g| / 32767``) and
  multiplied with ``vpmaddwd`` into int32 per group; the result differs from ``F.linear`` by at
  most ``2^-16 max|x_g| * sum_k (code_k - qmin) * scale`` per group, about 5e-5 of the output's
  range on random data (the int4pack kernel's bf16 activations: about 5e-3). Groups of a multiple
  of 32 features (groups over 4096 features, per channel, are split in sub-groups);
* ``exact=True``: fp32 FMA over codes widened to fp32 (fp32 rounding only), slower.
  Groups of a multiple of 16 features.

Which CPU gets what (measured; :data:`DECODE_MAX_ROWS_BY_CAPABILITY`): on AVX2 without AVX-512
this path for up to 32 tokens (it beats the int4pack kernel at every count measured, 1 to 64);
on AVX-512 CPUs, where ``_weight_int4pack_mm_for_cpu`` has its own AVX-512 kernel, only for 1 and
2 tokens (from 4 tokens int4pack is as fast or faster); elsewhere never.

The kernel is compiled at first use with ``torch.utils.cpp_extension`` (a C++ compiler and ninja;
cached in torch's extension directory, so later processes only load it) and registered as
``torch.ops.qtransform_decode.int4_gemv`` / ``int4_gemv_i16`` with fake implementations, so
``torch.compile(fullgraph=True)`` traces through it. Without a compiler, on a CPU without AVX2 +
FMA, or with ``QTRANSFORM_NO_DECODE_KERNEL=1``, :func:`decode_available` is ``False`` and
:func:`int4_decode_linear` computes the same product with plain torch ops (slowly), so callers
never break.

Output: ``F.linear(x, W)`` with ``W = (codes - zero_point) * scale``, in ``x.dtype`` (computed in
fp32; the sums run in another order, per group).

>>> import torch
>>> codes = torch.randint(-8, 8, (32, 64))
>>> scale = torch.rand(32, 2) + 0.5
>>> st = prepare_decode(codes, scale, qmin=-8, native=False)
>>> x = torch.randn(1, 64)
>>> w = (codes.float().view(32, 2, 32) * scale[..., None]).view(32, 64)
>>> torch.allclose(int4_decode_linear(x, st), x @ w.t(), atol=1e-4)
True
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

import qtransform as qt
from qtransform.formats import IntCodec

from . import native

__all__ = ["DECODE_MAX_ROWS", "DECODE_MAX_ROWS_BY_CAPABILITY", "DecodeState", "decode_available", "decode_unavailable_reason", "decode_group",
           "decode_check", "prepare_decode", "prepare_decode_qtensor", "int4_decode_linear"]

#: Rows (tokens) up to which :func:`int4_decode_linear` is the fastest int4 path, per
#: ``torch.backends.cpu.get_cpu_capability()`` (``bench/bench_decode.py``, 1 and 2 threads, see
#: ``bench/results/decode.md``). AVX2: faster than the int4pack kernel at every measured count
#: (1 to 64 tokens) and than fp32 ``F.linear`` up to about 64; 32 leaves room for dequant + GEMM.
#: AVX-512: ``_weight_int4pack_mm_for_cpu`` has an AVX-512 kernel that catches up from 4 tokens.
DECODE_MAX_ROWS_BY_CAPABILITY = {"AVX2": 32, "AVX512": 2}
#: :data:`DECODE_MAX_ROWS_BY_CAPABILITY` for this CPU (0: never; the kernel needs AVX2).
DECODE_MAX_ROWS = DECODE_MAX_ROWS_BY_CAPABILITY.get(torch.backends.cpu.get_cpu_capability(), 0)

R = 4  # rows per tile of the packed layouts (decode_avx2.cpp)
I16_MAX_GROUP = 4096  # int32 sums of int16 x 4-bit products per row and group stay below 2^31
_SOURCE = "decode_avx2.cpp"
_NAME = "qtransform_decode_avx2"


class DecodeState(NamedTuple):
    """A weight packed for :func:`int4_decode_linear` (derived on first use, never saved).

    ``packed``: uint8 ``(tiles, K / block, 4, block / 2)`` (block 32, or 16 when ``exact``);
    ``scale``, ``mzero``: fp32 ``(tiles, groups, 4)`` with ``mzero = -scale * zero``; ``group``:
    input features per scale; ``in_features``, ``out_features``: the weight's ``(K, N)``;
    ``exact``: the fp32 variant;
    ``native``: run the compiled kernel (else the plain-torch fallback)."""

    packed: torch.Tensor
    scale: torch.Tensor
    mzero: torch.Tensor
    group: int
    in_features: int
    out_features: int
    exact: bool
    native: bool


@functools.cache
def _build():
    """Build (or load the cached build of) the kernel once per process and register its ops:
    ``(module, None)`` when it runs here, else ``(None, reason)`` (:func:`native.build_extension`)."""
    mod, reason = native.build_extension(_SOURCE, _NAME, env="QTRANSFORM_NO_DECODE_KERNEL")
    if mod is not None:
        _register_fakes()
    return mod, reason


@functools.cache
def _register_fakes() -> None:
    """The ops' shapes for tracing, once per process (a rebuild after ``_build.cache_clear()`` loads the same
    ops, and torch refuses a second fake impl for an op)."""
    for op in ("int4_gemv", "int4_gemv_i16"):
        torch.library.register_fake(f"qtransform_decode::{op}")(_fake_gemv)


def _fake_gemv(x, packed, scale, mzero, group, n):
    return x.new_empty(x.shape[0], n)


def decode_unavailable_reason() -> str | None:
    """Why the compiled kernel cannot run here (``None`` when it can). Builds it on the first call."""
    return _build()[1]


def decode_available() -> bool:
    """True when the compiled kernel runs here (AVX2 + FMA, a working C++ compiler and ninja).

    The first call in a process builds or loads it: tens of seconds once per machine (the build
    is cached), about a second later on."""
    return _build()[0] is not None


def decode_group(in_features: int, groups: int, *, exact: bool = False) -> int | None:
    """Features per group for ``groups`` scales along ``in_features``, or ``None`` when the layout
    cannot hold it: the group must be a multiple of 32 features (16 when ``exact``)."""
    block = 16 if exact else 32
    if groups < 1 or in_features % groups:
        return None
    g = in_features // groups
    return g if g % block == 0 else None


def _grid(t: torch.Tensor | None, n: int, name: str) -> torch.Tensor | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] not in (1, n):
        raise ValueError(f"prepare_decode: {name} must be 2-D with 1 or {n} rows, got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    return t.to(torch.float32).expand(n, -1)


def prepare_decode(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None, *,
                   qmin: int = 0, exact: bool = False, native: bool | None = None,
                   offset: torch.Tensor | None = None) -> DecodeState:
    """Pack integer ``codes`` ``(N, K)`` in ``[qmin, qmin + 15]`` for :func:`int4_decode_linear`.

    ``scale`` and ``zero_point`` are ``(1 or N, G)`` (per-tensor/per-channel/per-group along K),
    ``W = (codes - zero_point) * scale`` broadcast over groups of ``K / G`` features;
    ``zero_point=None`` means 0 (symmetric); ``offset`` (instead of ``zero_point``, same shape) gives
    ``W = codes * scale + offset`` (``zero_point_domain="offset"``). ``exact`` picks the fp32 variant; ``native`` the
    compiled kernel (default: on the CPU when :func:`decode_available`; ``False``: plain torch).
    Raises ``ValueError`` for what the layout cannot hold (see :func:`decode_group`)."""
    if not isinstance(codes, torch.Tensor) or codes.dim() != 2 or codes.is_floating_point():
        raise ValueError("prepare_decode: codes must be a 2-D integer tensor, got "
                         + (f"{codes.dtype} {tuple(codes.shape)}" if isinstance(codes, torch.Tensor)
                            else type(codes).__name__))
    n, k = codes.shape
    s = _grid(scale, n, "scale")
    z = _grid(zero_point, n, "zero_point")
    o = _grid(offset, n, "offset")
    if z is not None and o is not None:
        raise ValueError("prepare_decode: pass zero_point or offset, not both")
    for name, t in (("zero_point", z), ("offset", o)):
        if t is not None and t.shape[1] != s.shape[1]:
            raise ValueError(f"prepare_decode: {name} has {t.shape[1]} groups, scale {s.shape[1]}")
    group = decode_group(k, s.shape[1], exact=exact)
    if group is None:
        raise ValueError(f"prepare_decode: in_features {k} in {s.shape[1]} groups: the group must be a multiple "
                         f"of {16 if exact else 32} features")
    if not exact and group > I16_MAX_GROUP:  # split long groups (per channel) into sub-groups, scales repeated
        sub = next(d for d in range(I16_MAX_GROUP, 31, -32) if group % d == 0)
        s, z, o = (None if t is None else t.repeat_interleave(group // sub, dim=1) for t in (s, z, o))
        group = sub
    nib = codes.to(torch.int16) - qmin
    if nib.numel() and (int(nib.min()) < 0 or int(nib.max()) > 15):
        raise ValueError(f"prepare_decode: codes must lie in [{qmin}, {qmin + 15}] (qmin={qmin})")
    on_cpu = codes.device.type == "cpu"
    if native is None:
        native = on_cpu and decode_available()
    elif native and not (on_cpu and decode_available()):
        raise ValueError("prepare_decode: native=True but the kernel cannot run: "
                         + (decode_unavailable_reason() or f"codes on {codes.device}, not the CPU"))
    block = 16 if exact else 32
    tiles = -(-n // R)
    pad = tiles * R - n
    nib = torch.nn.functional.pad(nib.to(torch.uint8), (0, 0, 0, pad)).view(tiles, R, k // block, 2, block // 2)
    packed = (nib[:, :, :, 0] | (nib[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()
    if o is not None:  # W = code * scale + offset = nib * scale + (offset + qmin * scale)
        mz = o + s * qmin
    else:
        mz = -s * ((0.0 if z is None else z) - qmin)  # W = nib * scale + mzero

    def tiled(t):  # (N, G) -> (tiles, G, R); padded rows are zero
        return torch.nn.functional.pad(t, (0, 0, 0, pad)).view(tiles, R, -1).transpose(1, 2).contiguous()

    return DecodeState(packed, tiled(s), tiled(mz), group, k, n, bool(exact), bool(native))


def decode_check(q: qt.QTensor, *, exact: bool = False) -> str | None:
    """Why the 2-D weight ``q`` (out_features x in_features) cannot take this path, or ``None``.

    Shapes and format only (works on meta tensors): integer codes of at most 4 bits, scales per
    tensor, per channel (axis 0) or per group along in_features (see :func:`decode_group`), no
    padded last group. Does not build the kernel (see :func:`decode_available`)."""
    codec = q.spec.fmt.codec
    if not isinstance(codec, IntCodec) or codec.bits > 4:
        return f"codes are not integers of at most 4 bits ({q.spec.format})"
    if len(q.shape) != 2:
        return f"weight of shape {tuple(q.shape)} is not 2-D"
    n, k = q.shape
    rows, groups = q.qparams.effective()[0].shape
    if rows not in (1, n) or decode_group(k, groups, exact=exact) is None:
        return (f"scale grid {(rows, groups)} over in_features {k}: not per-tensor/per-channel/per-group with "
                f"groups of a multiple of {16 if exact else 32} features")
    if q.spec.granularity.block_size((n, k))[-1] * groups != k:
        return f"the last group of in_features {k} is padded"
    return None


def prepare_decode_qtensor(q: qt.QTensor, *, exact: bool = False, native: bool | None = None) -> DecodeState:
    """:func:`prepare_decode` for a quantized weight ``q`` (``ValueError`` with
    :func:`decode_check`'s reason when it cannot take this path)."""
    reason = decode_check(q, exact=exact)
    if reason is not None:
        raise ValueError(f"prepare_decode_qtensor: {reason}")
    s, z = q.qparams.effective()
    if q.spec.zero_point_domain == "offset":
        return prepare_decode(qt.unpacked_codes(q), s, offset=z, qmin=q.spec.fmt.codec.qmin, exact=exact, native=native)
    return prepare_decode(qt.unpacked_codes(q), s, z, qmin=q.spec.fmt.codec.qmin, exact=exact, native=native)


def _torch_gemv(x: torch.Tensor, st: DecodeState) -> torch.Tensor:
    """The product in plain torch ops from the packed state (fallback; traceable): fp32 ``(M, N)``."""
    tiles, groups = st.scale.shape[:2]
    nib = torch.stack([st.packed & 15, st.packed >> 4], dim=3)  # (tiles, K/block, R, 2, block/2)
    nib = nib.permute(0, 2, 1, 3, 4).reshape(tiles * R, groups, -1)
    s = st.scale.transpose(1, 2).reshape(tiles * R, groups, 1)
    mz = st.mzero.transpose(1, 2).reshape(tiles * R, groups, 1)
    w = (nib.to(torch.float32) * s + mz).reshape(tiles * R, -1)
    return x @ w[: st.out_features].t()


def int4_decode_linear(x2d: torch.Tensor, state: DecodeState) -> torch.Tensor:
    """``x2d @ W.T`` for a :func:`prepare_decode` weight: ``(M, K) -> (M, N)`` in ``x2d.dtype``
    (``(..., K) -> (..., N)`` also works). Fastest for ``M <= DECODE_MAX_ROWS``; correct for any ``M``."""
    k = state.in_features
    if not isinstance(x2d, torch.Tensor) or x2d.dim() < 1 or x2d.shape[-1] != k:
        raise ValueError(f"int4_decode_linear: x2d must be (rows, {k}), got "
                         f"{tuple(x2d.shape) if isinstance(x2d, torch.Tensor) else type(x2d).__name__}")
    if x2d.dim() != 2:
        return int4_decode_linear(x2d.reshape(-1, k), state).reshape(*x2d.shape[:-1], state.out_features)
    xf = x2d if x2d.dtype == torch.float32 and x2d.is_contiguous() else x2d.to(torch.float32).contiguous()
    if state.native:
        if torch.compiler.is_compiling():  # the registered op (with its fake) for the graph
            lib = torch.ops.qtransform_decode
        else:  # eager: the direct binding, a few microseconds less than the dispatcher
            lib = _build()[0]
        op = lib.int4_gemv if state.exact else lib.int4_gemv_i16
        y = op(xf, state.packed, state.scale, state.mzero, state.group, state.out_features)
    else:
        y = _torch_gemv(xf, state)
    return y if y.dtype == x2d.dtype else y.to(x2d.dtype)

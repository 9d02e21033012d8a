"""Pytree types: ``QParams``, ``QTensor`` and the observer statistics.

All are frozen dataclasses registered as pytree nodes: tensor fields are leaves,
``spec`` and other static fields travel in the tree's context, and fields that are
``None`` are absent from the leaves. So ``torch.func.vmap``, ``grad`` and
``tree_map`` see tensors only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from . import _tree
from .spec import QuantSpec

__all__ = ["QParams", "QTensor", "MinMaxStats", "HistogramStats", "pytree_dataclass"]


def pytree_dataclass(*, static: tuple[str, ...]):
    """Make a frozen keyword-only dataclass whose ``static`` fields are pytree context."""

    def wrap(cls):
        cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
        names = tuple(f.name for f in dataclasses.fields(cls))
        data = tuple(n for n in names if n not in static)

        def flatten(obj):
            present = tuple(n for n in data if getattr(obj, n) is not None)
            ctx = (tuple(getattr(obj, n) for n in static), present)
            return [getattr(obj, n) for n in present], ctx

        def unflatten(children, ctx):
            static_vals, present = ctx
            kwargs = dict(zip(static, static_vals))
            kwargs.update({n: None for n in data})
            kwargs.update(zip(present, children))
            obj = object.__new__(cls)
            for k, v in kwargs.items():
                object.__setattr__(obj, k, v)
            return obj

        _tree.register_node(cls, flatten, unflatten)
        return cls

    return wrap


@pytree_dataclass(static=("spec",))
class QParams:
    """Quantization parameters of one tensor.

    Invariant: ``x ≈ (decode(codes) - zero_point) * scale`` broadcast over the spec's
    granularity. ``scale`` has the *grid* shape ``ceil(shape / block_size)`` and is stored
    in ``spec.scale_dtype`` (uint8 biased exponents for ``"e8m0"``, ``float8_e4m3fn`` block
    scales for two-level specs, which also carry a float32 ``global_scale`` of shape ()).
    ``micro_exponent`` holds the bit-packed 1-bit shifts of MX4/MX6/MX9 sub-blocks.
    """

    scale: torch.Tensor
    zero_point: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    micro_exponent: torch.Tensor | None = None
    spec: QuantSpec

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors this holds, by field name (absent fields omitted)."""
        return {n: getattr(self, n) for n in ("scale", "zero_point", "global_scale", "micro_exponent")
                if getattr(self, n) is not None}

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}={tuple(v.shape)}:{str(v.dtype).replace('torch.', '')}"
                          for k, v in self.tensors().items())
        return f"QParams({self.spec}; {parts})"


@pytree_dataclass(static=("width", "dtype"))
class QTensor:
    """A quantized tensor: compact ``codes`` plus its ``qparams``.

    ``codes`` hold the storage form: sub-byte codes bit-packed along the last axis
    (so ``codes.shape[:-1]`` are the logical leading dims), 8-bit codes as int8/uint8,
    fp8 codes in the torch float8 dtypes. ``width`` is the logical size of the last axis
    and ``dtype`` the dtype :func:`dequantize` returns.
    """

    codes: torch.Tensor
    qparams: QParams
    width: int
    dtype: torch.dtype

    @property
    def spec(self) -> QuantSpec:
        return self.qparams.spec

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.codes.shape[:-1], self.width))

    def numel(self) -> int:
        return self.shape.numel()

    def nbytes(self) -> int:
        """Bytes actually held by codes and quantization parameters."""
        return sum(t.numel() * t.element_size() for t in _tree.tree_leaves(self))

    def bits_per_element(self) -> float:
        """Storage bits per logical element, scales and zero points included."""
        return 8.0 * self.nbytes() / self.numel()

    def __repr__(self) -> str:
        return (f"QTensor({self.spec}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"{self.bits_per_element():.3f} bits/element)")


@pytree_dataclass(static=("spec",))
class MinMaxStats:
    """Running per-block minimum and maximum (grid-shaped); ``None`` before the first batch."""

    min: torch.Tensor | None = None
    max: torch.Tensor | None = None
    spec: QuantSpec


@pytree_dataclass(static=("spec",))
class HistogramStats:
    """Per-block histograms for the percentile and MSE observers.

    Each block has ``counts`` and value ``sums`` over ``bins`` equal bins spanning
    ``[-2^exponent, 2^exponent)``; the range doubles (adjacent bins merge) when data grows,
    so merging is exact for counts and associative. ``min``/``max`` are exact.
    Shapes: ``counts``, ``sums``: ``grid + (bins,)``; ``exponent``, ``min``, ``max``: ``grid``.
    """

    min: torch.Tensor | None = None
    max: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    sums: torch.Tensor | None = None
    exponent: torch.Tensor | None = None
    spec: QuantSpec


Stats = Any  # MinMaxStats | HistogramStats

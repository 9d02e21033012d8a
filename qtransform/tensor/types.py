"""Pytree types: ``QParams`` and ``QTensor``.

Both are frozen dataclasses registered as pytree nodes: tensor fields are leaves,
``spec`` and other static fields travel in the tree's context, and fields that are
``None`` are absent from the leaves. So ``torch.func.vmap``, ``grad`` and
``tree_map`` see tensors only.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import _pytree
from .._pytree import pytree_dataclass
from ..spec import QuantSpec
from .checks import check_qtensor

__all__ = ["QParams", "QTensor"]


@pytree_dataclass(static=("spec",))
class QParams:
    """Quantization parameters of one tensor.

    Invariant: ``x ≈ (decode(codes) - zero_point) * scale`` broadcast over the spec's
    granularity (``decode(codes) * scale + zero_point`` for ``zero_point_domain="offset"``, whose
    zero point is stored in the scale dtype). ``scale`` has the *grid* shape ``ceil(shape / block_size)`` and is stored
    in ``spec.scale_dtype`` (uint8 biased exponents for ``"e8m0"``, ``float8_e4m3fn`` block
    scales for two-level specs, which also carry a float32 ``global_scale`` of shape ()).
    ``micro_exponent`` holds the bit-packed 1-bit shifts of MX4/MX6/MX9 sub-blocks.

    ``QParams.FIELDS`` names the tensor fields in storage order, derived from the dataclass (the
    rest of qtransform and the bridge read it instead of naming them again).
    """

    scale: torch.Tensor
    zero_point: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    micro_exponent: torch.Tensor | None = None
    spec: QuantSpec

    @classmethod
    def from_range(cls, lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec, *,
                   path: str | None = None) -> "QParams":
        """Parameters for per-block ranges ``[lo, hi]`` (grid-shaped), by the format's scheme."""
        parts = spec.fmt.scheme.from_range(lo.to(torch.float32), hi.to(torch.float32), spec, path=path)
        return cls(spec=spec, **parts)

    def __post_init__(self):
        if not isinstance(self.spec, QuantSpec):
            raise TypeError(f"QParams: spec must be a QuantSpec, got {type(self.spec).__name__}")
        if not isinstance(self.scale, torch.Tensor):
            raise TypeError(f"QParams: scale must be a torch.Tensor, got {type(self.scale).__name__}")
        for name in ("zero_point", "global_scale", "micro_exponent"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(f"QParams: {name} must be a torch.Tensor or None, got {type(value).__name__}")

    def effective(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Float32 ``(scale, zero_point)`` per block of the grid (zero point ``None`` when absent):
        what quantize and dequantize broadcast (E8M0 exponents, two-level and micro-exponent
        scales decoded). The zero point is in the spec's domain: values are
        ``(code - zero_point) * scale``, except for ``zero_point_domain="offset"``, where they are
        ``code * scale + zero_point`` (the zero point is the value of code 0)."""
        return self.spec.fmt.scheme.effective(self)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors this holds, by field name (absent fields omitted)."""
        return {n: getattr(self, n) for n in self.FIELDS if getattr(self, n) is not None}

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}={tuple(v.shape)}:{str(v.dtype).replace('torch.', '')}"
                          for k, v in self.tensors().items())
        return f"QParams({self.spec}; {parts})"


QParams.FIELDS = tuple(f.name for f in dataclasses.fields(QParams) if f.name != "spec")


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

    def __post_init__(self):
        """Check that codes, width, dtype and the parameters' grid fit together (no data read).

        Raises ``TypeError``/``ValueError`` naming the field; pytree transforms (``vmap``,
        ``tree_map``) rebuild a QTensor without this check."""
        if not isinstance(self.qparams, QParams):
            raise TypeError(f"QTensor: qparams must be a QParams, got {type(self.qparams).__name__}")
        check_qtensor(self.codes, self.qparams, self.width, self.dtype)

    @property
    def spec(self) -> QuantSpec:
        return self.qparams.spec

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.codes.shape[:-1], self.width))

    @property
    def device(self) -> torch.device:
        """The device of ``codes`` (read-only; move a QTensor with ``tree_map``). Tools that follow the
        GPTQ/AWQ convention read ``module.qweight.device`` and ``.dtype`` (peft does).

        >>> import torch, qtransform as qt
        >>> w = torch.randn(4, 32)
        >>> q = qt.quantize(w, qt.choose_qparams(w, qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))))
        >>> q.device, q.dtype
        (device(type='cpu'), torch.float32)
        """
        return self.codes.device

    def numel(self) -> int:
        return self.shape.numel()

    def nbytes(self) -> int:
        """Bytes actually held by codes and quantization parameters."""
        return sum(t.numel() * t.element_size() for t in _pytree.tree_leaves(self))

    def bits_per_element(self) -> float:
        """Storage bits per logical element, scales and zero points included."""
        return 8.0 * self.nbytes() / self.numel()

    def __repr__(self) -> str:
        return (f"QTensor({self.spec}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"{self.bits_per_element():.3f} bits/element)")

"""Tensor layouts: how a :class:`~qtransform.QTensor` is stored as named plain tensors.

A :class:`Layout` turns the quantized tensor at tree path ``P`` into the tensors a file holds
and back; checkpoints record the layout's name, so exporters to other ecosystems add a
layout (their names, packing and transposes) instead of copying the store. The native layout
names the parts after the fields of :class:`~qtransform.QParams`, generically for every
registered format (quantized modules use the same names for their buffers, so a module's
state dict *is* its checkpoint):

=====================  ==========================================
name                   holds
=====================  ==========================================
``P``                  the compact codes (bit-packed, int8/uint8, float8...)
``P_scale``            ``qparams.scale``
``P_zero_point``       ``qparams.zero_point`` (when present)
``P_global_scale``     ``qparams.global_scale`` (two-level fp8 scales)
``P_micro_exponent``   ``qparams.micro_exponent`` (MX4/MX6/MX9)
=====================  ==========================================

The static part (spec, logical shape, dtype) travels as JSON. :func:`abstract_qtensor` gives
the shapes and dtypes those tensors must have, computed on the ``meta`` device (no memory, no
data), so loaders build skeletons and reject wrong files before reading any data.

>>> import torch, qtransform as qt
>>> spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32), symmetric=False)
>>> a = abstract_qtensor((8, 64), torch.float32, spec)
>>> {k: (tuple(v.shape), v.dtype) for k, v in NATIVE.parts("fc.weight", a).items()}
{'fc.weight': ((8, 32), torch.uint8), 'fc.weight_scale': ((8, 2), torch.float32), 'fc.weight_zero_point': ((8, 2), torch.int8)}
"""

from __future__ import annotations

import abc
import functools
from typing import Mapping

import torch
from torch.func import vmap

import qtransform as qt

__all__ = ["Layout", "NativeLayout", "NATIVE", "LAYOUTS", "register_layout", "abstract_qtensor", "check_like",
           "dtype_name", "dtype_from_name"]


class Layout(abc.ABC):
    """How one quantized tensor is stored: ``parts`` and its inverse ``assemble``."""

    name: str

    @abc.abstractmethod
    def parts(self, path: str, q: qt.QTensor) -> dict[str, torch.Tensor]:
        """``{stored name: tensor}`` for the quantized tensor ``q`` at tree path ``path``."""

    @abc.abstractmethod
    def assemble(self, path: str, tensors: Mapping[str, torch.Tensor], *, spec: qt.QuantSpec, width: int,
                 dtype: torch.dtype) -> qt.QTensor:
        """The QTensor at ``path`` from a mapping holding its stored tensors (``KeyError`` if one is missing)."""

    def expected(self, path: str, spec: qt.QuantSpec, shape, dtype: torch.dtype) -> dict[str, tuple]:
        """``{stored name: (shape, dtype)}`` a ``shape``/``dtype`` tensor quantized with ``spec`` is stored as."""
        return {n: (tuple(t.shape), t.dtype) for n, t in self.parts(path, abstract_qtensor(shape, dtype, spec)).items()}


class NativeLayout(Layout):
    """``P`` for the codes and ``P_<field>`` for each QParams field it holds (see the module docstring)."""

    name = "native"

    def parts(self, path, q):
        out = {path: q.codes}
        out.update({f"{path}_{k}": v for k, v in q.qparams.tensors().items()})
        return out

    def assemble(self, path, tensors, *, spec, width, dtype):
        fields = {k: tensors[f"{path}_{k}"] for k in qt.QParams.FIELDS if f"{path}_{k}" in tensors}
        if "scale" not in fields:
            raise KeyError(f"{path}_scale")
        return qt.QTensor(codes=tensors[path], qparams=qt.QParams(spec=spec, **fields), width=width, dtype=dtype)


NATIVE = NativeLayout()


def _check_layout(name: str, layout) -> None:
    if not isinstance(layout, Layout):
        raise TypeError(f"register_layout: expected a Layout, got {type(layout).__name__}")


#: The registry: layout name -> :class:`Layout` (the native one; exporters add theirs).
LAYOUTS = qt.Registry("checkpoint layout", check=_check_layout)
LAYOUTS.register(NATIVE.name, NATIVE)


def register_layout(layout: Layout, *, replace: bool = False) -> Layout:
    """Add a :class:`Layout` under ``layout.name``."""
    return LAYOUTS.register(getattr(layout, "name", None), layout, replace=replace)


def _quantize_fn(spec):
    def f(x):
        return qt.quantize(x, qt.choose_qparams(x, spec))
    return f


@functools.lru_cache(maxsize=512)
def _abstract(shape: tuple[int, ...], dtype: torch.dtype, spec: qt.QuantSpec) -> qt.QTensor:
    try:  # under vmap the core skips data-dependent checks, so meta tensors flow through
        out = vmap(_quantize_fn(spec))(torch.empty((1, *shape), dtype=dtype, device="meta"))
        strip = lambda t: t[0]  # noqa: E731
    except (RuntimeError, NotImplementedError, TypeError):  # a format without meta/vmap support
        out = _quantize_fn(spec)(torch.zeros(shape, dtype=dtype, device="cpu"))  # not a default device (meta)
        strip = lambda t: t  # noqa: E731
    meta = lambda t: None if t is None else torch.empty(strip(t).shape, dtype=t.dtype, device="meta")  # noqa: E731
    qp = out.qparams
    return qt.QTensor(codes=meta(out.codes), width=shape[-1], dtype=dtype,
                      qparams=qt.QParams(spec=spec, **{k: meta(getattr(qp, k)) for k in qt.QParams.FIELDS}))


def abstract_qtensor(shape, dtype: torch.dtype, spec: qt.QuantSpec) -> qt.QTensor:
    """The QTensor that quantizing a ``shape``/``dtype`` tensor with ``spec`` gives, on ``meta``.

    Shapes and dtypes of codes and qparams only (no data). Raises ``ValueError`` when the
    spec does not fit the shape (e.g. a group size that does not divide the axis).
    """
    return _abstract(tuple(int(n) for n in shape), dtype, spec)


def check_like(path: str, q: qt.QTensor, expected: qt.QTensor, *, where: str = "") -> None:
    """Raise ``ValueError`` unless ``q`` has exactly the tensors, shapes and dtypes of ``expected``."""
    got, want = NATIVE.parts(path, q), NATIVE.parts(path, expected)
    prefix = f"{where}: " if where else ""
    if set(got) != set(want):
        raise ValueError(f"{prefix}{path}: quantized tensor has parts {sorted(got)}, {q.spec} "
                         f"expects {sorted(want)}")
    for name, t in got.items():
        w = want[name]
        if tuple(t.shape) != tuple(w.shape) or t.dtype != w.dtype:
            raise ValueError(f"{prefix}tensor {name!r} has shape {tuple(t.shape)} and dtype "
                             f"{dtype_name(t.dtype)}; {q.spec} of a {tuple(expected.shape)} tensor expects "
                             f"shape {tuple(w.shape)} and dtype {dtype_name(w.dtype)}")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; ``ValueError`` for anything else."""
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dt

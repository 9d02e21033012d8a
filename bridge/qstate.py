"""A :class:`~qtransform.QTensor` as named tensors, and its abstract layout.

Every quantized tensor at tree path ``P`` is stored as plain tensors named after the
fields of its :class:`~qtransform.QParams`, generically for every registered format:

=====================  ==========================================
name                   holds
=====================  ==========================================
``P``                  the compact codes (bit-packed, int8/uint8, float8...)
``P_scale``            ``qparams.scale``
``P_zero_point``       ``qparams.zero_point`` (when present)
``P_global_scale``     ``qparams.global_scale`` (two-level fp8 scales)
``P_micro_exponent``   ``qparams.micro_exponent`` (MX4/MX6/MX9)
=====================  ==========================================

The static part (spec, logical shape, dtype) travels as JSON. :func:`abstract_qtensor`
gives the shapes and dtypes those tensors must have, computed on the ``meta`` device
(no memory, no data), so loaders can build skeletons and reject wrong files.

>>> import torch, qtransform as qt
>>> spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32), symmetric=False)
>>> a = abstract_qtensor((8, 64), torch.float32, spec)
>>> {k: (tuple(v.shape), v.dtype) for k, v in named_tensors("fc.weight", a).items()}
{'fc.weight': ((8, 32), torch.uint8), 'fc.weight_scale': ((8, 2), torch.float32), 'fc.weight_zero_point': ((8, 2), torch.int8)}
"""

from __future__ import annotations

import functools

import torch
from torch.func import vmap

import qtransform as qt
from qtransform.qtypes import QParams, QTensor

__all__ = ["QPARAM_FIELDS", "named_tensors", "from_named", "abstract_qtensor", "check_like",
           "dtype_name", "dtype_from_name"]

#: QParams tensor fields, in storage order; each is stored as ``<path>_<field>``.
QPARAM_FIELDS = ("scale", "zero_point", "global_scale", "micro_exponent")


def named_tensors(path: str, q: QTensor) -> dict[str, torch.Tensor]:
    """``{path: codes, path_<field>: tensor, ...}`` for the fields ``q.qparams`` holds."""
    out = {path: q.codes}
    out.update({f"{path}_{k}": v for k, v in q.qparams.tensors().items()})
    return out


def from_named(path: str, tensors, *, spec: qt.QuantSpec, width: int, dtype: torch.dtype) -> QTensor:
    """Inverse of :func:`named_tensors`: a QTensor from a mapping holding its tensors."""
    fields = {k: tensors[f"{path}_{k}"] for k in QPARAM_FIELDS if f"{path}_{k}" in tensors}
    if "scale" not in fields:
        raise KeyError(f"{path}_scale")
    return QTensor(codes=tensors[path], qparams=QParams(spec=spec, **fields), width=width, dtype=dtype)


def _quantize_fn(spec):
    def f(x):
        return qt.quantize(x, qt.choose_qparams(x, spec))
    return f


@functools.lru_cache(maxsize=512)
def _abstract(shape: tuple[int, ...], dtype: torch.dtype, spec: qt.QuantSpec) -> QTensor:
    try:  # under vmap the core skips data-dependent checks, so meta tensors flow through
        out = vmap(_quantize_fn(spec))(torch.empty((1, *shape), dtype=dtype, device="meta"))
        strip = lambda t: t[0]  # noqa: E731
    except (RuntimeError, NotImplementedError, TypeError):  # a format without meta/vmap support
        out = _quantize_fn(spec)(torch.zeros(shape, dtype=dtype))
        strip = lambda t: t  # noqa: E731
    meta = lambda t: None if t is None else torch.empty(strip(t).shape, dtype=t.dtype, device="meta")  # noqa: E731
    qp = out.qparams
    return QTensor(codes=meta(out.codes), width=shape[-1], dtype=dtype,
                   qparams=QParams(spec=spec, **{k: meta(getattr(qp, k)) for k in QPARAM_FIELDS}))


def abstract_qtensor(shape, dtype: torch.dtype, spec: qt.QuantSpec) -> QTensor:
    """The QTensor that quantizing a ``shape``/``dtype`` tensor with ``spec`` gives, on ``meta``.

    Shapes and dtypes of codes and qparams only (no data). Raises ``ValueError`` when the
    spec does not fit the shape (e.g. a group size that does not divide the axis).
    """
    return _abstract(tuple(int(n) for n in shape), dtype, spec)


def check_like(path: str, q: QTensor, expected: QTensor, *, where: str = "") -> None:
    """Raise ``ValueError`` unless ``q`` has exactly the tensors, shapes and dtypes of ``expected``."""
    got, want = named_tensors(path, q), named_tensors(path, expected)
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

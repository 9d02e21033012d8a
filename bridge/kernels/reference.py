"""The reference paths: dequantize one layer's weight, then the float op; embeddings dequantize only
the rows they look up (``gather``). Registered last: they run wherever nothing faster applies."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import qtransform as qt

from .base import CONV_KERNELS, EMBEDDING_KERNELS, LINEAR_KERNELS, Kernel, always, register_kernel

__all__ = []


def _dequant_linear(module, st, x, **kw):
    w = qt.dequantize(module.qweight, dtype=x.dtype)
    return F.linear(x, w.t() if module.transposed else w)


def _gather_check(module, forced: bool) -> str | None:
    q = module.qweight
    n = q.shape[0]
    block0 = q.spec.granularity.block_size(tuple(q.shape))[0]
    for name, t in q.qparams.tensors().items():
        if t.dim() == 0 or t.shape[0] == 1:
            continue
        if block0 != 1 or t.shape[0] != n:
            return f"qparams {name} of shape {tuple(t.shape)} cannot be gathered by row"
    return None


def _dequant_embedding(module, st, x, **kw):
    return module._lookup(x, qt.dequantize(module.qweight, dtype=module.compute_dtype), None, **kw)


def _gather_embedding(module, st, x, **kw):
    q = module.qweight
    if kw:  # bags: each distinct row once (torch.unique), the bag reduced over that sub-table
        rows, inverse = torch.unique(x.reshape(-1), return_inverse=True)
        inverse = inverse.reshape(x.shape)
    else:  # plain lookups: every index its row, no data-dependent shapes (torch.compile traces it)
        rows = x.reshape(-1)
        inverse = torch.arange(rows.numel(), device=x.device).reshape(x.shape)
    parts = {}
    for name, t in q.qparams.tensors().items():
        parts[name] = t if (t.dim() == 0 or t.shape[0] == 1) else t.index_select(0, rows)
    sub = qt.QTensor(codes=q.codes.index_select(0, rows), width=q.width, dtype=q.dtype,
                     qparams=qt.QParams(spec=q.spec, **parts))
    return module._lookup(inverse, qt.dequantize(sub, dtype=module.compute_dtype), rows, **kw)


def _dequant_conv(module, st, x, **kw):
    return module._conv(x, qt.dequantize(module.qweight, dtype=x.dtype), **kw)


register_kernel(LINEAR_KERNELS, Kernel("dequant", always, None, _dequant_linear))
register_kernel(EMBEDDING_KERNELS, Kernel("gather", _gather_check, None, _gather_embedding))
register_kernel(EMBEDDING_KERNELS, Kernel("dequant", always, None, _dequant_embedding))
register_kernel(CONV_KERNELS, Kernel("dequant", always, None, _dequant_conv))

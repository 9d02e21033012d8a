"""``QEmbedding`` and ``QEmbeddingBag``: quantized lookups that dequantize only the rows they read."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qtransform import QTensor

from .. import kernels
from . import actquant
from .base import QModule, register_quantized_class

__all__ = ["QEmbedding", "QEmbeddingBag"]


class _QEmbed(QModule):
    KERNELS = kernels.EMBEDDING_KERNELS
    _HYPER = ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
              "sparse")

    def __init__(self, qweight: QTensor, **kw):
        self._set_hyper(qweight, kw)
        super().__init__(qweight, **kw)

    @classmethod
    def from_float(cls, module: nn.Module, qweight: QTensor, **kw):
        cls._check_from(module, qweight)
        return cls(qweight, **{k: getattr(module, k) for k in cls._HYPER}, **kw)

    def _pad(self, rows):
        if self.padding_idx is None or rows is None:
            return self.padding_idx
        hit = (rows == self.padding_idx).nonzero()
        return int(hit[0, 0]) if hit.numel() else None

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self._describe()}"


class QEmbedding(_QEmbed):
    """Quantized ``nn.Embedding``: by default dequantizes only the rows looked up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return actquant.apply(self, "output", self._run(x))

    def _lookup(self, idx, w, rows):
        # padding_idx only shapes gradients, and the quantized weight has none: no lookup needed
        return F.embedding(idx, w, None, self.max_norm, self.norm_type)


class QEmbeddingBag(_QEmbed):
    """Quantized ``nn.EmbeddingBag``: ``forward(input, offsets=None, per_sample_weights=None)``."""

    _HYPER = _QEmbed._HYPER + ("mode", "include_last_offset")

    def forward(self, x: torch.Tensor, offsets=None, per_sample_weights=None) -> torch.Tensor:
        y = self._run(x, offsets=offsets, per_sample_weights=per_sample_weights)
        return actquant.apply(self, "output", y)

    def _lookup(self, idx, w, rows, offsets=None, per_sample_weights=None):
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.to(w.dtype)
        return F.embedding_bag(idx, w, offsets, self.max_norm, self.norm_type, False, self.mode, False,
                               per_sample_weights, self.include_last_offset, self._pad(rows))


register_quantized_class("Embedding", lambda m: type(m) is nn.Embedding, QEmbedding)
register_quantized_class("EmbeddingBag", lambda m: type(m) is nn.EmbeddingBag, QEmbeddingBag)

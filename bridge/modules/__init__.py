"""Quantized modules: ``QLinear`` (and GPT-2's ``Conv1D``), ``QConv1d``/``2d``/``3d``,
``QConvTranspose1d``/``2d``/``3d``, ``QEmbedding``, ``QEmbeddingBag``, ``QExperts`` (mixture-of-experts layers),
``QMultiheadAttention``; their activation quantizers and the key/value cache's; which float module each replaces."""

from .base import QUANTIZED_CLASSES, QModule, quantized_class, register_quantized_class
from .linear import QLinear, is_conv1d
from .conv import CONV_CLASSES, QConv1d, QConv2d, QConv3d, QConvTranspose1d, QConvTranspose2d, QConvTranspose3d
from .embedding import QEmbedding, QEmbeddingBag
from .experts import QExperts, is_experts
from .mha import QMultiheadAttention
from . import actquant, kvcache, online, lowrank, mha_model

__all__ = ["QModule", "QLinear", "QConv1d", "QConv2d", "QConv3d", "QConvTranspose1d", "QConvTranspose2d",
           "QConvTranspose3d", "CONV_CLASSES", "QEmbedding", "QEmbeddingBag", "QUANTIZED_CLASSES",
           "quantized_class", "register_quantized_class", "is_conv1d", "QExperts", "is_experts",
           "QMultiheadAttention", "actquant", "kvcache", "online", "lowrank", "mha_model"]

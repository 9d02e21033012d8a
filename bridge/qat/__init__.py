"""Quantization-aware training in the user's own training loop: :func:`prepare` puts trainable fake quantizers
on a float model (a recipe resolved as :func:`bridge.quantize` resolves it), the user trains it with any loop
(plain torch, transformers' ``Trainer``, peft adapters, ``torch.compile``), :func:`convert` returns the quantized
model whose codes and scales are exactly those the fake quantizers trained; :func:`distill_loss` distills a
float teacher into it. ``docs/qat.md``.

- ``quantizers``: the weight parametrization and the activation quantizers, and how they attach.
- ``prepare``: :func:`prepare` (and :func:`quantizer_parameters`, the learned ranges for their own optimiser group).
- ``convert``: :func:`convert` (and :func:`learned_qparams`, what the quantizers quantize with now).
- ``distill``: :func:`distill_loss`, on logits or transformers' model outputs.
"""

from .convert import convert, learned_qparams
from .distill import distill_loss
from .prepare import prepare, prepared_plan, quantizer_parameters
from .quantizers import ActFakeQuant, WeightFakeQuant

__all__ = ["prepare", "convert", "distill_loss", "quantizer_parameters", "learned_qparams", "prepared_plan",
           "WeightFakeQuant", "ActFakeQuant"]

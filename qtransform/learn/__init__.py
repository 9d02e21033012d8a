"""Learning quantized models, as pure functions: learnable quantization parameters beside the weights
(:mod:`.ranges`) and losses (:mod:`.losses`: distillation from a float teacher, hidden-state errors).

The ``qat`` step (:mod:`qtransform.algorithms.qat`) trains each block with them; ``bridge.qat`` puts them in the
user's own training loop. ``docs/qat.md``.
"""

from .losses import hidden_mse, kl_to_teacher
from .ranges import LearnedRange, ZERO_POINTS, fake_quantize, from_qparams, learnable, ranged, stored_effective, to_qparams

__all__ = ["LearnedRange", "ZERO_POINTS", "fake_quantize", "from_qparams", "hidden_mse", "kl_to_teacher", "learnable",
           "ranged", "stored_effective", "to_qparams"]

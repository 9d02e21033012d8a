"""Learning quantized models, as pure functions: learnable quantization parameters beside the weights
(:mod:`.ranges`; :mod:`.exact`: ranges standing exactly for given parameters), losses (:mod:`.losses`: distillation
from a float teacher, hidden-state errors) and a deterministic Adam over flat trees (:mod:`.optim`).

The ``qat`` step (:mod:`qtransform.algorithms.qat`) trains each block with them; ``bridge.qat`` puts them in the
user's own training loop. ``docs/qat.md``.
"""

from .losses import hidden_mse, kl_to_teacher
from .exact import exact_range, same_qparams
from .optim import AdamState, adam_init, adam_update, cosine
from .ranges import LearnedRange, ZERO_POINTS, fake_quantize, from_qparams, learnable, ranged, stored_effective, to_qparams

__all__ = ["AdamState", "adam_init", "adam_update", "cosine", "exact_range", "same_qparams", "LearnedRange", "ZERO_POINTS", "fake_quantize", "from_qparams", "hidden_mse", "kl_to_teacher", "learnable",
           "ranged", "stored_effective", "to_qparams"]

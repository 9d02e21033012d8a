"""Learning quantized models, as pure functions: learnable quantization parameters beside the weights
(:mod:`.ranges`), losses (:mod:`.losses`) and a deterministic optimiser over trees (:mod:`.optim`).

The ``qat`` step (:mod:`qtransform.algorithms.qat`) trains each block with them; ``bridge.qat`` puts them in the
user's own training loop. ``docs/qat.md``.
"""

from .ranges import LearnedRange, ZERO_POINTS, fake_quantize, from_qparams, learnable, ranged, stored_effective, to_qparams

__all__ = ["LearnedRange", "ZERO_POINTS", "fake_quantize", "from_qparams", "learnable", "ranged", "stored_effective",
           "to_qparams"]

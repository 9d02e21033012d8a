"""Plain casts: ``bf16`` and ``fp16``. Quantizing rounds to that dtype (scale fixed to 1).

Baselines for the other formats, and the same rounding as ``x.to(torch.bfloat16)``
for values in range (half to even, subnormals kept); values beyond the largest finite
one saturate to it unless the spec says ``saturate=False`` (then they become ±Inf, as
the torch cast does). Codes are stored in ``torch.bfloat16`` / ``torch.float16``.

>>> import torch, qtransform as qt
>>> x = torch.tensor([1.0 + 2 ** -9, 70000.0, 1e-6])
>>> spec = qt.QuantSpec(format="fp16")
>>> q = qt.quantize(x, qt.choose_qparams(x, spec))
>>> q.codes
tensor([1.0020e+00, 6.5504e+04, 1.0133e-06], dtype=torch.float16)
>>> torch.equal(qt.dequantize(q), x.clamp(max=65504).to(torch.float16).float())
True
"""

from __future__ import annotations

import torch

from .base import register_format
from .floats import minifloat
from .scaling import UNIT

__all__ = []

register_format(minifloat("bf16", exponent_bits=8, mantissa_bits=7, bias=127, special="ieee",
                          storage=torch.bfloat16, family="cast", scheme=UNIT, scale_dtypes=("float32",),
                          description="bfloat16 cast (scale 1)"))
register_format(minifloat("fp16", exponent_bits=5, mantissa_bits=10, bias=15, special="ieee",
                          storage=torch.float16, family="cast", scheme=UNIT, scale_dtypes=("float32",),
                          description="IEEE float16 cast (scale 1)"))

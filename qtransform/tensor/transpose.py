"""``transposed_qparams``: quantization parameters fitted on a weight's logical ``(out, in)`` layout, moved to
the layout it is stored in, transposed (GPT-2's ``Conv1D`` keeps ``(in, out)``; GPT-OSS's experts ``(E, in, out)``).

>>> import torch, qtransform as qt
>>> spec = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
>>> qp = qt.choose_qparams(torch.randn(4, 6), spec)
>>> stored = qt.transposed_spec(spec, (4, 6))
>>> tuple(transposed_qparams(qp, stored).scale.shape), tuple(qp.scale.shape)
((1, 4), (4, 1))
"""

from __future__ import annotations

from ..spec import QuantSpec
from .types import QParams

__all__ = ["transposed_qparams"]


def transposed_qparams(qp: QParams, stored: QuantSpec, *, path: str | None = None) -> QParams:
    """``qp`` (fitted on the logical layout; the last two axes of every grid-shaped field swapped) for the stored
    layout's spec ``stored`` (:func:`qtransform.transposed_spec` of the logical one). A micro-exponent format
    (MX4/MX6/MX9) is refused naming ``path``: its packed sub-block shifts follow the layout they were fitted in."""
    if not isinstance(qp, QParams) or not isinstance(stored, QuantSpec):
        raise TypeError(f"transposed_qparams: expected QParams and a QuantSpec, got {type(qp).__name__}, "
                        f"{type(stored).__name__}")
    if qp.micro_exponent is not None:
        raise ValueError(f"{path or 'transposed_qparams'}: format {stored.format!r} on a weight stored transposed "
                         "is not available to calibrated steps: its packed sub-block shifts follow the stored layout")

    def t(x):
        return None if x is None else (x if x.dim() < 2 else x.transpose(-1, -2).contiguous())

    return QParams(scale=t(qp.scale), zero_point=t(qp.zero_point), global_scale=qp.global_scale, spec=stored)

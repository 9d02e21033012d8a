"""Hypothesis strategies and assertions for testing formats (yours and the built-ins).

``spec_cases()`` enumerates the registry: every format with every granularity and
symmetry it accepts, each with a readable test id. ``tensors_for(spec)`` draws
float32 tensors whose shape fits the spec, with values spanning the whole float32 range
(subnormals and the largest values included), constant and all-zero blocks. ``assert_within_bound`` checks the round trip
against the format's own bound (:func:`qtransform.error_bound`).

>>> import qtransform as qt
>>> from qtransform.testing import spec_cases
>>> any(case_id == "int4-g16-asym_int" for case_id, _ in spec_cases())
True

Requires ``hypothesis`` (the ``test`` extra).
"""

from __future__ import annotations

import torch

from .formats import FORMATS
from .granularity import PerBlock, PerChannel, PerGroup, PerTensor
from .spec import QuantSpec
from .tensor import dequantize, error_bound, quantize

__all__ = ["spec_cases", "granularity_id", "tensors_for", "assert_within_bound", "BOUND_RTOL", "FLOAT32_MAX"]

#: Relative slack for float32 arithmetic in the bound check (far below any format's spacing).
BOUND_RTOL = 2.0 ** -12

_GRANULARITIES = (PerTensor(), PerChannel(0), PerChannel(-1), PerGroup(16), PerGroup(8, axis=0),
                  PerBlock((4, 8)))
_SYMMETRY = (("sym", {"symmetric": True}),
             ("asym_int", {"symmetric": False, "zero_point_domain": "int"}),
             ("asym_float", {"symmetric": False, "zero_point_domain": "float"}),
             ("asym_offset", {"symmetric": False, "zero_point_domain": "offset"}))


def granularity_id(g) -> str:
    if isinstance(g, PerTensor):
        return "tensor"
    if isinstance(g, PerChannel):
        return f"channel{g.axis}"
    if isinstance(g, PerGroup):
        return f"g{g.size}" + ("" if g.axis == -1 else f"ax{g.axis}")
    return "block" + "x".join(map(str, g.shape))


def spec_cases(formats=None) -> list[tuple[str, QuantSpec]]:
    """``[(test_id, spec), ...]`` for every valid (format, granularity, symmetry) combination."""
    names = list(FORMATS) if formats is None else list(formats)
    cases = []
    for name in names:
        fmt = FORMATS[name]
        grans = (None,) if fmt.block is not None else _GRANULARITIES
        for g in grans:
            for sym_id, kw in _SYMMETRY:
                try:
                    spec = QuantSpec(format=name, granularity=g, **kw)
                except ValueError:
                    continue  # a combination the format does not accept
                cases.append((f"{name}-{granularity_id(spec.granularity)}-{sym_id}", spec))
    return cases


def _shape_strategy(spec: QuantSpec):
    from hypothesis import strategies as st

    g = spec.granularity
    mult = [1, 1]
    if isinstance(g, PerGroup):
        mult[g.axis % 2] = g.size
    elif isinstance(g, PerBlock):
        mult = list(g.shape[:2]) + [1] * (2 - len(g.shape[:2]))
    pad = spec.pad
    return st.tuples(*(st.integers(1, 5 if m > 1 else 9).map(lambda k, m=m: k * m) if not pad
                       else st.integers(1, 3 * m + 3) for m in mult))


#: The largest float32: ``tensors_for`` draws values up to it.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _max_magnitude(spec: QuantSpec) -> float:
    """The largest magnitude whose blocks ``spec`` can scale: float32's maximum, or half of it for
    asymmetric formats with a single step (``uint1``/``int1``), whose scale ``max - min`` must itself be
    a float32 (wider blocks are refused with a ``ValueError``, tested in tests/test_api_edges.py)."""
    lo, hi = spec.fmt.codec.qrange(symmetric=spec.symmetric, restricted=spec.restricted)
    return FLOAT32_MAX / 2 if not spec.symmetric and hi - lo < 2 else FLOAT32_MAX


def tensors_for(spec: QuantSpec, *, max_magnitude_exp: int | None = None):
    """Strategy: float32 tensors of a shape that fits ``spec`` (2-D, a few hundred elements).

    Values are drawn in [-1, 1] (subnormals included), then rows are rescaled by powers of two
    ``2^k`` with ``|k| <= max_magnitude_exp`` (default: the whole float32 range, ``|k| <= 126``);
    some draws have an all-zero or a constant row, a row of subnormals, or a row of values near
    the largest float32 (the extremes themselves included).
    """
    from hypothesis import strategies as st
    from hypothesis.extra import numpy as hnp
    import numpy as np

    e_max = 126 if max_magnitude_exp is None else max_magnitude_exp
    top = _max_magnitude(spec)

    @st.composite
    def draw(draw_):
        shape = draw_(_shape_strategy(spec))
        vals = draw_(hnp.arrays(np.float32, shape, elements=st.floats(-1, 1, width=32)))
        # most rows within a few octaves of each other (the usual case), some across the whole range
        center = draw_(st.integers(-e_max, e_max))
        spread = draw_(st.sampled_from([0, 4, 20, 2 * e_max]))
        exps = draw_(hnp.arrays(np.int32, (shape[0], 1), elements=st.integers(
            max(-e_max, center - spread), min(e_max, center + spread))))
        x = torch.from_numpy(vals) * torch.exp2(torch.from_numpy(exps).float())
        mode = draw_(st.sampled_from(["plain", "plain", "plain", "zero_row", "const_row", "subnormal_row",
                                      "max_row"]))
        if mode == "zero_row":
            x[0] = 0.0
        elif mode == "const_row":
            x[0] = x[0, 0]
        elif mode == "subnormal_row":
            x[0] = torch.from_numpy(vals[0]) * 2.0 ** -126  # below the smallest normal float32
        elif mode == "max_row":
            x[0] = torch.from_numpy(vals[0]).double().mul(top).float()
            x[0, 0] = top
            x[0, -1] = -top
        return x

    return draw()


def assert_within_bound(x: torch.Tensor, qparams, *, rtol: float = BOUND_RTOL) -> torch.Tensor:
    """Quantize and dequantize ``x`` and check ``|x - y| <= error_bound`` elementwise.

    Returns the dequantized tensor. Raises ``AssertionError`` with the worst element.
    """
    y = dequantize(quantize(x, qparams))
    bound = error_bound(x, qparams).double()  # float64: differences near float32's maximum do not overflow
    err = (y.double() - x.double()).abs()
    slack = bound * rtol + x.double().abs() * 2.0 ** -22 + torch.finfo(torch.float32).tiny
    excess = err - bound - slack
    if bool((excess > 0).any()):
        i = int(excess.argmax())
        idx = tuple(int(t) for t in torch.unravel_index(torch.tensor(i), x.shape))
        raise AssertionError(
            f"{qparams.spec}: |x - dq(q(x))| = {err.flatten()[i].item():.6g} exceeds the bound "
            f"{bound.flatten()[i].item():.6g} at index {idx} (x = {x.flatten()[i].item():.6g}, "
            f"dq = {y.flatten()[i].item():.6g})")
    return y

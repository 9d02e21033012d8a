"""The near-tie comparison (near_ties.py) on CPU: a code flipped at a tie is explained, any other is not."""

from __future__ import annotations

import torch

import qtransform as qt

from near_ties import codes, element_params, equal_fraction, unexplained

SPEC = qt.QuantSpec(format="int4", granularity=qt.PerGroup(64), symmetric=False)


def _pair():
    w = torch.randn(4, 128, generator=torch.Generator().manual_seed(0))
    qp = qt.choose_qparams(w, SPEC)
    s, z = element_params(qt.quantize(w, qp))
    return w, qp, s, z


def test_a_flip_at_a_tie_is_a_near_tie_and_another_is_not():
    w, qp, s, z = _pair()
    a = qt.quantize(w, qp)
    k = codes(a)
    tie = w.clone()
    tie[0, 3] = ((k[0, 3] + 0.5 - z[0, 3]) * s[0, 3])  # exactly between code k and k + 1 (up to float32 rounding)
    ref = qt.quantize(tie, qp)
    up = tie.clone()
    up[0, 3] = (k[0, 3] + 0.5 + 1e-7 * max(1.0, abs(float(k[0, 3]))) - z[0, 3]) * s[0, 3]
    other = qt.quantize(up, qp)
    assert not bool(unexplained(tie, ref, other, rtol=1e-5).any())  # a near-tie: explained
    far = tie.clone()
    far[1, 7] = far[1, 7] + 2.0 * s[1, 7]  # two steps away: a real difference
    mask = unexplained(tie, ref, qt.quantize(far, qp), rtol=1e-5)
    assert mask.sum() == 1 and bool(mask[1, 7])
    b = qt.quantize(w, qp)
    assert not bool(unexplained(w, a, b, rtol=0.0).any()) and equal_fraction({"w": a}, {"w": b}) == 1.0


def test_a_neighbour_code_away_from_the_midpoint_is_unexplained():
    w, qp, s, z = _pair()
    a = qt.quantize(w, qp)
    v = w / s + z
    i = int(((v - v.round()).abs()).flatten().argmin())  # the element nearest a code: farthest from any tie
    r, c = divmod(i, w.shape[1])
    moved = w.clone()
    moved[r, c] = moved[r, c] + s[r, c]  # its neighbour code
    mask = unexplained(w, a, qt.quantize(moved, qp), rtol=1e-5)
    assert mask.sum() == 1 and bool(mask[r, c])
    assert equal_fraction({"w": a}, {"w": qt.quantize(moved, qp)}) == 1 - 1 / w.numel()

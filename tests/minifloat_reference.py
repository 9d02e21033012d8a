"""An independent, textbook model of minifloats for the tests (numpy float64, no qtransform code),
and ``registered``, which registers a user format for one test module.

``values(e, m, bias, special)`` lists every code's value from the definition; ``round_codes``
rounds float64 inputs to the nearest finite value by brute force (ties to the even code,
saturating at the largest finite magnitude) and returns the codes.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

import qtransform as qt


@contextlib.contextmanager
def registered(fmt):
    """Register a user format for the duration of a test module, then remove it again (other tests,
    and subprocesses compared with this one, see the built-in registry only)."""
    qt.register_format(fmt)
    try:
        yield fmt
    finally:
        qt.FORMATS.unregister(fmt.name)


def values(e: int, m: int, bias: int, special: str) -> np.ndarray:
    """float64 value of every code ``0 .. 2^(1+e+m) - 1`` (NaN and ±Inf where the format says)."""
    out = np.empty(1 << (1 + e + m), dtype=np.float64)
    top = (1 << e) - 1
    for code in range(out.size):
        sign, field, mant = code >> (e + m), (code >> m) & top, code & ((1 << m) - 1)
        if special == "ieee" and field == top:
            val = math.inf if mant == 0 else math.nan
        elif special == "fn" and field == top and mant == (1 << m) - 1:
            val = math.nan
        elif special == "fnuz" and code == 1 << (e + m):
            val = math.nan
        elif field == 0:
            val = mant / 2 ** m * 2.0 ** (1 - bias)
        else:
            val = (1 + mant / 2 ** m) * 2.0 ** (field - bias)
        out[code] = -val if sign and not math.isnan(val) else val
    return out


def round_codes(x: np.ndarray, e: int, m: int, bias: int, special: str) -> np.ndarray:
    """Codes of ``x`` rounded to nearest (ties to even code), saturating; int64."""
    table = values(e, m, bias, special)
    half = 1 << (e + m)
    mags = table[:half]
    finite = np.flatnonzero(np.isfinite(mags))
    grid, grid_codes = mags[finite], finite  # ascending, codes ascending with them
    a = np.minimum(np.abs(x), grid[-1])
    hi = np.clip(np.searchsorted(grid, a, side="left"), 0, grid.size - 1)
    lo = np.clip(hi - 1, 0, grid.size - 1)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (grid_codes[hi] % 2 == 0) & (hi != lo))
    mag_code = np.where(pick_hi, grid_codes[hi], grid_codes[lo])
    negative = np.signbit(x)
    if special == "fnuz":
        negative &= mag_code != 0
    return mag_code + negative * half


def test_points(e: int, m: int, bias: int, special: str) -> np.ndarray:
    """Every finite value, every midpoint, the floats just around each midpoint, and beyond the range."""
    table = values(e, m, bias, special)
    v = np.unique(table[np.isfinite(table)])
    mids = (v[1:] + v[:-1]) / 2
    mids32 = mids.astype(np.float32)
    pts = np.concatenate([
        v, mids, np.nextafter(mids32, np.float32(np.inf)), np.nextafter(mids32, np.float32(-np.inf)),
        [v[-1] * 1.01, v[0] * 1.01, v[-1] * 4, v[0] * 4, -0.0],
    ])
    return pts.astype(np.float32)

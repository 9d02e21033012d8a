"""Codebook formats: each code indexes a table of values (NF4).

A value is scaled by the absolute maximum of its block, rounded to the nearest
codebook entry, and stored as its index. Round-trip error bound: half the gap
between the two entries around the value, times the scale.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .base import Codec, Format, register_format
from ..granularity import PerGroup

__all__ = ["CodebookCodec", "NF4_VALUES"]

#: QLoRA's NormalFloat4 table (quantiles of N(0, 1) normalized to [-1, 1], with an exact 0).
NF4_VALUES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)


@dataclasses.dataclass(frozen=True)
class CodebookCodec(Codec):
    """Codes index ``values`` (ascending, at most 256 entries)."""

    values: tuple[float, ...]

    def __post_init__(self):
        vals = tuple(float(v) for v in self.values)
        if not 2 <= len(vals) <= 256 or any(b <= a for a, b in zip(vals, vals[1:])):
            raise ValueError("CodebookCodec: values must be 2..256 strictly increasing numbers")
        object.__setattr__(self, "values", vals)

    @property
    def bits(self) -> int:
        return max(1, math.ceil(math.log2(len(self.values))))

    code_dtype = torch.uint8
    signed = False

    @property
    def emax(self) -> int:
        return int(math.floor(math.log2(max(abs(self.values[0]), abs(self.values[-1])))))

    mbits = 0
    bound = "half the gap between neighbouring codebook entries, times the scale"

    def _table(self, like: torch.Tensor) -> torch.Tensor:
        return _table(tuple(self.values), str(like.device))

    def qrange(self, *, symmetric, restricted):
        return self.values[0], self.values[-1]

    def encode(self, v, *, rounding, noise=None, lo=None, hi=None):
        table = self._table(v)
        n = table.numel()
        below = (torch.bucketize(v.contiguous(), table, right=True) - 1).clamp(0, n - 2)
        lower, upper = table[below], table[below + 1]
        t = ((v - lower) / (upper - lower)).clamp(0.0, 1.0)
        if rounding == "half_even":
            up = (t > 0.5) | ((t == 0.5) & (below % 2 == 1))
        elif rounding == "half_away":
            up = (t > 0.5) | ((t == 0.5) & (upper.abs() > lower.abs()))
        elif rounding == "stochastic":
            if noise is None:
                raise ValueError("rounding='stochastic' needs noise: pass generator= (a torch.Generator or an int seed) to quantize")
            up = noise < t
        else:
            raise ValueError(f"unknown rounding {rounding!r}")
        return (below + up.to(below.dtype)).to(torch.uint8)

    def decode(self, codes):
        return self._table(codes)[codes.long()]

    def half_spacing(self, v):
        table = self._table(v)
        gaps = torch.diff(table) / 2
        below = (torch.bucketize(v.contiguous(), table, right=True) - 1).clamp(0, table.numel() - 2)
        return gaps[below]


register_format(Format(
    name="nf4", codec=CodebookCodec(NF4_VALUES), family="codebook",
    description="NormalFloat4 (QLoRA), absmax-scaled",
    default_granularity=PerGroup(64), scale_dtypes=("float32", "float16", "bfloat16"),
    symmetric_only=True,
))


_TABLES: dict = {}


def _table(values: tuple, device: str) -> torch.Tensor:
    """The codebook's values as a float32 tensor on ``device``, cached per device (no host-to-device copy per
    rounding call: GPTQ rounds one column at a time)."""
    if torch.compiler.is_compiling():  # nothing traced kept in the cache
        return torch.tensor(values, dtype=torch.float32, device=device)
    key = (values, device)
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return table

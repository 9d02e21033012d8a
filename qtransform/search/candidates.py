"""Candidate schemes of a search, by name: ``int8``, ``fp8_e4m3``, ``int4-g128``, ``uint4-g64``, ``nf4``,
``uint3-g64``, ``mxfp4``, ``nvfp4``, ``uint2-g64``...

Names:

* ``intN-gG``: symmetric N-bit integers in groups of G along the input features, float32 scales
  (``int4-g128`` is the preset of that name); ``int8`` alone: per output channel.
* ``uintN-gG``: asymmetric N-bit integers with float zero points and float16 scales, in groups of G
  (HQQ's form, :func:`qtransform.pipeline.hqq_spec`).
* ``nf4`` / ``nf4-gG``: NormalFloat-4 in groups of G (64 by default).
* ``fp8_e4m3`` (or ``fp8``): float8 per output channel; ``mxfp4``, ``mxfp6``, ``mxfp8``, ``nvfp4``: their presets.

>>> c = candidate("uint3-g64")
>>> c.name, str(c.spec)
('uint3-g64', 'uint3 g64 asym(float zp)')
>>> [c.name for c in candidates("int8, nf4")]
['int8', 'nf4']
"""

from __future__ import annotations

import re
from typing import NamedTuple

from ..granularity import PerGroup
from ..pipeline import get_preset, hqq_spec
from ..spec import QuantSpec

__all__ = ["Candidate", "candidate", "candidates", "DEFAULT_CANDIDATES"]

#: The default candidate list of ``qtransform search``.
DEFAULT_CANDIDATES = ("int8", "fp8_e4m3", "int4-g128", "uint4-g64", "uint4-g128", "nf4", "uint3-g64", "uint3-g128",
                      "mxfp4", "nvfp4", "uint2-g64")

_PRESETS = {"fp8": "fp8", "fp8_e4m3": "fp8", "mxfp4": "mxfp4", "mxfp6": "mxfp6", "mxfp8": "mxfp8", "nvfp4": "nvfp4"}
_INT = re.compile(r"(u?)int([2-8])(?:-g([1-9][0-9]*))?")
_NF4 = re.compile(r"nf4(?:-g([1-9][0-9]*))?")


class Candidate(NamedTuple):
    """A candidate scheme: its name (as the user wrote it) and its spec."""

    name: str
    spec: QuantSpec


def candidate(name: str) -> Candidate:
    """The candidate called ``name`` (see the module docstring).

    Raises:
        ValueError: naming ``candidates`` and the unknown name.
    """
    if not isinstance(name, str):
        raise TypeError(f"candidates: a candidate is a name (str), got {type(name).__name__}")
    if name in _PRESETS:
        return Candidate(name, get_preset(_PRESETS[name]).spec)
    m = _INT.fullmatch(name)
    if m and m.group(3) is None and name == "int8":
        return Candidate(name, get_preset("int8-channel").spec)
    if m and m.group(3) is not None:
        bits, size = int(m.group(2)), int(m.group(3))
        if m.group(1):
            return Candidate(name, hqq_spec(bits, size))
        base = get_preset("int4-g128").spec.to_dict()
        return Candidate(name, QuantSpec.from_dict({**base, "format": f"int{bits}",
                                                    "granularity": {"type": "PerGroup", "size": size, "axis": -1}}))
    m = _NF4.fullmatch(name)
    if m:
        return Candidate(name, QuantSpec(format="nf4", granularity=PerGroup(int(m.group(1) or 64)), pad=True))
    raise ValueError(f"candidates: unknown candidate {name!r}; names are intN-gG, uintN-gG (N in 2..8), int8, nf4[-gG], "
                     f"{', '.join(sorted(_PRESETS))}")


def candidates(names) -> tuple[Candidate, ...]:
    """Candidates from a comma-separated string or a list of names (each once).

    Raises:
        ValueError: naming ``candidates`` for an unknown, repeated or empty list.
    """
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    out = tuple(candidate(n) for n in names)
    if not out:
        raise ValueError("candidates: the list is empty")
    seen = [c.name for c in out]
    dup = sorted({n for n in seen if seen.count(n) > 1})
    if dup:
        raise ValueError(f"candidates: {dup} given more than once")
    return out



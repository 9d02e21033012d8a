"""Granularities: which elements share one scale.

Every granularity turns into a *block size* for a given tensor shape: a tuple with
one entry per axis. Elements whose indices agree after integer division by the block
size share a scale, so the scale tensor has shape ``ceil(shape / block_size)`` (the
*grid*), with as many dimensions as the tensor. For a weight of shape (out, in):

========================  ===========  ==============
granularity               block size   scale shape
========================  ===========  ==============
``PerTensor()``           (out, in)    (1, 1)
``PerChannel(axis=0)``    (1, in)      (out, 1)
``PerGroup(128)``         (1, 128)     (out, in/128)
``PerBlock((128, 128))``  (128, 128)   (out/128, in/128)
========================  ===========  ==============
"""

from __future__ import annotations

import dataclasses
from typing import Union

__all__ = ["PerTensor", "PerChannel", "PerGroup", "PerBlock", "Granularity",
           "block_size", "granularity_from_dict"]


def _norm_axis(axis: int, ndim: int, what: str) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"{what}: axis {axis} is out of range for a tensor with {ndim} dimension(s)")
    return axis % ndim


@dataclasses.dataclass(frozen=True, kw_only=True)
class PerTensor:
    """One scale for the whole tensor."""

    def block_size(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shape)

    def to_dict(self) -> dict:
        return {"type": "PerTensor"}


@dataclasses.dataclass(frozen=True)
class PerChannel:
    """One scale per index along ``axis`` (output channels of a weight by default)."""

    axis: int = 0

    def __post_init__(self):
        if not isinstance(self.axis, int) or isinstance(self.axis, bool):
            raise TypeError(f"PerChannel: axis must be an int, got {self.axis!r}")

    def block_size(self, shape):
        a = _norm_axis(self.axis, len(shape), "PerChannel")
        return tuple(1 if i == a else n for i, n in enumerate(shape))

    def to_dict(self):
        return {"type": "PerChannel", "axis": self.axis}


@dataclasses.dataclass(frozen=True)
class PerGroup:
    """One scale per ``size`` consecutive elements along ``axis`` (the last axis by default)."""

    size: int
    axis: int = -1

    def __post_init__(self):
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(f"PerGroup: size must be a positive int, got {self.size!r}")
        if not isinstance(self.axis, int) or isinstance(self.axis, bool):
            raise TypeError(f"PerGroup: axis must be an int, got {self.axis!r}")

    def block_size(self, shape):
        a = _norm_axis(self.axis, len(shape), "PerGroup")
        return tuple(self.size if i == a else 1 for i in range(len(shape)))

    def to_dict(self):
        return {"type": "PerGroup", "size": self.size, "axis": self.axis}


@dataclasses.dataclass(frozen=True)
class PerBlock:
    """One scale per block of ``shape`` over the leading axes (e.g. 128x128 tiles of a weight).

    Axes beyond ``len(shape)`` belong whole to each block.
    """

    shape: tuple[int, ...]

    def __post_init__(self):
        shape = tuple(self.shape) if isinstance(self.shape, (list, tuple)) else None
        if not shape or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in shape):
            raise ValueError(f"PerBlock: shape must be a non-empty tuple of positive ints, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)

    def block_size(self, shape):
        if len(self.shape) > len(shape):
            raise ValueError(
                f"PerBlock{self.shape} needs at least {len(self.shape)} dimensions, got shape {tuple(shape)}"
            )
        return tuple(self.shape) + tuple(shape[len(self.shape):])

    def to_dict(self):
        return {"type": "PerBlock", "shape": list(self.shape)}


Granularity = Union[PerTensor, PerChannel, PerGroup, PerBlock]
_TYPES = {"PerTensor": PerTensor, "PerChannel": PerChannel, "PerGroup": PerGroup, "PerBlock": PerBlock}


def granularity_from_dict(d: dict) -> Granularity:
    if not isinstance(d, dict) or d.get("type") not in _TYPES:
        raise ValueError(f"granularity: expected a dict with type in {sorted(_TYPES)}, got {d!r}")
    kwargs = {k: v for k, v in d.items() if k != "type"}
    if d["type"] == "PerBlock" and "shape" in kwargs:
        kwargs["shape"] = tuple(kwargs["shape"])
    try:
        return _TYPES[d["type"]](**kwargs)
    except TypeError as e:
        raise ValueError(f"granularity: bad fields for {d['type']}: {e}") from None


def block_size(granularity: Granularity, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Block size of ``granularity`` for a tensor of ``shape`` (one entry per axis)."""
    return granularity.block_size(tuple(shape))

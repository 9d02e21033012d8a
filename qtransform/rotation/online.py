"""Online rotations: orthogonal transforms a quantized model applies to activations at run time.

QuaRot and SpinQuant rotate two places that no weight can absorb on both sides: the input of the
MLP's down projection (``R4``: ``y = x Wᵀ = (x H)(W H)ᵀ``, ``W H`` computed once, ``x H`` at run
time) and the queries and keys after rotary embeddings (``R3``: ``(q H)(k H)ᵀ = q kᵀ``, so the
attention scores are unchanged while the key cache holds spread-out values). The transform is a
Hadamard matrix applied with :func:`~qtransform.rotation.hadamard_transform`
(``O(n log n)`` for the power-of-two factor) along the activation's last axis, in blocks of
``size`` (the whole axis where it has a Hadamard matrix; else the largest divisor that has one,
block-diagonal and still orthogonal: :func:`online_hadamard`).

An :class:`OnlineRotation` is recorded per :class:`~qtransform.Site`: ``Site(linear, "input")``
for a linear's input (its weight already holds ``W H``), ``Site(attention, "key")`` for the
queries and keys of an attention module. Steps return them in :attr:`qtransform.Fit.online`; the
calibrator applies them while later steps run, the bridge's modules at run time, and checkpoints
record them.

>>> import torch
>>> online_hadamard(1536), online_hadamard(156)  # 156 = 3 x 52: three blocks of order 52
(OnlineRotation(size=1536, kind='hadamard'), OnlineRotation(size=52, kind='hadamard'))
>>> rot = online_hadamard(156)
>>> x, w = torch.randn(5, 156, dtype=torch.float64), torch.randn(7, 156, dtype=torch.float64)
>>> bool(torch.allclose(apply_online(x, rot) @ apply_online(w, rot).T, x @ w.T))
True
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import torch

from .constructions import hadamard_transform, has_hadamard

__all__ = ["ONLINE_ROLES", "ONLINE_KINDS", "OnlineRotation", "online_hadamard", "apply_online", "check_online"]

#: The kinds of online rotation.
ONLINE_KINDS = ("hadamard",)
#: Where online rotations sit: a linear's input, an attention module's queries and keys (site role ``"key"``).
ONLINE_ROLES = ("input", "key")


class OnlineRotation(NamedTuple):
    """A normalised Hadamard transform over the last axis in blocks of ``size`` (see the module docstring)."""

    size: int
    kind: str = "hadamard"

    def to_dict(self) -> dict:
        """Plain JSON-able data (checkpoints), :meth:`from_value`'s inverse."""
        return {"kind": self.kind, "size": self.size}

    @classmethod
    def from_value(cls, value, *, where: str = "online rotation") -> "OnlineRotation":
        """An online rotation from itself or its :meth:`to_dict` form (``ValueError`` naming ``where``)."""
        if isinstance(value, cls):
            rot = value
        elif isinstance(value, Mapping) and set(value) == {"kind", "size"}:
            rot = cls(size=value["size"], kind=value["kind"])
        else:
            raise ValueError(f"{where}: expected {{'kind': 'hadamard', 'size': n}}, got {value!r:.80}")
        if rot.kind not in ONLINE_KINDS:
            raise ValueError(f"{where}: kind must be one of {list(ONLINE_KINDS)}, got {rot.kind!r}")
        if not isinstance(rot.size, int) or isinstance(rot.size, bool) or rot.size < 1 or not has_hadamard(rot.size):
            raise ValueError(f"{where}: size must be an order with a Hadamard matrix, got {rot.size!r}")
        return rot


def online_hadamard(n: int) -> OnlineRotation:
    """The online rotation of an axis of width ``n``: a Hadamard transform of order ``n``, or, where no
    construction reaches ``n``, of the largest divisor of ``n`` that has one, block by block."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"online_hadamard: n must be a positive int, got {n!r}")
    return OnlineRotation(size=max(d for d in range(1, n + 1) if n % d == 0 and has_hadamard(d)))


def check_online(rot: OnlineRotation, width: int, where: str) -> None:
    """``ValueError`` naming ``where`` unless ``rot``'s blocks tile an axis of ``width``."""
    if not isinstance(rot, OnlineRotation):
        raise TypeError(f"{where}: expected an OnlineRotation, got {type(rot).__name__}")
    if width % rot.size:
        raise ValueError(f"{where}: an online rotation of size {rot.size} does not divide the axis of width {width}")


def apply_online(x: torch.Tensor, rot: OnlineRotation) -> torch.Tensor:
    """``x`` with ``rot`` applied to its last axis (each block of ``rot.size`` times the normalised
    Hadamard matrix). Applied to a linear's weight it gives ``W H``, to its input ``x H``."""
    check_online(rot, x.shape[-1], "apply_online")
    if rot.size == x.shape[-1]:
        return hadamard_transform(x)
    lead = x.shape[:-1]
    return hadamard_transform(x.reshape(*lead, -1, rot.size)).reshape(x.shape)

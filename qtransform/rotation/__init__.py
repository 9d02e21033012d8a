"""Rotations: Hadamard matrices of every order a known construction reaches, their fast transform,
orthogonal matrices for any order, the residual-stream rotation of a parameter tree (QuaRot's
offline rotations) and the rotations a model applies at run time (online)."""

from .constructions import HadamardConstruction, hadamard, hadamard_construction, hadamard_transform, has_hadamard
from .online import ONLINE_ROLES, OnlineRotation, apply_online, check_online, online_hadamard
from .orthogonal import (orthogonal, orthogonal_construction, random_hadamard, random_orthogonal,
                         random_signs)
from .residual import HeadPair, NormReaders, QueryKey, ResidualLayout, fuse_norms, rotate

__all__ = ["HadamardConstruction", "hadamard", "hadamard_construction", "hadamard_transform", "has_hadamard", "ONLINE_ROLES", "OnlineRotation",
           "apply_online", "check_online", "online_hadamard", "orthogonal", "orthogonal_construction",
           "random_hadamard", "random_orthogonal", "random_signs", "HeadPair", "NormReaders", "QueryKey", "ResidualLayout",
           "fuse_norms", "rotate"]

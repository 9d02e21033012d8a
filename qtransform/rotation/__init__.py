"""Rotations: Hadamard matrices of every order a known construction reaches, their fast transform,
orthogonal matrices for any order, and the residual-stream rotation of a parameter tree (QuaRot's
offline rotations)."""

from .constructions import HadamardPlan, hadamard, hadamard_plan, hadamard_transform, has_hadamard
from .orthogonal import (orthogonal, orthogonal_construction, random_hadamard, random_orthogonal,
                         random_signs)
from .rotate import HeadPair, NormReaders, ResidualLayout, fuse_norms, rotate

__all__ = ["HadamardPlan", "hadamard", "hadamard_plan", "hadamard_transform", "has_hadamard", "orthogonal",
           "orthogonal_construction", "random_hadamard", "random_orthogonal", "random_signs", "HeadPair", "NormReaders", "ResidualLayout", "fuse_norms", "rotate"]

"""Rotations: Hadamard matrices of every order a known construction reaches, their fast transform,
and orthogonal matrices for any order."""

from .constructions import HadamardPlan, hadamard, hadamard_plan, hadamard_transform, has_hadamard
from .orthogonal import (orthogonal, orthogonal_construction, random_hadamard, random_orthogonal,
                         random_signs)

__all__ = ["HadamardPlan", "hadamard", "hadamard_plan", "hadamard_transform", "has_hadamard", "orthogonal",
           "orthogonal_construction", "random_hadamard", "random_orthogonal", "random_signs"]

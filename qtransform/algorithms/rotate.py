"""The ``rotate`` step: QuaRot's offline rotations (:func:`qtransform.rotate`) before quantization.

Options: ``layout`` (a :class:`~qtransform.rotation.ResidualLayout` or its dict; the bridge fills it
from the model's architecture table), ``rotation`` (``"hadamard"``: a randomised Hadamard matrix for
``R1`` and a Hadamard matrix for ``R2``, falling back to :func:`qtransform.orthogonal` for widths
without one; ``"random"``: random orthogonal matrices), ``seed``, ``heads`` (also rotate each value
/ output head pair by ``R2``, default true). Needs no data; it changes the embeddings, the norms,
the output head and every linear the stream touches, so it runs on the whole tree (never while a
checkpoint loads). The matrices are computed in float64; the function is unchanged up to the
weights' rounding.
"""

from __future__ import annotations

import torch

from ..rotation import ResidualLayout, has_hadamard, orthogonal, random_orthogonal
from ..rotation import rotate as rotate_tree
from .base import Fit, register_algorithm

__all__ = ["ROTATIONS", "rotation_matrix", "rotate_step", "check_options"]

ROTATIONS = ("hadamard", "random")


def rotation_matrix(n: int, rotation: str, seed: int) -> torch.Tensor:
    """The float64 ``n x n`` orthogonal matrix of ``rotation`` (see the module docstring)."""
    if rotation == "random":
        return random_orthogonal(n, seed, dtype=torch.float64)
    return orthogonal(n, seed, dtype=torch.float64)


def check_options(*, path=None, layout=None, rotation="hadamard", seed=0, heads=True, **unknown) -> None:
    if unknown:
        raise ValueError(f"rotate: unknown option(s) {sorted(unknown)}; options: layout, rotation, seed, heads")
    if rotation not in ROTATIONS:
        raise ValueError(f"rotate: rotation must be one of {list(ROTATIONS)}, got {rotation!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"rotate: seed must be an int, got {seed!r}")
    if not isinstance(heads, bool):
        raise TypeError(f"rotate: heads must be true or false, got {heads!r}")
    if layout is not None:
        ResidualLayout.from_value(layout, where="rotate: layout")


def rotate_step(params, plan, *, context, layout=None, rotation: str = "hadamard", seed: int = 0,
                heads: bool = True) -> Fit:
    """The ``rotate`` step (see the module docstring)."""
    check_options(layout=layout, rotation=rotation, seed=seed, heads=heads)
    if layout is None:
        raise ValueError("rotate: layout: no residual layout given; bridge.quantize fills it from the model's "
                         "architecture table (bridge.arch.residual_layout), or pass layout=ResidualLayout(...)")
    lay = ResidualLayout.from_value(layout, where="rotate: layout")
    emb = params.get(lay.embeddings[0]) if lay.embeddings else None
    if not isinstance(emb, torch.Tensor):
        raise ValueError(f"rotate: layout embeddings {list(lay.embeddings)} name no tensor of the tree: the residual "
                         "width is unknown")
    d = emb.shape[-1]
    R1 = rotation_matrix(d, rotation, seed)
    R2 = rotation_matrix(lay.heads[0].head_dim, rotation, seed + 1) if heads and lay.heads else None
    out = rotate_tree(params, lay if heads else lay._replace(heads=()), R1, R2)
    changed = {p: t for p, t in out.items() if t is not params.get(p)}
    info = {p: {"rotation": ("Hadamard" if rotation == "hadamard" and has_hadamard(d) else rotation)
                + f" {d}"} for p in changed if p in plan.specs}
    return Fit(params=changed, info=info)


register_algorithm("rotate", rotate_step, check_options=check_options,
                   description="QuaRot's offline rotations: norms fused, residual stream and heads rotated "
                               "(randomised Hadamard); the function unchanged")

"""Low-rank compensation of a quantization error (EoRA; HQQ+'s adapter without training).

A quantized linear runs ``Q`` instead of its float weight ``W`` (both ``(out, in)``): the error is
``E = W - Q``. A rank-``r`` correction ``B A`` (``B`` ``(out, r)``, ``A`` ``(r, in)``), run beside the
quantized weight (``y = Q x + B (A x)``), takes back as much of it as ``r`` allows:

* without data: the truncated SVD of ``E`` (Eckart–Young: the smallest ``||E - B A||_F``);
* with the input Hessian ``H = XᵀX / n`` of the layer (EoRA): the smallest ``||(E - B A) Xᵀ||_F``,
  the output error on the calibration inputs. With ``H = U Λ Uᵀ``, ``||(E - B A) Xᵀ||²_F =
  n ||(E - B A) U Λ^{1/2}||²_F``, so the truncated SVD ``P_r S_r Q_rᵀ`` of ``E' = E U Λ^{1/2}`` gives
  the optimum, mapped back by ``Λ^{-1/2} Uᵀ``.

The singular values are split evenly between the factors (``B = P_r S_r^{1/2}``, ``A = S_r^{1/2} Q_rᵀ
Λ^{-1/2} Uᵀ``), so both stay in the same range when stored in 16 bits. Eigenvalues are damped by
``damp`` times their mean (as GPTQ damps its Hessian) and floored at a tiny fraction of the largest
(``1e-10`` in float64, ``1e-6`` in float32), so directions the data never visits do not blow up ``A``;
``damp=0`` on a full-rank ``H`` is the exact optimum. The decompositions run in float64 for a float64
error and in float32 otherwise (a model's weights: several times faster, far below the quantization error).
A rank at or above ``min(out, in)`` gives ``B A = E`` (to float rounding).

>>> import torch
>>> E = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
>>> c = lowrank_error(E, rank=1)
>>> torch.allclose(c.delta(), torch.tensor([[3.0, 0.0], [0.0, 0.0]])), c.rank
(True, 1)
"""

from __future__ import annotations

import dataclasses

import torch

from .._pytree import pytree_dataclass

__all__ = ["LowRank", "lowrank_error", "hessian_basis", "check_lowrank"]

_FLOOR = {torch.float64: 1e-10, torch.float32: 1e-6}


def _work(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@pytree_dataclass(static=())
class LowRank:
    """A rank-``r`` correction of a linear weight in its logical ``(out, in)`` layout: ``a`` ``(r, in)``,
    ``b`` ``(out, r)``; the layer runs ``y = Q x + b (a x)`` (a pytree: ``a`` and ``b`` are leaves)."""

    a: torch.Tensor
    b: torch.Tensor

    def __post_init__(self):
        for name in ("a", "b"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                raise TypeError(f"LowRank.{name} must be a 2-D tensor, got "
                                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if self.a.shape[0] != self.b.shape[1]:
            raise ValueError(f"LowRank: a {tuple(self.a.shape)} and b {tuple(self.b.shape)} disagree on the rank")

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])

    def delta(self) -> torch.Tensor:
        """The correction as a dense ``(out, in)`` matrix, ``b @ a``."""
        return self.b @ self.a

    def to(self, dtype: torch.dtype) -> "LowRank":
        return dataclasses.replace(self, a=self.a.to(dtype), b=self.b.to(dtype))


def check_lowrank(c: LowRank, shape: tuple[int, int], *, path: str) -> None:
    """``ValueError`` naming ``path`` unless ``c`` corrects a logical ``(out, in)`` weight of ``shape``."""
    out, inn = shape
    if tuple(c.b.shape[:1]) != (out,) or tuple(c.a.shape[1:]) != (inn,):
        raise ValueError(f"{path}: low-rank correction a {tuple(c.a.shape)} and b {tuple(c.b.shape)} does not fit a "
                         f"weight of logical shape ({out}, {inn}) (a must be (r, {inn}), b ({out}, r))")


def hessian_basis(hessian: torch.Tensor, *, damp: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U, λ)``: the eigenvectors (columns) and the damped, floored eigenvalues of a symmetric
    ``(in, in)`` Hessian, in float64 for a float64 Hessian, else float32.

    >>> U, lam = hessian_basis(torch.diag(torch.tensor([4.0, 1.0])))
    >>> sorted(lam.tolist())
    [1.0, 4.0]
    """
    if not isinstance(hessian, torch.Tensor) or hessian.dim() != 2 or hessian.shape[0] != hessian.shape[1]:
        raise ValueError(f"hessian must be a square (in, in) tensor, got "
                         f"{tuple(hessian.shape) if isinstance(hessian, torch.Tensor) else type(hessian).__name__}")
    if not isinstance(damp, (int, float)) or isinstance(damp, bool) or damp < 0:
        raise ValueError(f"damp must be a number >= 0, got {damp!r}")
    h = hessian.to(_work(hessian.dtype))
    lam, U = torch.linalg.eigh((h + h.T) / 2)
    lam = lam.clamp_min(0)
    lam = lam + damp * lam.mean()
    top = lam.max()
    if not top > 0:
        raise ValueError("hessian is zero: no input was observed")
    return U, lam.clamp_min(_FLOOR[h.dtype] * top)


def _split(P: torch.Tensor, S: torch.Tensor, Qt: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    root = S[:rank].sqrt()
    return P[:, :rank] * root, root[:, None] * Qt[:rank]


def lowrank_error(error: torch.Tensor, *, rank: int, hessian: torch.Tensor | None = None,
                  damp: float = 0.0, basis: tuple[torch.Tensor, torch.Tensor] | None = None) -> LowRank:
    """The rank-``rank`` correction of ``error`` ``(out, in)`` (see the module docstring): weighted by
    ``hessian`` ``(in, in)`` when given (or by its ``basis``, :func:`hessian_basis`'s ``(U, λ)``, computed
    once for the linears that share an input), else the truncated SVD. Decomposed in float64 for a
    float64 ``error``, else float32; returned in ``error``'s dtype; the rank is ``min(rank, out, in)``.

    >>> E = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    >>> H = torch.diag(torch.tensor([1.0, 0.0]))  # the second input is always zero
    >>> c = lowrank_error(E, rank=1, hessian=H)
    >>> round(float(((E - c.delta()) @ H @ (E - c.delta()).T).trace()), 6)  # no output error left
    0.0
    """
    if not isinstance(error, torch.Tensor) or error.dim() != 2 or not error.is_floating_point():
        raise ValueError(f"error must be a 2-D float (out, in) tensor, got "
                         f"{tuple(error.shape) if isinstance(error, torch.Tensor) else type(error).__name__}")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"rank must be an int >= 1, got {rank!r}")
    rank = min(rank, *error.shape)
    E = error.to(_work(error.dtype))
    if basis is None and hessian is not None:
        if hessian.shape != (error.shape[1],) * 2:
            raise ValueError(f"hessian has shape {tuple(hessian.shape)}, the error {tuple(error.shape)} needs "
                             f"({error.shape[1]}, {error.shape[1]})")
        basis = hessian_basis(hessian.to(error.device, E.dtype), damp=damp)
    if basis is None:
        P, S, Qt = torch.linalg.svd(E, full_matrices=False)
        b, a = _split(P, S, Qt, rank)
    else:
        U, lam = (t.to(E.dtype) for t in basis)
        if U.shape != (error.shape[1],) * 2:
            raise ValueError(f"basis has shape {tuple(U.shape)}, the error {tuple(error.shape)} needs "
                             f"({error.shape[1]}, {error.shape[1]})")
        root = lam.sqrt()
        P, S, Qt = torch.linalg.svd((E @ U) * root, full_matrices=False)
        b, a = _split(P, S, Qt, rank)
        a = (a / root) @ U.T
    return LowRank(a=a.to(error.dtype).contiguous(), b=b.to(error.dtype).contiguous())

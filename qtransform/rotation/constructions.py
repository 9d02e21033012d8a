"""Hadamard matrices of every order a known construction reaches, and their fast transform.

A Hadamard matrix ``H`` of order ``n`` has entries ±1 and ``H Hᵀ = n I``; ``H / sqrt(n)`` is
orthogonal. Orders other than 1 and 2 are multiples of 4. The constructions here:

* **Sylvester**: order ``2^k`` (``[[H, H], [H, -H]]``), applied in ``O(n log n)`` by butterflies;
* **Paley I**: order ``q + 1`` for a prime power ``q ≡ 3 (mod 4)`` (12, 20, 28, 44, 60, 108, 140...);
* **Paley II**: order ``2 (q + 1)`` for a prime power ``q ≡ 1 (mod 4)`` (36, 52, 148...);
* **Kronecker products** ``H_a ⊗ H_b`` of those.

:func:`hadamard_construction` writes ``n = 2^k · m`` with the largest power of two for which the core ``m``
has a construction (one Paley matrix or a product of two), so that :func:`hadamard_transform`
costs ``O(n (k + m))``: SmolLM2's 576 = 16·36 (Paley II, q = 17), 1536 = 128·12 (Paley I,
q = 11), Qwen2-7B's 18944 = 128·148 (Paley II, q = 73). Orders no construction here reaches
(156 = 4·39, 172 = 4·43: Williamson-type matrices) raise a ``ValueError`` naming the nearest
covered orders; :func:`qtransform.rotation.orthogonal` gives a fast orthogonal fallback for them.

>>> import torch
>>> H = hadamard(12)
>>> bool(torch.allclose(H @ H.T, torch.eye(12), atol=1e-6))
True
>>> hadamard_construction(18944)
HadamardConstruction(n=18944, power=128, core=(148,), construction='2^7 x Paley II (q=73)')
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

__all__ = ["HadamardConstruction", "hadamard", "hadamard_construction", "has_hadamard", "hadamard_transform"]


class HadamardConstruction(NamedTuple):
    """``n = power · prod(core)``: a Sylvester factor and the Paley matrices of the core."""

    n: int
    power: int
    core: tuple[int, ...]
    construction: str


def _prime_power(q: int) -> tuple[int, int] | None:
    """``(p, m)`` with ``q = p^m`` for a prime ``p``, or ``None``."""
    if q < 2:
        return None
    p = next((d for d in range(2, math.isqrt(q) + 1) if q % d == 0), q)
    m, r = 0, q
    while r % p == 0:
        r //= p
        m += 1
    return (p, m) if r == 1 else None


def _paley(order: int) -> str | None:
    """The Paley construction of ``order`` ("I" or "II"), or ``None``."""
    pp = _prime_power(order - 1)
    if pp is not None and (order - 1) % 4 == 3:
        return "I"
    if order % 2 == 0:
        pp = _prime_power(order // 2 - 1)
        if pp is not None and (order // 2 - 1) % 4 == 1:
            return "II"
    return None


def _label(order: int) -> str:
    kind = _paley(order)
    q = order - 1 if kind == "I" else order // 2 - 1
    return f"Paley {kind} (q={q})"


@functools.lru_cache(maxsize=None)
def _core(m: int) -> tuple[int, ...] | None:
    """The Paley orders whose Kronecker product is ``m`` (at most two), or ``None``."""
    if m == 1:
        return ()
    if _paley(m):
        return (m,)
    for a in range(12, math.isqrt(m) + 1, 4):
        if m % a == 0 and _paley(a) and _paley(m // a):
            return (a, m // a)
    return None


def _find(n: int) -> HadamardConstruction | None:
    power = 1 << ((n & -n).bit_length() - 1)  # the largest power of two dividing n
    while power >= 1:
        core = _core(n // power)
        if core is not None:
            parts = [f"2^{power.bit_length() - 1}"] if power > 1 else []
            parts += [_label(c) for c in core]
            return HadamardConstruction(n, power, core, " x ".join(parts) or "1")
        power //= 2
    return None


def _check_order(n) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"hadamard: n must be a positive int, got {n!r}")


def hadamard_construction(n: int) -> HadamardConstruction:
    """How :func:`hadamard` builds order ``n`` (``ValueError`` when no construction here reaches it)."""
    _check_order(n)
    found = _find(n)
    if found is None:
        raise ValueError(f"hadamard: no construction here reaches order {n} (Sylvester 2^k, Paley I/II and their "
                         f"Kronecker products; nearest covered orders {_nearest(n)}); use "
                         "qtransform.rotation.orthogonal(n) for a fast orthogonal matrix of any order")
    return found


def has_hadamard(n: int) -> bool:
    """Whether :func:`hadamard` builds order ``n``."""
    _check_order(n)
    return _find(n) is not None


def _nearest(n: int) -> list[int]:
    below = next((m for m in range(n - 1, 0, -1) if has_hadamard(m)), None)
    above = next(m for m in range(n + 1, 2 * n + 3) if has_hadamard(m))
    return [m for m in (below, above) if m is not None]


# --------------------------------------------------------------------------- finite fields
def _irreducible(p: int, m: int) -> list[int]:
    """Coefficients (low to high, monic) of an irreducible polynomial of degree ``m`` over GF(p)."""
    for code in range(p ** m):
        coeffs = [(code // p ** i) % p for i in range(m)] + [1]
        if coeffs[0] == 0:
            continue
        # irreducible iff no root-free factorisation: check no factor of degree <= m/2 divides it
        if all(_poly_mod(coeffs, f, p) != [0] * (len(f) - 1) for d in range(1, m // 2 + 1) for f in _monic(p, d)):
            return coeffs
    raise AssertionError(f"no irreducible polynomial of degree {m} over GF({p})")  # cannot happen: one always exists


def _monic(p: int, d: int):
    for code in range(p ** d):
        yield [(code // p ** i) % p for i in range(d)] + [1]


def _poly_mod(a: list[int], f: list[int], p: int) -> list[int]:
    """``a mod f`` over GF(p), as ``len(f) - 1`` coefficients."""
    a = list(a)
    for i in range(len(a) - 1, len(f) - 2, -1):
        c = a[i] % p
        if c:
            for j, fj in enumerate(f):
                a[i - len(f) + 1 + j] = (a[i - len(f) + 1 + j] - c * fj) % p
    out = [x % p for x in a[:len(f) - 1]]
    return out + [0] * (len(f) - 1 - len(out))


def _character(q: int) -> torch.Tensor:
    """The quadratic character of GF(q) over its elements ``0..q-1`` (base-p digits = polynomial
    coefficients): 0 at 0, 1 on nonzero squares, -1 elsewhere."""
    p, m = _prime_power(q)
    chi = torch.full((q,), -1, dtype=torch.int64)
    chi[0] = 0
    if m == 1:
        chi[torch.tensor(sorted({(x * x) % p for x in range(1, p)}))] = 1
        return chi
    f = _irreducible(p, m)
    for x in range(1, q):
        a = [(x // p ** i) % p for i in range(m)]
        sq = [0] * (2 * m - 1)
        for i, ai in enumerate(a):
            for j, aj in enumerate(a):
                sq[i + j] = (sq[i + j] + ai * aj) % p
        chi[sum(c * p ** i for i, c in enumerate(_poly_mod(sq, f, p)))] = 1
    return chi


def _jacobsthal(q: int) -> torch.Tensor:
    """``Q[a, b] = chi(a - b)`` over GF(q) (int8, q x q)."""
    p, m = _prime_power(q)
    chi = _character(q).to(torch.int8)
    if m == 1:  # Q[a, b] = chi[(a - b) mod q]: a Toeplitz matrix, read as a flipped Hankel view
        v = chi[(torch.arange(2 * q - 1) - (q - 1)) % q]  # v[j] = chi[j - (q - 1)]
        return v.as_strided((q, q), (1, 1)).flip(1)  # [a, b'] = v[a + b'], b' = q - 1 - b
    x = torch.arange(q)
    digits = torch.stack([(x // p ** i) % p for i in range(m)], dim=1)  # (q, m)
    diff = (digits[:, None, :] - digits[None, :, :]) % p
    index = (diff * torch.tensor([p ** i for i in range(m)])).sum(-1)
    return chi[index]


def _paley_matrix(order: int) -> torch.Tensor:
    """The ±1 Paley matrix of ``order`` (int8)."""
    kind = _paley(order)
    if kind == "I":
        q = order - 1
        Q = _jacobsthal(q)
        H = torch.zeros(order, order, dtype=torch.int8)
        H[0, 1:], H[1:, 0], H[1:, 1:] = 1, -1, Q
        H.diagonal().add_(1)
    else:
        q = order // 2 - 1
        Q = _jacobsthal(q)
        C = torch.zeros(q + 1, q + 1, dtype=torch.int8)
        C[0, 1:], C[1:, 0], C[1:, 1:] = 1, 1, Q
        A = torch.tensor([[1, 1], [1, -1]], dtype=torch.int8)
        B = torch.tensor([[1, -1], [-1, -1]], dtype=torch.int8)
        H = torch.kron(C, A) + torch.kron(torch.eye(q + 1, dtype=torch.int8), B)
    return H


def _sylvester(n: int) -> torch.Tensor:
    H = torch.ones(1, 1, dtype=torch.int8)
    while H.shape[0] < n:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H


@functools.lru_cache(maxsize=32)
def _core_matrix(core: tuple[int, ...]) -> torch.Tensor:
    """The ±1 Kronecker product of the Paley matrices of ``core`` (int8; cached: online rotations ask
    for the same one at every call)."""
    H = torch.ones(1, 1, dtype=torch.int8)
    for c in core:
        H = torch.kron(H, _paley_matrix(c))
    return H


@functools.lru_cache(maxsize=64)
def _core_on(core: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """:func:`_core_matrix` in ``dtype`` on ``device`` (cached: no host-to-device copy at every online rotation
    of a model running on a GPU)."""
    return _core_matrix(core).to(dtype=dtype, device=device)


def hadamard(n: int, *, dtype: torch.dtype = torch.float32, device=None, normalized: bool = True) -> torch.Tensor:
    """The Hadamard matrix of order ``n`` that :func:`hadamard_construction` describes: ``H_{2^k} ⊗ H_core``,
    divided by ``sqrt(n)`` (orthogonal) unless ``normalized=False`` (entries ±1)."""
    plan = hadamard_construction(n)
    H = torch.kron(_sylvester(plan.power), _core_matrix(plan.core)).to(dtype=dtype, device=device)
    return H / math.sqrt(n) if normalized else H


def hadamard_transform(x: torch.Tensor, *, normalized: bool = True) -> torch.Tensor:
    """``x @ hadamard(n)`` over the last axis of ``x`` (``n = x.shape[-1]``) in ``O(n (log 2^k + m))``:
    butterflies for the power-of-two factor, one small matmul for the core. Pure torch: works under
    ``torch.func.vmap`` and ``grad``."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise TypeError(f"hadamard_transform: x must be a tensor with at least one axis, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"hadamard_transform: x must be floating point, got {x.dtype}")
    n = x.shape[-1]
    plan = hadamard_construction(n)
    lead, m = x.shape[:-1], n // plan.power
    y = x.reshape(*lead, plan.power, m)
    if m > 1:  # (A ⊗ B) on row vectors: Aᵀ X B with X the (power, m) view; A (Sylvester) is symmetric
        core = (_core_matrix(plan.core).to(dtype=x.dtype, device=x.device) if torch.compiler.is_compiling()
                else _core_on(plan.core, x.dtype, str(x.device)))  # nothing traced kept in the cache
        y = y @ core
    h = 1
    while h < plan.power:  # Sylvester butterflies on the power axis
        y = y.reshape(*lead, plan.power // (2 * h), 2, h, m)
        a, b = y.select(-3, 0), y.select(-3, 1)
        y = torch.stack([a + b, a - b], dim=-3)
        h *= 2
    y = y.reshape(*lead, n)
    return y / math.sqrt(n) if normalized else y

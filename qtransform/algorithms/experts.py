"""Stacked experts weights in the calibrated steps: one matrix per expert, each fitted from its own tokens.

A mixture-of-experts layer's ``"Experts"`` weight ``(experts, out, in)`` (``(experts, in, out)`` for the
plan's ``transposed_experts``) holds one linear layer per expert; the statistics of its site are a tuple
with one entry per expert, folded from the tokens routed to that expert (:mod:`qtransform.spec.stacked` for
the specs). :func:`fit_experts` fits every expert that received at least ``min_tokens`` tokens with a
per-matrix solver (GPTQ) and falls back to a data-free fit (``"rtn"``: round to nearest from the matrix's
range, or ``"hqq"``) for the others, then stacks the results: new weights and stacked quantization
parameters, and a report of every expert's token count and what was done.

>>> import torch, qtransform as qt
>>> w = torch.randn(3, 4, 8)
>>> spec = qt.stacked_spec(qt.QuantSpec(format="int8"), w.shape)
>>> solve = lambda W, H, s, path: (W, qt.choose_qparams(W, s))  # a stand-in solver (round to nearest)
>>> stats = [None, torch.eye(8), torch.eye(8)]
>>> new, qp, info = fit_experts(w, stats, [0, 5, 9], spec, solve, path="e", transposed=False, min_tokens=6)
>>> info["experts"]
{'tokens': [0, 5, 9], 'fitted': [2], 'fallback': {'rtn': [0, 1]}}
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..spec import QuantSpec, matrix_spec, transposed_spec
from ..tensor import QParams, dequantize, quantize, stacked, transposed_qparams
from ..observers import choose_qparams

__all__ = ["fit_experts", "FALLBACKS", "experts_cost"]

#: The data-free fits of an expert with too few calibration tokens.
FALLBACKS = ("rtn", "hqq")


def _fallback(w: torch.Tensor, spec: QuantSpec, how: str, path: str) -> QParams:
    if how == "hqq":
        from . import hqq_math  # noqa: PLC0415 - only the hqq fallback needs it
        return hqq_math.optimize(w, spec, path=path)
    return choose_qparams(w, spec, path=path)


def fit_experts(w: torch.Tensor, hessians: Sequence, tokens: Sequence[int], spec: QuantSpec, solve: Callable, *,
                path: str, transposed: bool, min_tokens: int = 1, fallback: str = "rtn"):
    """Fit each expert of the stacked weight ``w`` (stored shape, stacked ``spec``).

    Args:
        hessians: per expert, what ``solve`` takes (``None`` for an expert without tokens).
        tokens: per expert, the calibration tokens it received.
        solve: ``solve(W, H, spec, path) -> (new W, QParams)`` on one expert's logical ``(out, in)`` matrix.
        transposed: ``w`` is stored ``(experts, in, out)``.
        min_tokens: experts with fewer tokens fall back to ``fallback`` (``"rtn"`` or ``"hqq"``).

    Returns:
        ``(new stacked weight, stacked QParams, info)`` with ``info["experts"]`` = ``{"tokens": [...],
        "fitted": [experts], "fallback": {how: [experts]}}``.
    """
    if fallback not in FALLBACKS:
        raise ValueError(f"{path}: fallback must be one of {list(FALLBACKS)}, got {fallback!r}")
    n = w.shape[0]
    if len(hessians) != n or len(tokens) != n:
        raise ValueError(f"{path}: {n} experts, but statistics for {len(hessians)} and token counts for {len(tokens)}")
    stored = matrix_spec(spec, tuple(w.shape))
    logical = transposed_spec(stored, tuple(w.shape[1:])) if transposed else stored
    qs, fitted, fell = [], [], []
    for e in range(n):
        W = w[e].T if transposed else w[e]
        at = f"{path}[expert {e}]"
        if hessians[e] is not None and int(tokens[e]) >= min_tokens:
            new, qp = solve(W, hessians[e], logical, at)
            fitted.append(e)
        else:
            new, qp = W, _fallback(W, logical, fallback, at)
            fell.append(e)
        if transposed:
            new, qp = new.T, transposed_qparams(qp, stored, path=at)
        qs.append(quantize(new.contiguous(), qp, path=at))
    q = _stack(qs, path)
    info = {"tokens": [int(t) for t in tokens], "fitted": fitted, "fallback": {fallback: fell} if fell else {}}
    return dequantize(q), q.qparams, {"experts": info}


def _stack(qs, path: str):
    """The experts' QTensors stacked; a tensor-wide scale (NVFP4's) must be one for the stack: each expert's
    codes are kept and the scale of the first is used only when all agree (else ``ValueError`` by path)."""
    try:
        return stacked.stack(qs)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def experts_cost(shape: Sequence[int], transposed: bool) -> float:
    """The cost model of fitting stacked experts of stored ``shape``: per expert ``d_in³ + d_out·d_in²``."""
    n, a, b = (int(x) for x in shape)
    out, inn = (b, a) if transposed else (a, b)
    return n * (float(inn) ** 3 + float(out) * float(inn) ** 2)

"""The cheap sensitivity of a layer to a scheme: its output error under its input Hessian.

For a linear ``y = x Wᵀ`` with inputs of second moment ``H = E[x xᵀ]`` (the ``hessian`` observer's
``XᵀX / n``), quantizing ``W`` to ``Ŵ`` changes the output by ``x Eᵀ`` with ``E = W - Ŵ``, whose mean
squared norm is ``tr(E H Eᵀ)``: :func:`output_error`. That error is in the units of each layer's output, so it
ranks candidates within a layer but not across layers: a unit of error in one layer may move the model's
output a thousand times more than in another. Given ``weights = F / 2``, the diagonal of the Fisher
information of the model's next-token distribution with respect to the layer's outputs (per output channel,
averaged over tokens; the bridge measures it, :func:`bridge.search.output_fisher`), the weighted error
``Σ_j weights_j (E H Eᵀ)_jj`` is the second-order estimate of the mean KL divergence per token of the
model's output when that layer alone is quantized (the KL's gradient is 0 at the float model, its Hessian
the Fisher; the layer's inputs and the output gradients taken as independent, the Fisher's off-diagonal
terms left out), in nats: one scale for every layer, as the knapsack's sum needs.
:func:`quantized_weight` gives ``Ŵ`` as an
algorithm would make it: ``rtn`` (min/max round to nearest), ``hqq`` (HQQ's optimizer on the specs it
takes, round to nearest on the others, as the ``hqq`` step does) or ``gptq`` (GPTQ's solver with ``H``,
min/max initial ranges, act-order with static groups, as checkpoints store them).

>>> import torch
>>> w, h = torch.tensor([[1.0, 2.0]]), torch.tensor([[2.0, 0.0], [0.0, 1.0]])
>>> output_error(w, torch.tensor([[0.0, 2.0]]), h)  # E = [1, 0]: 1 * 2 * 1
2.0
>>> output_error(torch.eye(2), torch.zeros(2, 2), h, weights=torch.tensor([0.5, 3.0]))  # 0.5 * 2 + 3 * 1
4.0
"""

from __future__ import annotations

import torch

from ..algorithms import gptq_math, hqq
from ..observers import choose_qparams
from ..spec import QuantSpec
from ..tensor import fake_quantize

__all__ = ["SEARCH_ALGORITHMS", "output_error", "quantized_weight", "rank_correlation"]

#: The algorithms the search quantizes its candidates with (:func:`quantized_weight`'s ``algorithm``), by name
#: of their steps in :data:`qtransform.ALGORITHMS`.
SEARCH_ALGORITHMS = ("rtn", "hqq", "gptq")


def output_error(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor, *,
                 weights: torch.Tensor | None = None) -> float:
    """``tr(E H Eᵀ)`` with ``E = w - w_hat``: the mean squared output error of the layer; with ``weights``,
    ``Σ_j weights_j (E H Eᵀ)_jj``: each output channel's error weighted (``F / 2``: the KL estimate, see the
    module docstring).

    Args:
        w, w_hat: ``(out, in)`` weights.
        h: ``(in, in)`` second moment of the layer's inputs.
        weights: ``(out,)`` nonnegative weights of the output channels, or None (all 1).

    Returns:
        The error as a float (products in float32, summed in float64).
    """
    if w.shape != w_hat.shape or w.dim() != 2 or tuple(h.shape) != (w.shape[1], w.shape[1]):
        raise ValueError(f"output_error: w {tuple(w.shape)} and w_hat {tuple(w_hat.shape)} must be one (out, in) shape "
                         f"and h ({w.shape[-1]}, {w.shape[-1]}), got h {tuple(h.shape)}")
    if weights is not None and tuple(weights.shape) != (w.shape[0],):
        raise ValueError(f"output_error: weights must have shape ({w.shape[0]},) (one per output channel of w "
                         f"{tuple(w.shape)}), got {tuple(weights.shape)}")
    if weights is not None and bool((weights < 0).any()):
        raise ValueError(f"output_error: weights must be nonnegative, got a minimum of {float(weights.min())}")
    e = w.float() - w_hat.float()  # float32 products, a float64 sum: the estimate ranks, 1e-6 is plenty
    rows = ((e @ h.float()) * e).sum(1, dtype=torch.float64)
    return float(rows.sum() if weights is None else (rows * weights.double()).sum())


def quantized_weight(w: torch.Tensor, spec: QuantSpec, *, algorithm: str = "rtn", h: torch.Tensor | None = None,
                     path: str | None = None) -> torch.Tensor:
    """``Ŵ``: ``w`` quantized with ``spec`` by ``algorithm`` and dequantized (``h`` needed by ``gptq``)."""
    if algorithm not in SEARCH_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {list(SEARCH_ALGORITHMS)}, got {algorithm!r}")
    if algorithm == "gptq":
        if h is None:
            raise ValueError("quantized_weight: algorithm 'gptq' needs h, the input Hessian")
        return gptq_math.gptq(w, h.to(w.dtype), spec, act_order=True, static_groups=True,
                              paths=[path]).weight
    if algorithm == "hqq" and hqq.supports(spec):
        qp = hqq.optimize(w, spec)
    else:
        qp = choose_qparams(w, spec, path=path)
    return fake_quantize(w, qp, path=path)  # = dequantize(quantize(w, qp)) bit for bit, without the codes


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks from 1, ties given their mean rank."""
    order = x.argsort(stable=True)
    sorted_x = x[order]
    ranks = torch.empty_like(x)
    ranks[order] = torch.arange(1, x.numel() + 1, dtype=x.dtype)
    uniq, inverse = torch.unique(sorted_x, return_inverse=True)
    mean = torch.zeros(uniq.numel(), dtype=x.dtype).index_add_(0, inverse, ranks[order])
    mean /= torch.bincount(inverse, minlength=uniq.numel()).to(x.dtype)
    out = torch.empty_like(x)
    out[order] = mean[inverse]
    return out


def rank_correlation(a, b) -> float:
    """Spearman's rank correlation of two equal-length sequences (ties: mean ranks).

    >>> rank_correlation([1.0, 2.0, 3.0, 4.0], [10.0, 30.0, 20.0, 40.0])
    0.8
    """
    a, b = torch.as_tensor(a, dtype=torch.float64).flatten(), torch.as_tensor(b, dtype=torch.float64).flatten()
    if a.numel() != b.numel() or a.numel() < 2:
        raise ValueError(f"rank_correlation: two sequences of one length >= 2, got {a.numel()} and {b.numel()}")
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float((ra.square().sum() * rb.square().sum()).sqrt())
    return float((ra * rb).sum()) / den if den > 0 else float("nan")

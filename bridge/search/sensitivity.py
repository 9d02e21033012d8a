"""Sensitivity of each linear layer of a model to each candidate scheme, measured on calibration data.

One calibration pass folds the input Hessian ``H = XᵀX / n`` of every searched linear (one site per group of
linears that read one input: q/k/v share theirs, gate/up theirs), then each layer's weight is quantized with
each candidate by the chosen algorithm and scored by its output error ``tr(E H Eᵀ)``
(:func:`qtransform.search.output_error`). With ``estimate="fisher"`` (the default) each output channel's error
is weighted by half the Fisher diagonal of the model's output with respect to that channel
(:func:`.fisher.fisher_pass`, a backward pass on ``fisher_tokens`` positions): the second-order estimate of the KL
divergence of the model's output, in nats, comparable across layers. ``estimate="hessian"`` is the unweighted
output error (no backward pass; comparable only within a layer). A candidate that cannot take a layer's shape
has no score there (the search leaves it out for that layer).

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(16, 8, bias=False))
>>> s = measure(model, [torch.randn(4, 16)], qt.search.candidates("int8, uint2-g16"), estimate="hessian")
>>> sorted(s.losses["0.weight"]), s.losses["0.weight"]["int8"] < s.losses["0.weight"]["uint2-g16"]
(['int8', 'uint2-g16'], True)
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterable, NamedTuple, Sequence

import torch
from torch import nn

import qtransform as qt
from qtransform import search as qsearch

from ..calibrate import ModelCalibrator
from ..pipeline import plan as model_plan
from .fisher import fisher_pass
from ..tree import extract

__all__ = ["ESTIMATES", "FISHER_TOKENS", "Sensitivity", "searched_layers", "measure"]

#: The estimates :func:`measure` knows: the Fisher-weighted output error (KL, nats) and the plain one.
ESTIMATES = ("fisher", "hessian")

#: The positions :func:`measure` takes the Fisher on by default (its backward passes cost about one forward pass
#: each; the layer totals it gives vary by about 10% between batches of 2048 positions of SmolLM2-135M).
FISHER_TOKENS = 2048

#: What the search quantizes: the weights of these module types (``lm_head`` and embeddings excluded).
SEARCHED = qt.Recipe(type_rules={"Linear": qt.QuantSpec(format="int8"), "Conv1D": qt.QuantSpec(format="int8")},
                     exclude=qt.pipeline.DEFAULT_EXCLUDE)


class Sensitivity(NamedTuple):
    """``layers``: ``{weight path: (out, in)}``; ``losses``: ``{path: {candidate: tr(E H Eᵀ)}}``; ``groups``:
    the lists of paths that read one input (a fused kernel holds them in one format); ``skipped``: ``{path:
    [candidates that do not fit it]}``; ``seconds``: calibration and scoring time; ``hessians``:
    ``{path: H}`` (the same tensor for paths of one group); ``estimate``: which estimate ``losses`` hold;
    ``fisher``: ``{path: F}`` (``(out,)`` Fisher diagonals) with the ``fisher`` estimate, else None."""

    layers: dict[str, tuple[int, int]]
    losses: dict[str, dict[str, float]]
    groups: list[list[str]]
    skipped: dict[str, list[str]]
    seconds: float
    hessians: dict[str, torch.Tensor]
    estimate: str = "hessian"
    fisher: dict[str, torch.Tensor] | None = None


def searched_layers(model: nn.Module) -> tuple[dict[str, tuple[int, int]], list[list[str]]]:
    """``(layers, groups)``: the linear weights a search chooses schemes for, in the logical ``(out, in)`` layout
    (``lm_head`` excluded), and the groups of them that read one input (from the architecture tables)."""
    plan = model_plan(model, SEARCHED)
    tree = extract(model)
    layers = {p: tuple(tree[p].shape) for p in plan.specs}
    if any(len(s) != 2 for s in layers.values()):
        raise ValueError("the search takes 2-D linear weights; "
                         f"{[p for p, s in layers.items() if len(s) != 2][:3]} are not")
    groups = [[p for p in g if p in layers] for g in qsearch.tied_groups(plan.groups)]
    return layers, [g for g in groups if len(g) > 1]


def _statistics(model, batches, layers, groups, estimate, seed, progress, fisher_tokens=None):
    """``(hessians, fisher)``: ``{path: H}`` (one tensor per group) and, for the ``fisher`` estimate, ``{path: F}``
    folded in the same forward passes (a calibration pass alone for ``hessian``)."""
    lead = {}
    for g in groups:
        for p in g:
            lead[p] = g[0]
    leads = [qt.module_of(p) for p in layers if lead.get(p, p) == p]
    if estimate == "fisher":
        fisher, h = fisher_pass(model, batches, list(layers), hessian_modules=leads, seed=seed, progress=progress,
                                fisher_tokens=fisher_tokens)
    else:
        cal = ModelCalibrator(model, batches, progress=progress)
        stats = cal.site_stats(extract(model), {qt.Site(m): qt.init_stats(observer="hessian") for m in leads})
        fisher, h = None, {s.module: qt.finalize_stats(v) for s, v in stats.items()}
    return {p: h[qt.module_of(lead.get(p, p))] for p in layers}, fisher


def _score(p, weight, h, fisher, cands, algorithm, losses, skipped) -> None:
    """``losses[p][candidate]`` for every candidate that fits the weight at ``p``; the others in ``skipped[p]``."""
    w, h = weight.detach().float(), h.float()
    losses[p] = {}
    for c in cands:
        try:
            w_hat = qsearch.quantized_weight(w, c.spec, algorithm=algorithm, h=h, path=p)
        except ValueError:  # the spec does not fit this shape: no score, the search leaves it out here
            skipped.setdefault(p, []).append(c.name)
            continue
        losses[p][c.name] = qsearch.output_error(w, w_hat, h, weights=None if fisher is None else fisher / 2)


@contextlib.contextmanager
def _fast_matmul(enabled: bool):
    """float32 matrix products on the CPU through oneDNN's bf16 emulation of float32 (three bf16 products per
    value) where the CPU has bf16 dot products: about twice as fast, each product within ~2e-6 of float32's; the
    tokens the Fisher draws from the (slightly moved) probabilities change at a few positions, so the estimates
    move within the Fisher's sampling noise (measured on SmolLM2-135M: median 0.2%, at most 10%; 0-11 of 210
    layers chosen otherwise; another seed: median 3.8%, 11-20 layers). Elsewhere, or with torch versions without the setting,
    unchanged."""
    matmul = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    if not enabled or not hasattr(matmul, "fp32_precision"):
        yield
        return
    before = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        matmul.fp32_precision = before


def measure(model: nn.Module, batches: Iterable, cands: Sequence[qsearch.Candidate], *, algorithm: str = "rtn",
            estimate: str = "fisher", fisher_tokens: int | None = FISHER_TOKENS, seed: int = 0,
            exact_matmul: bool = False, progress: Callable | None = None) -> Sensitivity:
    """The output error of every searched layer under every candidate (see the module docstring).

    Args:
        model: the float model (not changed).
        batches: calibration batches (token ids or dicts of model inputs).
        cands: the candidate schemes.
        algorithm: how each candidate quantizes a weight: ``rtn``, ``hqq`` or ``gptq``.
        estimate: ``fisher`` (KL estimate, needs the model's logits) or ``hessian`` (output error).
        fisher_tokens: the positions the Fisher is taken on (batches spread over the calibration,
            :func:`.fisher.fisher_batches`; None: every batch); the Hessians always fold every batch.
        seed: the tokens drawn for the Fisher.
        exact_matmul: keep every float32 product in float32 arithmetic; by default the search, which only ranks,
            lets oneDNN compute them from bf16 pieces where the CPU has bf16 dot products (:func:`_fast_matmul`).
        progress: ``progress(iterable, desc=..., total=...)``, e.g. a tqdm bar.
    """
    if algorithm not in qsearch.SEARCH_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {list(qsearch.SEARCH_ALGORITHMS)}, got {algorithm!r}")
    if estimate not in ESTIMATES:
        raise ValueError(f"estimate must be one of {list(ESTIMATES)}, got {estimate!r}")
    t0 = time.perf_counter()
    layers, groups = searched_layers(model)
    tree = extract(model)
    losses, skipped = {}, {}
    paths = list(layers)
    with _fast_matmul(not exact_matmul):
        hessians, fisher = _statistics(model, batches, layers, groups, estimate, seed, progress, fisher_tokens)
        for p in (progress(paths, desc="sensitivity", total=len(paths)) if progress else paths):
            _score(p, tree[p], hessians[p], None if fisher is None else fisher[p], cands, algorithm, losses, skipped)
    return Sensitivity(layers, losses, groups, skipped, time.perf_counter() - t0, hessians, estimate, fisher)


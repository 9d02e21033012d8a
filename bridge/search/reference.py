"""The reference sensitivity: how much the model's output moves when one layer alone is quantized.

For a pair (layer, candidate), the layer's weight is replaced by its quantized values (the same ``Ŵ`` the
cheap estimate scores), the model runs on held-out tokens, and the mean over tokens of
``KL(p_float || p_quantized)`` of the next-token distributions is the pair's cost; the weight is put back
after. One forward pass per pair: offered on a subset (:func:`spread_pairs`), to rank the cheap estimate
against (:func:`qtransform.search.rank_correlation`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

import torch
from torch import nn

from qtransform import search as qsearch

from ..tree import extract

__all__ = ["Reference", "spread_pairs", "kl_reference"]


class Reference(NamedTuple):
    """``kl``: ``{(path, candidate): mean KL per token}``; ``estimate``: the cheap estimate of the same pairs;
    ``spearman``: their rank correlation; ``tokens``: held-out tokens per pair."""

    kl: dict[tuple[str, str], float]
    estimate: dict[tuple[str, str], float]
    spearman: float
    tokens: int


def spread_pairs(losses: Mapping[str, Mapping[str, float]], count: int) -> list[tuple[str, str]]:
    """``count`` layers spread evenly over the model (first to last), each with every candidate scored there.

    >>> spread_pairs({"a": {"x": 1.0}, "b": {"x": 2.0, "y": 3.0}, "c": {"x": 1.0}}, 2)
    [('a', 'x'), ('c', 'x')]
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"--reference-layers must be a positive int, got {count!r}")
    paths = list(losses)
    n = min(count, len(paths))
    picks = [paths[round(i * (len(paths) - 1) / max(n - 1, 1))] for i in range(n)]
    return [(p, c) for p in dict.fromkeys(picks) for c in losses[p]]


@contextlib.contextmanager
def _replaced(model: nn.Module, path: str, w_hat: torch.Tensor):
    """``model``'s parameter at ``path`` holding ``w_hat`` (transposed for a weight stored ``(in, out)``), put back after."""
    module_path, _, name = path.rpartition(".")
    module = model.get_submodule(module_path)
    param = getattr(module, name)
    value = w_hat if tuple(param.shape) == tuple(w_hat.shape) else w_hat.T
    saved = param.data
    param.data = value.to(dtype=param.dtype, device=param.device).contiguous()
    try:
        yield
    finally:
        param.data = saved


def _logprobs(model, batches) -> list[torch.Tensor]:
    out = []
    for b in batches:
        logits = model(input_ids=b, use_cache=False).logits if isinstance(b, torch.Tensor) else model(**b).logits
        out.append(torch.log_softmax(logits.double(), dim=-1))
    return out


def kl_reference(model: nn.Module, batches: Iterable, cands: Sequence[qsearch.Candidate],
                 pairs: Sequence[tuple[str, str]], estimate: Mapping[str, Mapping[str, float]], *,
                 algorithm: str = "rtn", hessians: Mapping[str, torch.Tensor] | None = None,
                 progress: Callable | None = None) -> Reference:
    """The KL divergence of the model's output for each (layer, candidate) of ``pairs`` quantized alone,
    on the held-out ``batches`` (token-id tensors), and the rank correlation with ``estimate``.

    ``hessians`` are needed by ``algorithm="gptq"`` (the same ``Ŵ`` as the estimate)."""
    by_name = {c.name: c for c in cands}
    batches = list(batches)
    tree = extract(model)
    was = model.training
    model.eval()
    kl = {}
    try:
        with torch.no_grad():
            base = _logprobs(model, batches)
            tokens = sum(int(lp.shape[0] * lp.shape[1]) for lp in base)
            for p, c in (progress(pairs, desc="KL reference", total=len(pairs)) if progress else pairs):
                w = tree[p].detach().float()
                h = None if hessians is None else hessians[p].float()
                w_hat = qsearch.quantized_weight(w, by_name[c].spec, algorithm=algorithm, h=h, path=p)
                with _replaced(model, p, w_hat):
                    q = _logprobs(model, batches)
                total = sum(float((b.exp() * (b - a)).sum()) for b, a in zip(base, q))
                kl[(p, c)] = total / tokens
    finally:
        model.train(was)
    est = {k: float(estimate[k[0]][k[1]]) for k in kl}
    rho = qsearch.rank_correlation(list(est.values()), list(kl.values())) if len(kl) > 1 else float("nan")
    return Reference(kl, est, rho, tokens)

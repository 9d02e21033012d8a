"""How much the model's output distribution moves per unit of change in a layer's output: the diagonal of the
Fisher information of the next-token distribution with respect to each linear layer's outputs.

For each calibration batch the model runs forward, a next token is drawn at every position from the model's own
distribution (seeded; one uniform number per position against the cumulative probabilities), and the summed
log-probability of the drawn tokens is differentiated (the weights are frozen; the gradient, ``onehot - p`` at
the logits, flows back to the embeddings' output). A hook on each layer's output folds the squared
gradient per output channel; the sum over batches divided by the positions is ``F_j``, an unbiased estimate of
``E_x E_{y~p(.|x)} [(d log p(y|x) / d out_j)^2]`` averaged over positions: the diagonal of the Hessian of the KL
divergence ``KL(p_float || p)`` at the float model, which :func:`qtransform.search.output_error` weighs each
layer's output error with (``weights = F / 2``: the estimate in nats, one scale for every layer).

Drawing the token from the model (the *true* Fisher), not reading the next token of the text (the empirical
Fisher), keeps the estimate a property of the model's output distribution, which is what quantization must
preserve. A backward pass costs about one forward pass (no weight gradients), so :func:`fisher_pass` takes the
Fisher on a few batches spread over the calibration (``fisher_tokens`` positions) and runs the others forward
only, without gradients and without the output head, for the Hessians it folds beside.

>>> import torch
>>> from torch import nn
>>> class LM(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.embed, self.mid, self.head = nn.Embedding(10, 4), nn.Linear(4, 3), nn.Linear(3, 10)
...     def get_input_embeddings(self):
...         return self.embed
...     def forward(self, input_ids):
...         return self.head(torch.tanh(self.mid(self.embed(input_ids))))
>>> f = output_fisher(LM(), [torch.tensor([[1, 2, 3]])], ["mid.weight"])
>>> f["mid.weight"].shape, bool((f["mid.weight"] >= 0).all())
(torch.Size([3]), True)
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

import qtransform as qt

from ..arch.embeddings import input_embeddings, output_embeddings
from ..calibrate.sites import run_batch
from ..tree import extract

__all__ = ["output_fisher", "fisher_pass", "fisher_batches"]


class _HeadSkipped(Exception):
    """Raised before the output head of a batch that only folds Hessians: the logits are not needed."""


def _forward_without_head(model: nn.Module, params, batch, head: nn.Module | None) -> None:
    """Run ``batch`` through the model without gradients, stopping before ``head`` (None: run it all)."""
    def stop(module, args):
        raise _HeadSkipped

    handle = head.register_forward_pre_hook(stop) if head is not None else None
    try:
        with torch.no_grad():
            run_batch(model, params, batch)
    except _HeadSkipped:
        pass
    finally:
        if handle is not None:
            handle.remove()


def _logits(model: nn.Module, params, batch) -> torch.Tensor:
    out = run_batch(model, params, batch)
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"the Fisher estimate needs next-token logits; {type(model).__name__} returns "
                         f"{type(out).__name__} without them (use the estimate 'hessian')")
    return logits


@contextlib.contextmanager
def _frozen(model: nn.Module):
    """Parameters without gradients, dropout off; put back after."""
    params = [p for p in model.parameters() if p.requires_grad]
    was = model.training
    for p in params:
        p.requires_grad_(False)
    model.eval()
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)
        model.train(was)


def output_fisher(model: nn.Module, batches: Iterable, paths: Sequence[str], *, seed: int = 0,
                  progress: Callable | None = None) -> dict[str, torch.Tensor]:
    """``{weight path: F}``: per output channel of each layer, the Fisher diagonal (float64 ``(out,)``) averaged over
    the positions of ``batches`` (token-id tensors or dicts of model inputs; positions where an ``attention_mask``
    is 0 left out). See the module docstring.

    Raises:
        ValueError: a path that is not a module's weight, a model without an input embedding or logits.
    """
    return fisher_pass(model, batches, paths, seed=seed, progress=progress)[0]


def _positions(batch) -> int:
    """The positions of a batch the Fisher averages over (an ``attention_mask``'s ones, else every token)."""
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        if mask is not None:
            return int(mask.sum())
        batch = batch.get("input_ids", next(iter(batch.values())))
    return int(batch.numel()) if isinstance(batch, torch.Tensor) else 1


def fisher_batches(batches: Sequence, fisher_tokens: int | None) -> list[int]:
    """The indices of the batches the Fisher is taken on: all of them (``fisher_tokens`` None), else as few as
    reach ``fisher_tokens`` positions at the mean batch's size, spread evenly over the calibration.

    >>> fisher_batches([torch.zeros(4, 512)] * 8, 4096), fisher_batches([torch.zeros(4, 512)] * 8, None)[-1]
    ([0, 4], 7)
    """
    n = len(batches)
    if fisher_tokens is None:
        return list(range(n))
    if isinstance(fisher_tokens, bool) or not isinstance(fisher_tokens, int) or fisher_tokens < 1:
        raise ValueError(f"fisher_tokens must be a positive int or None, got {fisher_tokens!r}")
    mean = max(sum(_positions(b) for b in batches) / max(n, 1), 1.0)
    k = min(n, max(1, math.ceil(fisher_tokens / mean)))
    return sorted({i * n // k for i in range(k)})


def _sequences(batch) -> list:
    """A batch split into its sequences (a backward pass then keeps one sequence's activations at a time)."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else batch
    n = ids.shape[0] if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else 1
    if n == 1:
        return [batch]
    if not isinstance(batch, Mapping):
        return list(batch.split(1))
    return [{k: v[i:i + 1] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n else v
             for k, v in batch.items()} for i in range(n)]


def _draw_gradient(logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``d log p(y) / d logits = onehot(y) - p`` at every position, ``y`` drawn from ``p = softmax(logits)`` by
    inverting its cumulative sum (one uniform number per position)."""
    p = torch.softmax(logits.detach().float().flatten(0, -2), dim=-1)
    cdf = p.cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, generator=gen) * cdf[:, -1:]
    drawn = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[1] - 1)
    del cdf
    return p.neg_().scatter_add_(1, drawn, torch.ones_like(u))


def fisher_pass(model: nn.Module, batches: Iterable, paths: Sequence[str], *, hessian_modules: Sequence[str] = (),
                fisher_tokens: int | None = None, seed: int = 0,
                progress: Callable | None = None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(fisher, hessians)``: :func:`output_fisher`'s ``{weight path: F}`` and, folded in the same forward passes,
    ``{module path: XᵀX / n}`` of the inputs of ``hessian_modules`` (the ``hessian`` observer's, as a calibration
    pass gives it): the search's two statistics in one pass over the data. The Fisher is taken on the batches
    :func:`fisher_batches` picks for ``fisher_tokens`` (forward and backward, one sequence at a time); the others run
    forward only, without gradients, for the Hessians."""
    modules = {}
    for p in paths:
        module_path, _, name = p.rpartition(".")
        try:
            modules[p] = model.get_submodule(module_path)
        except AttributeError:
            raise ValueError(f"output_fisher: {p!r} is not a weight of a module of the model") from None
        if not isinstance(getattr(modules[p], name, None), torch.Tensor):
            raise ValueError(f"output_fisher: {p!r} is not a weight of a module of the model")
    embed = input_embeddings(model)
    if not isinstance(embed, nn.Module):
        raise ValueError(f"output_fisher: {type(model).__name__} has no input embedding to differentiate from "
                         "(use the estimate 'hessian')")
    sums: dict[str, torch.Tensor] = {}

    def fold(p: str):
        def grad_hook(g: torch.Tensor) -> None:
            s = g.detach().float().square().flatten(0, -2).sum(0).double()  # a batch in float32, the sum in float64
            sums[p] = s if p not in sums else sums[p] + s

        def forward_hook(module, args, out):
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(grad_hook)
        return forward_hook

    stats = {m: qt.init_stats(observer="hessian") for m in hessian_modules}

    def observe(name: str):
        def hook(module, args, out):
            stats[name] = qt.observe(stats[name], args[0], path=name)
        return hook

    head = output_embeddings(model)
    if not isinstance(head, nn.Module) or any(model.get_submodule(m) is head for m in hessian_modules):
        head = None  # the head's own input is folded (or there is no head module): run it

    def from_embedding(module, args, out):
        return out.detach().requires_grad_() if torch.is_grad_enabled() else None

    handles = [m.register_forward_hook(fold(p)) for p, m in modules.items()]
    handles += [model.get_submodule(m).register_forward_hook(observe(m)) for m in hessian_modules]
    handles.append(embed.register_forward_hook(from_embedding))
    gen = torch.Generator().manual_seed(seed)
    positions = 0
    batches = list(batches)
    chosen = set(fisher_batches(batches, fisher_tokens))
    params = extract(model)
    try:
        with _frozen(model):
            for i, batch in enumerate(progress(batches, desc="Fisher", total=len(batches)) if progress else batches):
                if i not in chosen:
                    _forward_without_head(model, params, batch, head)
                    continue
                for seq in _sequences(batch):
                    with torch.enable_grad():
                        logits = _logits(model, params, seq)
                    grad = _draw_gradient(logits, gen)
                    mask = seq.get("attention_mask") if isinstance(seq, Mapping) else None
                    if mask is not None:
                        grad.mul_(mask.reshape(-1, 1).to(grad.dtype))
                    positions += _positions(seq)
                    logits.backward(gradient=grad.view(logits.shape).to(logits.dtype))
                    del logits, grad
    finally:
        for h in handles:
            h.remove()
    missing = [p for p in paths if p not in sums]
    if missing:
        raise ValueError(f"output_fisher: no gradient reached {missing[:3]} (not on the path to the logits)")
    return {p: sums[p] / max(positions, 1) for p in paths}, {m: qt.finalize_stats(v) for m, v in stats.items()}

"""Evaluating causal language models: perplexity on token sequences, and greedy generation.

>>> import torch
>>> from transformers import LlamaConfig, LlamaForCausalLM
>>> from bridge.app import evaluate
>>> torch.manual_seed(0) and None
>>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
...                   num_attention_heads=2, num_key_value_heads=2)
>>> model = LlamaForCausalLM(cfg).eval()
>>> r = evaluate.perplexity(model, torch.randint(0, 64, (3, 16)), batch_size=2)
>>> r.tokens, 40 < r.perplexity < 90  # an untrained model: about the vocabulary size
(45, True)
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["Perplexity", "perplexity", "generate"]


class Perplexity(NamedTuple):
    """``perplexity = exp(nll)``; ``nll`` is the mean negative log-likelihood (nats) over ``tokens``
    predicted tokens (every token of a sequence but the first)."""

    perplexity: float
    nll: float
    tokens: int


@contextlib.contextmanager
def _eval_mode(model):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def perplexity(model, sequences: torch.Tensor, *, batch_size: int = 4, progress: bool = False,
               parallel=None) -> Perplexity:
    """Perplexity of a causal LM on token ``sequences`` (int64 ``(n, seq_len)``).

    Each sequence is scored on its own (no context carried across), in batches of
    ``batch_size``, without gradients and in eval mode (the model's mode is restored).
    ``progress`` shows a tqdm bar.

    ``parallel`` (a :class:`qtransform.Parallel`, e.g. :func:`bridge.distributed.current`; default one
    process) shares the batches among its ranks, each holding the same model and sequences: each rank
    scores a contiguous share, the per-batch sums are gathered and added in batch order, so every rank
    returns exactly the one-process value (the same batches, the same additions in the same order). Every
    rank must call it.
    """
    if not isinstance(sequences, torch.Tensor) or sequences.dim() != 2 or sequences.dtype != torch.int64:
        got = (f"{sequences.dtype} tensor of shape {tuple(sequences.shape)}"
               if isinstance(sequences, torch.Tensor) else type(sequences).__name__)
        raise ValueError(f"sequences must be an int64 tensor of shape (n, seq_len), got {got}")
    if sequences.shape[0] == 0 or sequences.shape[1] < 2:
        raise ValueError(f"sequences must hold at least one sequence of 2+ tokens, got shape "
                         f"{tuple(sequences.shape)}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    batches = list(torch.split(sequences, batch_size))
    world, rank = (1, 0) if parallel is None else (parallel.world, parallel.rank)
    if world > 1:
        from ..distributed import share_bounds

        n = len(batches)
        bounds = share_bounds([b.numel() for b in batches], world) if n >= world else [*range(n + 1)] + [n] * (world - n)
        mine = batches[bounds[rank]:bounds[rank + 1]]
    else:
        mine = batches
    if progress:
        from tqdm.auto import tqdm

        mine = tqdm(mine, desc="perplexity", unit="batch")
    device = _device(model)
    sums = []
    with torch.no_grad(), _eval_mode(model):
        for ids in mine:
            ids = ids.to(device)
            logits = model(input_ids=ids).logits[:, :-1].float()
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                  reduction="sum")
            sums.append(float(nll))
    if world > 1:
        sums = [v for part in parallel.gather(sums) for v in part]
    total = 0.0
    for v in sums:  # in batch order, as one process adds them
        total += v
    count = sequences[:, 1:].numel()
    mean = total / count
    return Perplexity(perplexity=math.exp(mean), nll=mean, tokens=count)


def generate(model, tokenizer, prompt: str, *, max_new_tokens: int = 32, chat: bool = False) -> str:
    """Greedy continuation of ``prompt`` (the new text only).

    With ``chat=True`` the prompt goes through the tokenizer's chat template as a user turn
    (instruction-tuned models answer better that way).
    """
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("prompt must be a non-empty string")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    ids = ids.to(_device(model))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad(), _eval_mode(model):
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=pad)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

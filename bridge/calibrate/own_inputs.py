"""The inputs each block receives in the model's own forward, not the first block's handed to all.

Layers of one model often take different keyword inputs: a sliding-window mask on some layers and a full
causal one on others (Gemma-3, Mistral-style hybrids), rotary tables per layer kind, a padding mask or none
on linear-attention and state-space layers beside attention layers (Qwen3-Next, Qwen3.5, Nemotron-H, Bamba,
LFM2), position biases only the first block computes (T5), per-layer inputs (Gemma-3n). Block-by-block
calibration carries the hidden states from block to block itself (the quantized blocks' outputs), so what it
needs from the model's forward is each block's *other* inputs, batch by batch: :func:`capture_blocks`.

It runs the model's forward once per batch with the first block real and every block after it but the last
replaced by a pass-through that gives its hidden states back unchanged, in the first block's output form (the
rest of that output passed on: a position bias the first block computes for the others), recording each block's
inputs, and stops at the last block: the cost of the embeddings and one block. Whether the pass-throughs stand in
faithfully is checked: the hidden states must reach each block unchanged, and where all the blocks' weights are
at hand (``real=True``, in memory) the first batch also runs through the real blocks and the recorded inputs must
be the same; where they are not, every batch runs through the real blocks. Where the pass-throughs do not carry
the hidden states and the blocks cannot run (a streamed run's later blocks are not loaded yet),
:class:`Unfaithful` names the model. No cache object is kept (:func:`without_cache`).
"""

from __future__ import annotations

import contextlib
from typing import Mapping

import torch
from torch import nn

from .sites import run_batch

__all__ = ["capture_blocks", "capture_inputs", "strip_hidden", "Unfaithful", "same_inputs", "hidden_slot", "hidden_of", "without_cache"]


class _Captured(Exception):
    pass


def _is_cache(value) -> bool:
    """A key/value (or state-space) cache object of transformers: it grows each time a block runs with it."""
    return callable(getattr(value, "update", None)) and callable(getattr(value, "get_seq_length", None))


def without_cache(kwargs: Mapping) -> dict:
    """A block's keyword inputs with no cache carried from one run to the next: every cache object replaced by
    ``None`` and ``use_cache`` turned off. A model whose forward does not name ``use_cache`` (so that
    :func:`~bridge.calibrate.sites.run_batch` cannot turn it off) makes a cache that its blocks would otherwise
    grow on every calibration pass, each pass attending to the keys of the passes before."""
    out = {k: None if _is_cache(v) else v for k, v in kwargs.items()}
    if isinstance(out.get("use_cache"), bool):
        out["use_cache"] = False
    return out


def hidden_slot(args, kwargs: Mapping) -> int | str | None:
    """Where a block's inputs hold its hidden states, the one rule of both drivers: ``0`` (the first positional
    input, when it is a tensor), else transformers' ``hidden_states`` keyword, else the first tensor keyword;
    ``None`` when no input is a tensor."""
    if args and isinstance(args[0], torch.Tensor):
        return 0
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return "hidden_states"
    return next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)


def hidden_of(args, kwargs: Mapping, slot: int | str | None = ...) -> torch.Tensor | None:
    """The hidden states in a block's inputs (at ``slot``, else at :func:`hidden_slot`'s)."""
    slot = hidden_slot(args, kwargs) if slot is ... else slot
    return None if slot is None else args[0] if slot == 0 else kwargs[slot]


def capture_inputs(model: nn.Module, params: Mapping, block: str, batches) -> list:
    """``(args, kwargs)`` of module ``block`` for every batch (the forward stops at the block), without any
    cache (:func:`without_cache`)."""
    return [(a, k) for (_, a, k), in capture_blocks(model, params, (block,), batches, real=False)]


class Unfaithful(ValueError):
    """The blocks' own inputs cannot be recorded without running the blocks, which are not at hand."""


class _Moved(Exception):
    """A pass-through's hidden states did not reach the next block unchanged."""


def strip_hidden(args, kwargs: Mapping, slot):
    """A block's inputs without its hidden states (the runner puts the carried ones there)."""
    return (slot, (None, *args[1:]) if slot == 0 else tuple(args),
            dict(kwargs) if slot == 0 else {**kwargs, slot: None})


def _like(output, h):
    """``output`` (a block's) with its first tensor, the hidden states, replaced by ``h``."""
    if isinstance(output, torch.Tensor):
        return h
    if isinstance(output, (tuple, list)) and output:
        i = next((j for j, x in enumerate(output) if isinstance(x, torch.Tensor)), None)
        if i is not None:
            return type(output)(h if j == i else x for j, x in enumerate(output))
    raise _Moved


def _record(model: nn.Module, params: Mapping, names: tuple, batches, through: bool) -> list:
    """``[[(slot, args, kwargs) per block] per batch]``, the forward stopped at the last block. ``through``: the
    first block runs, the blocks between it and the last pass their hidden states through in the first block's
    output form (the rest of its output passed on as it is: a bias it computes for the later blocks); else every
    block runs."""
    blocks = [model.get_submodule(n) for n in names]
    out: list = []
    state: dict = {}

    def pre(i):
        def hook(m, args, kwargs):
            if any(_is_cache(a) for a in args):
                raise ValueError(f"calibration: block {names[i]!r} takes a cache object positionally; pass "
                                 "use_cache=False in the calibration batches (dicts of model inputs)")
            slot = hidden_slot(args, kwargs)
            h = hidden_of(args, kwargs, slot)
            if i == 0:
                out[-1].append((slot, tuple(args), without_cache(kwargs)))
            else:
                if through and i > 1 and h is not state["h"]:
                    raise _Moved
                state["h"] = h
                out[-1].append(strip_hidden(args, without_cache(kwargs), slot))
            if i == len(blocks) - 1:
                raise _Captured
        return hook

    def passing(*args, **kwargs):
        return _like(state["first"], hidden_of(args, kwargs))

    handles = [b.register_forward_pre_hook(pre(i), with_kwargs=True) for i, b in enumerate(blocks)]
    saved = []
    if through and len(blocks) > 2:
        handles.append(blocks[0].register_forward_hook(lambda m, a, o: state.__setitem__("first", o)))
        for b in blocks[1:-1]:
            saved.append((b, b.__dict__.get("forward")))
            b.forward = passing
    try:
        with torch.no_grad():
            for batch in batches:
                out.append([])
                with contextlib.suppress(_Captured):
                    run_batch(model, params, batch)
                if len(out[-1]) != len(blocks):
                    if through:
                        raise _Moved
                    raise ValueError(f"calibration: a batch's forward of {type(model).__name__} did not reach block "
                                     f"{names[len(out[-1])]!r}")
    finally:
        for h in handles:
            h.remove()
        for b, f in saved:
            if f is None:
                del b.forward
            else:
                b.forward = f
    return out


def same_inputs(a, b) -> bool:
    """Whether two recorded inputs are alike: tensors equal in shape, dtype and values; containers alike item by
    item; anything else the same object or equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and (a.device.type == "meta" or torch.equal(a, b)))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_inputs(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_inputs(x, y) for x, y in zip(a, b))
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # an object without a plain equality: not provably the same
        return False


def capture_blocks(model: nn.Module, params: Mapping, names: tuple, batches, *, real: bool) -> list:
    """Every block's own inputs in the model's forward (see the module docstring): ``[[(slot, args, kwargs) per
    block] per batch]``; the first block's hold its hidden states, the others' hold ``None`` in their ``slot``.
    ``params`` hold the first block's weights (it runs). ``real``: all the blocks' weights are in ``params``
    (the first batch checks the pass-throughs against them, and they run where those do not stand in); else
    :class:`Unfaithful` where the pass-throughs do not carry the hidden states from block to block."""
    batches = list(batches)
    if not batches:
        raise ValueError("calibration: no batches (the calibration data is empty or already consumed)")
    if len(names) <= 2:  # the first block runs, the forward stops at the second: nothing passes through
        return _record(model, params, names, batches, False)
    truth = _record(model, params, names, batches[:1], False) if real else None
    try:
        got = _record(model, params, names, batches, True)
    except (_Moved, TypeError, IndexError, AttributeError, ValueError) as e:
        if not isinstance(e, _Moved) and "cache object" in str(e):
            raise
        got = None
    if got is not None and (truth is None or all(same_inputs(x[1:], y[1:]) for x, y in zip(truth[0], got[0]))):
        return got
    if real:
        return truth + _record(model, params, names, batches[1:], False)
    raise Unfaithful(f"{type(model).__name__}: its blocks do not pass their hidden states from one to the next "
                     "unchanged in their output's first tensor, so the inputs of the blocks after the first cannot be "
                     "recorded before they are loaded; quantize it in memory")

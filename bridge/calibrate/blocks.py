"""Block-by-block calibration: the inputs of a model's repeated blocks, one block at a time.

The blocks are the children of the ``nn.ModuleList`` holding the most parameters, or of the one named
by ``blocks=`` (a decoder's layers: ``model.layers`` of Llama, Mistral, Qwen2, Phi-3; ``model.decoder.layers`` of
OPT; ``transformer.h`` of GPT-2; ``encoder.layer`` of BERT). The first block's inputs are captured
once per calibration batch (the forward stops there); then for each block in order the step fits
it (:class:`qtransform.Block` gives its inputs, a ``run`` and ``site_stats`` over them), the block
is quantized with what was fitted (round to nearest where nothing was) and run on its inputs to
give the next block's. Peak memory: the model, plus one block's inputs and outputs per batch.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Mapping

import torch
from torch import nn

import qtransform as qt

from ..distributed import share
from .experts import expert_sites
from .sites import first_tensor, fold_sites, run_batch

__all__ = ["find_blocks", "capture_inputs", "spread", "my_share", "blockwise", "fit_block_on", "batch_tokens",
           "hidden_slot", "hidden_of", "with_hidden", "without_cache"]


def find_blocks(model: nn.Module, blocks: str | None = None) -> tuple[str, ...]:
    """Module paths of the model's blocks: the children of the ``nn.ModuleList`` at path ``blocks``,
    by default the one holding the most parameters (a decoder's layers, whatever their classes; the
    experts inside a layer hold fewer). ``ValueError`` naming the model when there is none."""
    if blocks is not None:
        if not isinstance(blocks, str):
            raise TypeError(f"blocks must be the module path of an nn.ModuleList, got {type(blocks).__name__}")
        try:
            found = model.get_submodule(blocks)
        except AttributeError:
            found = None
        if not isinstance(found, nn.ModuleList) or not len(found):
            lists = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
            raise ValueError(f"blocks={blocks!r} is not a non-empty nn.ModuleList of {type(model).__name__}; "
                             f"its module lists: {lists[:8]}")
        best = (blocks, found)
    else:
        best, size = None, -1
        for name, m in model.named_modules():
            if isinstance(m, nn.ModuleList) and len(m):
                n = sum(p.numel() for p in m.parameters())
                if n > size:
                    best, size = (name, m), n
    if best is None:
        raise ValueError(f"block-by-block calibration: {type(model).__name__} has no repeated blocks (an "
                         "nn.ModuleList, such as a decoder's layers)")
    name, found = best
    return tuple(f"{name}.{i}" if name else str(i) for i in range(len(found)))


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


def capture_inputs(model: nn.Module, params: Mapping, block: str, batches) -> list:
    """``(args, kwargs)`` of module ``block`` for every batch (the forward stops at the block), without any
    cache (:func:`without_cache`)."""
    inputs = []

    def stop(m, args, kwargs):
        if any(_is_cache(a) for a in args):
            raise ValueError(f"calibration: block {block!r} takes a cache object positionally; pass use_cache=False "
                             "in the calibration batches (dicts of model inputs)")
        inputs.append((args, without_cache(kwargs)))
        raise _Captured

    handle = model.get_submodule(block).register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with torch.no_grad():
            for batch in batches:
                with contextlib.suppress(_Captured):
                    run_batch(model, params, batch)
    finally:
        handle.remove()
    if not inputs:
        raise ValueError("calibration: no batches (the calibration data is empty or already consumed)")
    return inputs


def spread(inputs: list, tokens: int | None) -> list:
    """Whole batches of ``inputs``, evenly spread over them, until ``tokens`` tokens (all for ``None``)."""
    if tokens is None:
        return inputs
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"blockwise: tokens must be an int >= 1 or None, got {tokens!r}")
    sizes = [batch_tokens(a, k) for a, k in inputs]
    if sum(sizes) <= tokens:
        return inputs
    k = min(len(inputs), max(1, math.ceil(tokens * len(sizes) / sum(sizes))))  # batches of the mean size
    picks = sorted({round(i * (len(inputs) - 1) / (k - 1)) for i in range(k)}) if k > 1 else [0]
    return [inputs[i] for i in picks]


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


def with_hidden(args, kwargs: Mapping, h, slot: int | str | None, block: str):
    """A block's inputs with ``h`` in the hidden states' ``slot`` (its output passed on to the next block)."""
    if slot is None or h is None:
        raise ValueError(f"block-by-block calibration: block {block!r} takes no tensor input or gives no tensor "
                         "output to pass on to the next block")
    return ((h, *args[1:]), kwargs) if slot == 0 else (args, {**kwargs, slot: h})


def batch_tokens(args, kwargs: Mapping) -> int:
    """Tokens in one batch of a block's inputs: rows (all dimensions but the last) of its hidden states."""
    h = hidden_of(args, kwargs)
    return 0 if not isinstance(h, torch.Tensor) or h.dim() == 0 else h.numel() // max(h.shape[-1], 1)


def _local(params: Mapping, prefix: str) -> dict:
    n = len(prefix) + 1
    return {p[n:]: t for p, t in params.items() if p.startswith(prefix + ".")}


def _quantized(params: dict, paths, plan: qt.Plan, qparams: Mapping) -> dict:
    """The block's tensors as quantized (dequantized back): the next block sees the quantized model."""
    out = dict(params)
    for p in paths:
        spec = plan.specs.get(p)
        if spec is not None:
            qp = qparams[p] if p in qparams else qt.choose_qparams(params[p], spec, path=p)
            out[p] = qt.dequantize(qt.quantize(params[p], qp, path=p))
    return out


def _capture(model: nn.Module, block: str, modules, sites, run_all,
             parallel: qt.Parallel = qt.SERIAL, all_experts: bool = False) -> tuple[dict, dict]:
    """Run ``run_all()`` once with pre-hooks recording the inputs of ``modules`` (paths inside ``block``; the
    arguments the module is called with, before any online rotation of its input) and folding ``sites``; returns ``({module: [(args, kwargs) per batch]}, {Site: statistics})``."""
    names = dict(model.named_modules())
    bad = [m for m in modules if not isinstance(m, str) or m not in names or not m.startswith(block + ".")]
    if bad:
        raise ValueError(f"block {block}: capture: {bad[0]!r} is not a module inside the block")
    seen: dict = {m: [] for m in modules}
    handles = [names[m].register_forward_pre_hook(lambda mod, a, k, m=m: seen[m].append((a, dict(k))),
                                                  with_kwargs=True, prepend=True) for m in modules]
    try:
        stats = fold_sites(model, sites, run_all, where=f"block {block}", parallel=parallel, all_experts=all_experts)
    finally:
        for h in handles:
            h.remove()
    return seen, stats


class _Folded(Exception):
    """A statistics pass reached its last site: the rest of the block folds nothing."""


def _until_sites(model: nn.Module, sites, run_some: Callable, batches: list) -> int:
    """``run_some([batch])`` for each batch while the hooks of :func:`.sites.fold_sites` fold ``sites``; returns
    the batch count. When the sites are module inputs and the first batch calls each site module once, the
    later batches stop right after the last of them (its input folded: the hooks registered here run after
    fold_sites' ones), provided they called the same site modules in the same order until then (the rest of
    the block, say an MLP's down projection and residual, would fold nothing). The statistics are those of
    full passes, bit for bit."""
    names = dict(model.named_modules())
    mods = {s.module for s in sites}
    if (len(batches) < 2 or not mods or any(s.role != "input" for s in sites) or any(m not in names for m in mods)
            or expert_sites(model, sites)):
        run_some(batches)
        return len(batches)
    first, order, last = None, [], []

    def called(m):
        order.append(m)
        if last and m == last[0] and order == first:
            raise _Folded

    handles = [names[m].register_forward_pre_hook(lambda mod, args, m=m: called(m)) for m in sorted(mods)]
    try:
        for batch in batches:
            order.clear()
            with contextlib.suppress(_Folded):
                run_some([batch])
            if first is None:
                first = list(order)
                if sorted(first) == sorted(mods):  # each site module once: stop at the last from now on
                    last.append(first[-1])
    finally:
        for h in handles:
            h.remove()
    return len(batches)


def blockwise(model: nn.Module, params: Mapping, plan: qt.Plan, batches, fit_block: Callable, *,
              qparams: Mapping | None = None, blocks: str | None = None, progress: Callable | None = None,
              tokens: int | None = None, parallel: qt.Parallel = qt.SERIAL, all_experts: bool = False,
              float_inputs: bool = False) -> qt.Fit:
    """Run ``fit_block(block, params) -> Fit`` block by block (see the module docstring); returns the
    blocks' fits combined.

    ``qparams``: parameters fitted before this step (or given by the caller); a block is quantized
    with them where this step fits none (and the tensor is unchanged), else round to nearest.
    ``blocks``: module path of the blocks' ``nn.ModuleList`` (default: see :func:`find_blocks`).
    ``tokens``: only whole batches evenly spread over the data until that many tokens are run
    (:func:`spread`; ``None``: all). ``parallel``: the ranks sharing the work; each keeps its share of the
    spread batches (:func:`bridge.distributed.share`) and the blocks' statistics reduce over all.
    ``all_experts``: the statistics of every expert see every token (:func:`.sites.fold_sites`).
    ``float_inputs``: also carry the float model's block inputs from block to block (:attr:`qtransform.Block.float_inputs`;
    the first block's are its quantized-chain inputs: nothing before it is quantized).
    """
    names = find_blocks(model, blocks)
    current = dict(params)
    prior = dict(qparams or {})
    inputs = my_share(spread(capture_inputs(model, current, names[0], batches), tokens), parallel)
    floats = list(inputs) if float_inputs else None
    total = qt.Fit()
    order = progress(names, desc="blocks", total=len(names)) if progress is not None else names
    for name in order:
        fit, inputs, floats = fit_block_on(model, name, current, inputs, plan, fit_block, prior, total.qparams,
                                           parallel=parallel, all_experts=all_experts, float_inputs=floats)
        current.update(fit.params)
        total = total.then(fit)
        for p in fit.params:  # what was fitted before described the old tensor
            prior.pop(p, None)
    return total


def my_share(inputs: list, parallel: qt.Parallel, *, items: list | None = None) -> list:
    """This rank's contiguous share of a block's ``inputs`` (or of ``items``, one per input: their indices in a
    streamed run), balanced by the inputs' tokens; all of them for one process. The one rule of both drivers."""
    items = inputs if items is None else items
    if parallel.world == 1:
        return items
    return share(items, [batch_tokens(a, k) for a, k in inputs], parallel.world, parallel.rank)


def fit_block_on(model: nn.Module, name: str, current: Mapping, inputs: list, plan: qt.Plan, fit_block: Callable,
                 prior: Mapping, fitted: Mapping | None = None, *, parallel: qt.Parallel = qt.SERIAL,
                 all_experts: bool = False, float_inputs: list | None = None) -> tuple[qt.Fit, list, list | None]:
    """One block of :func:`blockwise`: ``fit_block`` on block ``name`` of ``model`` with its ``inputs`` and the
    tree ``current``; returns the fit, the next block's inputs (this block's outputs with its tensors
    quantized: the fit's qparams, else ``fitted`` ones of earlier blocks' steps, else ``prior`` ones for
    tensors the fit left unchanged, else round to nearest) and, when ``float_inputs`` (the float model's
    inputs of this block, batch for batch) are given, the next block's float inputs (this block's outputs on
    them with its tensors as ``current`` holds them), else ``None``. The streamed runs call it block by block.
    ``parallel``: ``inputs`` are this rank's share; the block's statistics reduce over the ranks (to the
    owners a step names, ``site_stats(..., owners=)``), its token count is the ranks' total.

    The block's ``run``, ``call`` and ``capture`` are differentiable functions of the tensors they are given
    (a learned step takes ``torch.func.grad`` through them); this runner's own passes run without gradients."""
    module = model.get_submodule(name)
    paths = tuple(p for p in current if p.startswith(name + "."))
    state = dict(current)
    if float_inputs is not None and len(float_inputs) != len(inputs):
        raise ValueError(f"block {name}: {len(float_inputs)} batches of float inputs for {len(inputs)} batches of inputs")

    def run(tensors, batches=None):
        local = _local({**state, **tensors}, name)
        return [torch.func.functional_call(module, local, args, kwargs) for args, kwargs in
                (inputs if batches is None else batches)]

    def quiet(tensors, batches=None):
        with torch.no_grad():
            return run(tensors, batches)

    def site_stats(tensors, sites, owners=None):
        return fold_sites(model, sites, lambda: _until_sites(model, sites, lambda b: quiet(tensors, b), inputs),
                          where=f"block {name}", parallel=parallel, owners=owners, all_experts=all_experts)

    def capture(tensors, modules, sites=None, *, inputs=None):
        return _capture(model, name, tuple(modules), dict(sites or {}), lambda: quiet(tensors, inputs), parallel,
                        all_experts)

    def call(path, tensors, args, kwargs):
        if path != name and not path.startswith(name + "."):
            raise ValueError(f"block {name}: call: {path!r} is not inside the block")
        return torch.func.functional_call(model.get_submodule(path), _local({**state, **tensors}, path), args, kwargs)

    memo: list = []

    def float_outputs():  # the float chain's outputs, run once: a step's targets and the next block's float inputs
        if not memo:
            memo.append([first_tensor(o) for o in quiet({}, float_inputs)])
        return memo[0]

    tokens = sum(batch_tokens(a, k) for a, k in inputs)
    if parallel.world > 1:
        tokens = int(parallel.all_sum(torch.tensor(tokens, dtype=torch.int64)))
    block = qt.Block(name=name, paths=paths, inputs=tuple(inputs), run=lambda tensors: run(tensors),
                     site_stats=site_stats, capture=capture, call=call, tokens=tokens, parallel=parallel,
                     float_inputs=None if float_inputs is None else tuple(float_inputs),
                     float_outputs=None if float_inputs is None else float_outputs)
    fit = fit_block(block, state)
    floats = None
    if float_inputs is not None:  # the float chain: this block as the earlier steps left it, before this fit
        floats = [with_hidden(a, k, o, hidden_slot(a, k), name) for (a, k), o in zip(float_inputs, float_outputs())]
        memo.clear()
    state.update(fit.params)
    prior = {p: q for p, q in prior.items() if p not in fit.params}  # what was fitted before described the old tensor
    quantized = _quantized(state, paths, plan, {**prior, **(fitted or {}), **fit.qparams})
    outputs = quiet({p: quantized[p] for p in paths})
    nxt = [with_hidden(args, kwargs, first_tensor(out), hidden_slot(args, kwargs), name)
           for (args, kwargs), out in zip(inputs, outputs)]
    return fit, nxt, floats

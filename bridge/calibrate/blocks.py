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

from ..arch.embeddings import model_part
from ..arch.towers import encoder_decoder, towers
from ..distributed import share
from .experts import expert_sites
from .loss import quantizing_activations
from .own_inputs import capture_blocks, capture_inputs, hidden_of, hidden_slot, without_cache
from .sites import first_tensor, fold_sites

__all__ = ["find_blocks", "find_stacks", "capture_inputs", "capture_blocks", "spread", "my_share", "chosen", "blockwise", "fit_block_on",
           "batch_tokens", "hidden_slot", "hidden_of", "with_hidden", "without_cache"]


def find_blocks(model: nn.Module, blocks: str | None = None) -> tuple[str, ...]:
    """Module paths of the model's blocks: the children of the ``nn.ModuleList`` at path ``blocks``,
    by default the one holding the most parameters (a decoder's layers, whatever their classes; the
    experts inside a layer hold fewer), outside a multimodal model's towers (:func:`bridge.arch.towers`), not a list
    of bare torch layers (a convolutional subsampler's). ``ValueError`` naming the model when there is none."""
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
        best = _largest_list(model)
    if best is None:
        raise ValueError(f"block-by-block calibration: {type(model).__name__} has no repeated blocks (an "
                         "nn.ModuleList, such as a decoder's layers)")
    name, found = best
    return tuple(f"{name}.{i}" if name else str(i) for i in range(len(found)))


def _lists(model: nn.Module, under: str = "", outside: str | None = None) -> list:
    """``[(path, list, parameters)]`` of the non-empty module lists below ``under`` (not below ``outside``),
    outside the towers, not of bare torch layers: the candidates for blocks."""
    skip = towers(model) + ((outside,) if outside else ())  # a multimodal model's blocks are its language model's
    return [(n, m, sum(p.numel() for p in m.parameters())) for n, m in model.named_modules()
            if isinstance(m, nn.ModuleList) and len(m) and (not under or n.startswith(under + "."))
            and not any(n == t or n.startswith(t + ".") for t in skip) and not all(_leaf(b) for b in m)]


def _largest_list(model: nn.Module):
    """``(path, list)`` of the candidate holding the most parameters (the first of equals); ``None`` if none."""
    found = _lists(model)
    return max(found, key=lambda t: t[2])[:2] if found else None


def find_stacks(model: nn.Module, blocks: str | None = None) -> tuple[tuple[str, ...], ...]:
    """The model's stacks of blocks in the order its forward runs them: an encoder-decoder model's two, the
    encoder's blocks (below ``get_encoder()``) then the decoder's (below ``get_decoder()``, outside the encoder:
    the decoder's cross-attention reads the encoder's output); any other model's one (:func:`find_blocks`)."""
    config = getattr(model, "config", None)
    if blocks is not None or config is None or not encoder_decoder(config):
        return (find_blocks(model, blocks),)
    paths = {id(m): n for n, m in model.named_modules()}
    enc, dec = (paths.get(id(model_part(model, k))) for k in ("get_encoder", "get_decoder"))
    if not enc or dec is None or enc == dec or dec.startswith(enc + "."):  # the encoder may lie inside the decoder
        return (find_blocks(model),)
    found = (_lists(model, enc), _lists(model, dec, outside=enc))
    if not all(found):
        return (find_blocks(model),)
    # each stack's own layers: its shallowest list of blocks holding linear layers (a speech encoder's convolutional
    # feature extractor holds none; a prenet's convolutions or a vision tower lie deeper)
    found = [[t for t in f if all(_has_linear(b) for b in t[1])] or f for f in found]
    picked = [min(f, key=lambda t: (t[0].count("."), -t[2]))[:2] for f in found]
    return tuple(tuple(f"{n}.{i}" for i in range(len(m))) for n, m in picked)


def _has_linear(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Linear) for m in module.modules())


def _leaf(module: nn.Module) -> bool:
    """A torch layer without children (a convolution of a subsampler, a per-layer projection): no block."""
    return not any(True for _ in module.children())


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
    current = dict(params)
    prior = dict(qparams or {})
    total = qt.Fit()
    stacks = find_stacks(model, blocks)
    if len(stacks) > 1:  # each stack captures its own inputs: the batches are read once per stack
        batches = list(batches)
    every = [n for names in stacks for n in names]
    order = iter(progress(every, desc="blocks", total=len(every)) if progress is not None else every)
    for names in stacks:  # an encoder-decoder's encoder first: the decoder's inputs come from the quantized encoder
        own = capture_blocks(model, current, names, batches, real=True)  # each block's own inputs, batch by batch
        picks = chosen([(a, k) for (_, a, k), *_ in own], tokens, parallel)
        inputs = [own[j][0][1:] for j in picks]
        floats = None
        if float_inputs:  # the float model's inputs of the stack's first block (the first stack's: its own)
            first = own if names is stacks[0] else capture_blocks(model, params, names[:1], batches, real=True)
            floats = [first[j][0][1:] for j in picks]
        for i, name in enumerate(names):
            next(order)
            following = [own[j][i + 1] for j in picks] if i + 1 < len(names) else None
            fit, inputs, floats = fit_block_on(model, name, current, inputs, plan, fit_block, prior, total.qparams,
                                               parallel=parallel, all_experts=all_experts, float_inputs=floats,
                                               following=following)
            current.update(fit.params)
            total = total.then(fit)
            for p in fit.params:  # what was fitted before described the old tensor
                prior.pop(p, None)
    return total


def chosen(inputs: list, tokens: int | None, parallel: qt.Parallel) -> list[int]:
    """Indices of the batches of ``inputs`` (a block's ``(args, kwargs)`` per batch) that this rank runs: whole
    batches spread over the data until ``tokens`` (:func:`spread`), then this rank's share (:func:`my_share`).
    The one choice of both drivers."""
    picked = {id(x) for x in spread(inputs, tokens)}
    js = [j for j, x in enumerate(inputs) if id(x) in picked]
    return my_share([inputs[j] for j in js], parallel, items=js)


def my_share(inputs: list, parallel: qt.Parallel, *, items: list | None = None) -> list:
    """This rank's contiguous share of a block's ``inputs`` (or of ``items``, one per input: their indices in a
    streamed run), balanced by the inputs' tokens; all of them for one process. The one rule of both drivers."""
    items = inputs if items is None else items
    if parallel.world == 1:
        return items
    return share(items, [batch_tokens(a, k) for a, k in inputs], parallel.world, parallel.rank)


def fit_block_on(model: nn.Module, name: str, current: Mapping, inputs: list, plan: qt.Plan, fit_block: Callable,
                 prior: Mapping, fitted: Mapping | None = None, *, parallel: qt.Parallel = qt.SERIAL,
                 all_experts: bool = False, float_inputs: list | None = None,
                 following: list | None = None) -> tuple[qt.Fit, list, list | None]:
    """One block of :func:`blockwise`: ``fit_block`` on block ``name`` of ``model`` with its ``inputs`` and the
    tree ``current``; returns the fit, the next block's inputs (this block's outputs with its tensors
    quantized: the fit's qparams, else ``fitted`` ones of earlier blocks' steps, else ``prior`` ones for
    tensors the fit left unchanged, else round to nearest) and, when ``float_inputs`` (the float model's
    inputs of this block, batch for batch) are given, the next block's float inputs (this block's outputs on
    them with its tensors as ``current`` holds them), else ``None``. ``following``: the next block's own inputs
    in the model's forward, batch by batch (``(slot, args, kwargs)``, :func:`capture_blocks`): the outputs are put
    in their hidden states' slot; ``None`` (the last block): in this block's. The streamed runs call it block by
    block.
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

    def call(path, tensors, args, kwargs, *, activations=False):
        if path != name and not path.startswith(name + "."):
            raise ValueError(f"block {name}: call: {path!r} is not inside the block")
        with quantizing_activations(model, plan) if activations else contextlib.nullcontext():
            return torch.func.functional_call(model.get_submodule(path), _local({**state, **tensors}, path), args,
                                              kwargs)

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
        floats = _onto(float_inputs, float_outputs(), following, name)
        memo.clear()
    state.update(fit.params)
    prior = {p: q for p, q in prior.items() if p not in fit.params}  # what was fitted before described the old tensor
    quantized = _quantized(state, paths, plan, {**prior, **(fitted or {}), **fit.qparams})
    outputs = quiet({p: quantized[p] for p in paths})
    return fit, _onto(inputs, [first_tensor(o) for o in outputs], following, name), floats


def _onto(inputs: list, hidden: list, following: list | None, name: str) -> list:
    """The next block's inputs: ``hidden`` (this block's outputs, batch by batch) in ``following``'s slots, or in
    this block's ``inputs`` where there is no next block."""
    if following is None:
        return [with_hidden(a, k, h, hidden_slot(a, k), name) for (a, k), h in zip(inputs, hidden)]
    if len(following) != len(hidden):
        raise ValueError(f"block {name}: {len(following)} batches of the next block's inputs for {len(hidden)} outputs")
    return [with_hidden(a, k, h, slot, name) for (slot, a, k), h in zip(following, hidden)]

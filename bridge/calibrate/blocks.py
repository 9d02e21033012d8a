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
from typing import Callable, Mapping

import torch
from torch import nn

import qtransform as qt

from .sites import first_tensor, fold_sites, run_batch

__all__ = ["find_blocks", "capture_inputs", "blockwise"]


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


def capture_inputs(model: nn.Module, params: Mapping, block: str, batches) -> list:
    """``(args, kwargs)`` of module ``block`` for every batch (the forward stops at the block)."""
    inputs = []

    def stop(m, args, kwargs):
        inputs.append((args, kwargs))
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


def _with_first(args, kwargs, h, block: str):
    """The block's next inputs: its output ``h`` in place of the hidden states (the first positional
    input, else the ``hidden_states`` keyword, else the first tensor keyword)."""
    if args and h is not None:
        return (h, *args[1:]), kwargs
    key = "hidden_states" if isinstance(kwargs.get("hidden_states"), torch.Tensor) else next(
        (k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
    if key is None or h is None:
        raise ValueError(f"block-by-block calibration: block {block!r} takes no tensor input or gives no tensor "
                         "output to pass on to the next block")
    return args, {**kwargs, key: h}


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


def blockwise(model: nn.Module, params: Mapping, plan: qt.Plan, batches, fit_block: Callable, *,
              qparams: Mapping | None = None, blocks: str | None = None, progress: Callable | None = None) -> qt.Fit:
    """Run ``fit_block(block, params) -> Fit`` block by block (see the module docstring); returns the
    blocks' fits combined.

    ``qparams``: parameters fitted before this step (or given by the caller); a block is quantized
    with them where this step fits none (and the tensor is unchanged), else round to nearest.
    ``blocks``: module path of the blocks' ``nn.ModuleList`` (default: see :func:`find_blocks`).
    """
    names = find_blocks(model, blocks)
    current = dict(params)
    prior = dict(qparams or {})
    inputs = capture_inputs(model, current, names[0], batches)
    total = qt.Fit()
    order = progress(names, desc="blocks", total=len(names)) if progress is not None else names
    for name in order:
        module = model.get_submodule(name)
        paths = tuple(p for p in current if p.startswith(name + "."))

        def run(tensors, name=name, module=module, inputs=inputs):
            local = _local({**current, **tensors}, name)
            with torch.no_grad():
                return [torch.func.functional_call(module, local, args, kwargs) for args, kwargs in inputs]

        def site_stats(tensors, sites, run=run, name=name):
            return fold_sites(model, sites, lambda: run(tensors), where=f"block {name}")

        block = qt.Block(name=name, paths=paths, inputs=tuple(inputs), run=run, site_stats=site_stats)
        fit = fit_block(block, current)
        current.update(fit.params)
        total = total.then(fit)
        for p in fit.params:  # what was fitted before described the old tensor
            prior.pop(p, None)
        quantized = _quantized(current, paths, plan, {**prior, **total.qparams})
        outputs = run({p: quantized[p] for p in paths})
        inputs = [_with_first(args, kwargs, first_tensor(out), name) for (args, kwargs), out in zip(inputs, outputs)]
    return total

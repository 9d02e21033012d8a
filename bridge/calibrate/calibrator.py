"""``ModelCalibrator``: what runs the model for the pipeline's steps that need data.

``site_stats`` folds the activations of named sites over every calibration batch
(:mod:`.sites`); ``blockwise`` hands a step one block at a time with its inputs (:mod:`.blocks`);
``model_loss`` gives the model's loss on each batch as a function of its tree (:mod:`.loss`).
The model runs in eval mode (no dropout, batch-norm statistics untouched), its modes restored after,
with the online rotations earlier steps recorded (``online=``) applied while it runs.
Batches come from any re-iterable (a list, a ``DataLoader``...), read once per request.

>>> import torch, qtransform as qt
>>> model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False))
>>> cal = ModelCalibrator(model, [torch.tensor([[1.0, -5.0, 2.0]]), torch.tensor([[4.0, 0.0, -1.0]])])
>>> stats = cal.site_stats(dict(model.state_dict()), {qt.Site("0"): qt.init_stats(observer="channel")})
>>> qt.finalize_stats(stats[qt.Site("0")]).absmax.tolist()
[4.0, 5.0, 2.0]
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

import qtransform as qt

from ..distributed import current, raw_tokens, share
from ..modules.online import installed
from .blocks import blockwise, find_blocks
from .loss import CalibrationLoss
from .sites import checked_batches, evaluating, fold_sites, run_batch

__all__ = ["ModelCalibrator"]


class ModelCalibrator:
    """Collects site statistics by running ``model`` on ``batches`` (see the module docstring).

    Args:
        model: the float model whose tree the pipeline transforms (its structure is used, not changed).
        batches: an iterable of calibration batches, read once per request (a list, or a re-iterable
            such as a ``DataLoader``).
        blocks: module path of the ``nn.ModuleList`` whose children are the blocks of block-by-block
            calibration (default: the one holding the most parameters).
        progress: ``progress(iterable, desc=..., total=...)``, e.g. ``tqdm.tqdm``.
        parallel: the ranks sharing the calibration (:class:`qtransform.Parallel`); default: the initialised
            torch.distributed group when it has several processes (:func:`bridge.distributed.current`). Each
            rank runs its contiguous share of the batches and the statistics reduce over all, so every rank
            gets what one process would; a step minimising the model's loss (SpinQuant) runs every batch on
            every rank (the same result, no speed-up).
        all_experts: the statistics of each expert of a mixture-of-experts layer see every calibration token
            (llm-compressor's calibrate-all-experts), not only the tokens routed to it; the layer's output (what
            the next layers see) stays the routed one. Default: routed tokens only.
    """

    def __init__(self, model: nn.Module, batches: Iterable, *, blocks: str | None = None,
                 progress: Callable | None = None, parallel: qt.Parallel | None = None, all_experts: bool = False):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(batches, (torch.Tensor, Mapping)) or not isinstance(batches, Iterable):
            raise TypeError("calibration must be an iterable of batches (a list of token-id tensors or dicts of "
                            f"model inputs, a DataLoader...), got {type(batches).__name__}")
        if blocks is not None:
            find_blocks(model, blocks)  # a wrong path fails here, before any work
        if parallel is not None and not isinstance(parallel, qt.Parallel):
            raise TypeError(f"parallel must be a qtransform.Parallel, got {type(parallel).__name__}")
        if not isinstance(all_experts, bool):
            raise TypeError(f"all_experts must be a bool, got {type(all_experts).__name__}")
        self.model, self.batches, self.blocks, self.progress = model, batches, blocks, progress
        self.all_experts = all_experts
        first = next(model.parameters(), None)  # where shared results land (the model's device)
        self.parallel = current(device=None if first is None else first.device) if parallel is None else parallel

    def _batches(self, batches=None):
        batches = self.batches if batches is None else batches
        if self.progress is None:
            return checked_batches(batches)
        try:
            total = len(batches)
        except TypeError:  # e.g. a DataLoader over an IterableDataset
            total = None
        return checked_batches(self.progress(batches, desc="calibration", total=total))

    def _mine(self):
        """This rank's share of the batches (all of them for one process)."""
        if self.parallel.world == 1:
            return self._batches()
        every = list(checked_batches(self.batches))  # indices of the whole data, not of this rank's share
        return self._batches(share(every, [raw_tokens(b) for b in every], self.parallel.world, self.parallel.rank))

    def site_stats(self, params: Mapping[str, torch.Tensor], sites: Mapping[qt.Site, Any], *,
                   online: Mapping | None = None) -> dict[qt.Site, Any]:
        def run_all() -> int:
            seen = 0
            for batch in self._mine():
                run_batch(self.model, params, batch)
                seen += 1
            return seen

        with evaluating(self.model), installed(self.model, online):
            return fold_sites(self.model, sites, run_all, where="calibration", parallel=self.parallel,
                              all_experts=self.all_experts)

    def blockwise(self, params: Mapping[str, torch.Tensor], plan: qt.Plan, fit_block, *,
                  qparams: Mapping | None = None, tokens: int | None = None, online: Mapping | None = None,
                  float_inputs: bool = False) -> qt.Fit:
        with evaluating(self.model), installed(self.model, online):
            return blockwise(self.model, params, plan, self._batches(), fit_block, qparams=qparams,
                             blocks=self.blocks, progress=self.progress, tokens=tokens, parallel=self.parallel,
                             all_experts=self.all_experts, float_inputs=float_inputs)

    def model_loss(self, plan: qt.Plan, *, online: Mapping | None = None) -> CalibrationLoss:
        return CalibrationLoss(self.model, self._batches(), plan, online=online)

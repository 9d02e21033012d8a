"""``ModelCalibrator``: what runs the model for the pipeline's steps that need data.

``site_stats`` folds the activations of named sites over every calibration batch
(:mod:`.sites`); ``blockwise`` hands a step one block at a time with its inputs (:mod:`.blocks`).
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

from .blocks import blockwise
from .sites import fold_sites, run_batch

__all__ = ["ModelCalibrator"]


class ModelCalibrator:
    """Collects site statistics by running ``model`` on ``batches`` (see the module docstring).

    Args:
        model: the float model whose tree the pipeline transforms (its structure is used, not changed).
        batches: an iterable of calibration batches, read once per request (a list, or a re-iterable
            such as a ``DataLoader``).
        progress: ``progress(iterable, desc=..., total=...)``, e.g. ``tqdm.tqdm``.
    """

    def __init__(self, model: nn.Module, batches: Iterable, *, progress: Callable | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(batches, (torch.Tensor, Mapping)) or not isinstance(batches, Iterable):
            raise TypeError("calibration must be an iterable of batches (a list of token-id tensors or dicts of "
                            f"model inputs, a DataLoader...), got {type(batches).__name__}")
        self.model, self.batches, self.progress = model, batches, progress

    def _batches(self):
        if self.progress is None:
            return iter(self.batches)
        total = len(self.batches) if hasattr(self.batches, "__len__") else None
        return iter(self.progress(self.batches, desc="calibration", total=total))

    def site_stats(self, params: Mapping[str, torch.Tensor], sites: Mapping[qt.Site, Any]) -> dict[qt.Site, Any]:
        def run_all() -> int:
            seen = 0
            for batch in self._batches():
                run_batch(self.model, params, batch)
                seen += 1
            return seen

        return fold_sites(self.model, sites, run_all, where="calibration")

    def blockwise(self, params: Mapping[str, torch.Tensor], plan: qt.Plan, fit_block) -> qt.Fit:
        return blockwise(self.model, params, plan, self._batches(), fit_block, progress=self.progress)

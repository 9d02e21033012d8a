"""Calibration on named activation sites: forward passes over the calibration batches with hooks that
fold each site's activations into its statistics (``qt.observe``), the model's tensors taken from the
pipeline's current tree through ``torch.func.functional_call`` (the model itself is not modified).

Batches may be token-id tensors (``model(ids)``), dicts of model inputs (``model(**batch)``),
tuples or lists of positional inputs (``model(*batch)``), from any iterable (a list, a
``DataLoader``...); tensors are moved to the model's device. No activation is kept: each batch is
folded into the statistics as it passes.

>>> import torch, qtransform as qt
>>> model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False))
>>> cal = ModelCalibrator(model, [torch.tensor([[1.0, -5.0, 2.0]]), torch.tensor([[4.0, 0.0, -1.0]])])
>>> stats = cal.site_stats(dict(model.state_dict()), {qt.Site("0"): qt.init_stats(observer="channel")})
>>> qt.finalize_stats(stats[qt.Site("0")]).absmax.tolist()
[4.0, 5.0, 2.0]
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

import qtransform as qt

__all__ = ["ModelCalibrator", "run_batch", "first_tensor"]


def first_tensor(value) -> torch.Tensor | None:
    """The first tensor in a module's input or output (a tensor, or a tuple/list/dict holding some)."""
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (tuple, list)) else ()
    return next((t for t in (first_tensor(v) for v in items) if t is not None), None)


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, Mapping):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value


def run_batch(model: nn.Module, params: Mapping[str, torch.Tensor], batch) -> Any:
    """``model`` on one calibration ``batch`` with its tensors taken from ``params``."""
    device = next((t.device for t in params.values() if isinstance(t, torch.Tensor)), torch.device("cpu"))
    batch = _to(batch, device)
    if isinstance(batch, Mapping):
        args, kwargs = (), dict(batch)
    elif isinstance(batch, (tuple, list)):
        args, kwargs = tuple(batch), {}
    elif isinstance(batch, torch.Tensor):
        args, kwargs = (batch,), {}
    else:
        raise TypeError(f"calibration batches must be tensors, dicts of model inputs or tuples of them, got "
                        f"{type(batch).__name__}")
    return torch.func.functional_call(model, dict(params), args, kwargs)


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
        modules = dict(self.model.named_modules())
        missing = sorted({s.module for s in sites if s.module not in modules})
        if missing:
            raise ValueError(f"calibration: site module(s) {missing[:5]} are not modules of {type(self.model).__name__}")
        stats = dict(sites)

        def hook(site):
            def fold(x):
                t = first_tensor(x)
                if t is None:
                    raise ValueError(f"calibration: {site.role} of {site.module!r} holds no tensor")
                stats[site] = qt.observe(stats[site], t.detach(), path=f"{site.module} ({site.role})")

            if site.role == "input":
                return modules[site.module].register_forward_pre_hook(lambda m, args, kwargs: fold((args, kwargs)),
                                                                      with_kwargs=True)
            return modules[site.module].register_forward_hook(lambda m, args, out: fold(out))

        seen = 0
        with contextlib.ExitStack() as stack:
            for site in sites:
                stack.callback(hook(site).remove)
            with torch.no_grad():
                for batch in self._batches():
                    run_batch(self.model, params, batch)
                    seen += 1
        if seen == 0:
            raise ValueError("calibration: no batches (the calibration data is empty or already consumed)")
        return stats

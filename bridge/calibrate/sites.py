"""Folding activations of named sites into statistics: hooks on the sites' modules while forward
passes run (:func:`fold_sites`; the keys and values of attention modules through
:func:`bridge.modules.kvcache.observing`), forward passes over calibration batches with the model's tensors
taken from a tree (:func:`run_batch`, through ``torch.func.functional_call``: the model itself is
not modified).

Batches may be token-id tensors (``model(ids)``), dicts of model inputs (``model(**batch)``),
tuples or lists of positional inputs (``model(*batch)``); tensors are moved to the model's
device. No activation is kept: each batch is folded into the statistics as it passes.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

import qtransform as qt

from ..modules import kvcache
from ..modules.mha_model import projection_inputs
from ..tree import tie_groups
from .experts import expert_sites, tapping

__all__ = ["fold_sites", "check_batch", "checked_batches", "run_batch", "first_tensor", "to_device", "untied", "takes", "evaluating"]


def first_tensor(value) -> torch.Tensor | None:
    """The first tensor in a module's input or output (a tensor, or a tuple/list/dict holding some)."""
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (tuple, list)) else ()
    return next((t for t in (first_tensor(v) for v in items) if t is not None), None)


def to_device(value, device):
    """``value`` (a tensor, or a dict, tuple or list holding some) with its tensors on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, Mapping):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    return value


class _Split(ValueError):
    """Tied names of a model hold different tensors in a tree."""


def _storage(t: torch.Tensor):
    """The data pointer of ``t``; a tensor without storage (a ``torch.func`` transform's wrapper) is its own."""
    try:
        return t.data_ptr()
    except RuntimeError:
        return id(t)


def untied(model: nn.Module, params: Mapping[str, torch.Tensor]) -> dict:
    """``params`` with one name per group of tied tensors (``functional_call`` ties the others to it).

    Raises ``ValueError`` naming them when the tree holds different tensors for tied names."""
    out = dict(params)
    for names in tie_groups(model):
        given = [n for n in names if n in out]
        for n in given[1:]:
            a, b = out[given[0]], out[n]
            if a is not b and (_storage(a) != _storage(b) or a.shape != b.shape):
                raise _Split(f"{given[0]} and {n} are tied in {type(model).__name__}, but the tree holds "
                                 "different tensors for them")
            del out[n]
    return out


def takes(model: nn.Module, name: str) -> bool:
    """Whether ``model.forward`` takes the keyword ``name``."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def check_batch(batch, index: int) -> None:
    """``TypeError`` naming calibration batch ``index`` and its type unless :func:`run_batch` can call a model with
    it: a tensor (``model(batch)``), a tuple or list of positional inputs (``model(*batch)``), a dict of keyword
    inputs (``model(**batch)``, string keys)."""
    if not isinstance(batch, (torch.Tensor, Mapping, tuple, list)):
        raise TypeError(f"calibration batch {index}: a batch must be a tensor (model(batch)), a tuple or list of "
                        f"positional inputs (model(*batch)) or a dict of keyword inputs (model(**batch)), got "
                        f"{type(batch).__name__}")
    if isinstance(batch, Mapping) and not all(isinstance(k, str) for k in batch):
        bad = next(k for k in batch if not isinstance(k, str))
        raise TypeError(f"calibration batch {index}: a dict batch holds the forward's keyword inputs, so its keys "
                        f"must be strings, got {bad!r} ({type(bad).__name__})")


def checked_batches(batches):
    """``batches`` as they come, each checked by :func:`check_batch` (with its index) before it is used."""
    for i, batch in enumerate(batches):
        check_batch(batch, i)
        yield batch


def run_batch(model: nn.Module, params: Mapping[str, torch.Tensor], batch) -> Any:
    """``model`` on one calibration ``batch`` with its tensors taken from ``params`` (see :func:`untied`);
    with ``use_cache=False`` where the forward takes it (no key/value cache carries state between runs)."""
    device = next((t.device for t in params.values() if isinstance(t, torch.Tensor)), torch.device("cpu"))
    batch = to_device(batch, device)
    if isinstance(batch, Mapping):
        args, kwargs = (), dict(batch)
    elif isinstance(batch, (tuple, list)):
        args, kwargs = tuple(batch), {}
    elif isinstance(batch, torch.Tensor):
        args, kwargs = (batch,), {}
    else:
        raise TypeError(f"calibration batches must be tensors, dicts of model inputs or tuples of them, got "
                        f"{type(batch).__name__}")
    if takes(model, "use_cache"):
        kwargs["use_cache"] = False
    try:
        try:
            return torch.func.functional_call(model, untied(model, params), args, kwargs)
        except _Split:
            pass
        # tied names holding different tensors (one of them quantized: the quantized model unties them):
        # each name gets its own value
        return torch.func.functional_call(model, dict(params), args, kwargs, tie_weights=False)
    except Exception as e:
        if _ours(e):
            raise
        raise ValueError(f"calibration: {type(model).__name__}'s forward fails on a calibration batch "
                         f"({_described(batch)}): {type(e).__name__}: {e}. Its forward needs inputs the batches do "
                         "not hold (images, audio, encoder or decoder inputs, state...): give batches as dicts of "
                         "its inputs, or quantize without calibration") from e


_OURS = tuple(str(Path(m.__file__).resolve().parent) for m in (qt, sys.modules[__name__.partition(".")[0]]))


def _ours(e: BaseException) -> bool:
    """Whether ``e`` was raised in, or passed through, the library's own code below the model's forward (a hook, a
    patched forward): not the model's forward failing on its inputs."""
    tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # below run_batch's own frame
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(_OURS):
            return True
        tb = tb.tb_next
    return False


def _described(batch) -> str:
    if isinstance(batch, torch.Tensor):
        return f"a tensor of shape {list(batch.shape)}"
    if isinstance(batch, Mapping):
        return "a dict of " + ", ".join(map(str, batch))
    return f"a {type(batch).__name__} of {len(batch)} inputs"


def fold_sites(model: nn.Module, sites: Mapping[qt.Site, Any], run_all: Callable[[], Any], *,
               where: str, parallel: qt.Parallel = qt.SERIAL, owners: Mapping | None = None,
               all_experts: bool = False) -> dict[qt.Site, Any]:
    """Hooks on the sites' modules of ``model`` fold what passes into each site's statistics while
    ``run_all()`` runs forward passes (it returns how many, or anything when it cannot be empty).
    ``parallel``: ``run_all`` ran this rank's share; the statistics are reduced over the ranks (to ``owners``
    only, when given: ``{site: rank}``) before a site is called unreached (a rank's share may miss a module
    that the whole data reaches).

    The site of a stacked experts weight (``Site("<experts>.gate_up_proj")``, :mod:`.experts`) gets a tuple of
    statistics, one per expert, each folded from the tokens routed to that expert (every token with
    ``all_experts``); an expert no token reached keeps empty statistics (not an error: the steps fall back)."""
    bad = [s for s in sites if not isinstance(s, qt.Site) or s.role not in qt.spec.SITE_ROLES]
    if bad:
        raise ValueError(f"{where}: {bad[0]!r} is not a Site(module, role) with role in {list(qt.spec.SITE_ROLES)}")
    modules = dict(model.named_modules())
    routed = expert_sites(model, sites)
    missing = sorted({s.module for s in sites if s.module not in modules and s not in routed})
    if missing:
        raise ValueError(f"{where}: site module(s) {missing[:5]} are not modules of {type(model).__name__}")
    stats = {s: v for s, v in sites.items() if s not in routed}
    stats.update({(s, e): sites[s] for s, (m, _) in routed.items() for e in range(modules[m].num_experts)})
    ours: set = set()  # keys whose statistics this fold made: donated to the next update (no second copy)

    def observe(key, t, what):
        stats[key] = qt.observe(stats[key], t.detach(), path=what, donate=key in ours)
        ours.add(key)

    def folder(site):
        def fold(x):
            t = first_tensor(x)
            if t is None:
                raise ValueError(f"{where}: {site.role} of {site.module!r} holds no tensor")
            observe(site, t, f"{site.module} ({site.role})")
        return fold

    def fold_expert(site, e, x):
        observe((site, e), x, f"{site.module} (expert {e} {site.role})")

    def kv_callback(module):
        folds = {r: folder(qt.Site(module, r)) for r in qt.spec.KV_ROLES if qt.Site(module, r) in stats}

        def fold_kv(key, value):
            for role, t in (("key", key), ("value", value)):
                if role in folds:
                    folds[role](t)
        return fold_kv

    def hook(site):
        fold = folder(site)

        if site.role == "input":
            def pre(m, args, kwargs):  # a multi-head attention's in-projection: query, key and value all folded
                for t in projection_inputs(m, args, kwargs) or ((args, kwargs),):
                    fold(t)
            return modules[site.module].register_forward_pre_hook(pre, with_kwargs=True)
        return modules[site.module].register_forward_hook(lambda m, args, out: fold(out))

    kv = {s.module for s in sites if s.role in qt.spec.KV_ROLES}
    with contextlib.ExitStack() as stack:
        for site in sites:
            if site.role not in qt.spec.KV_ROLES and site not in routed:
                stack.callback(hook(site).remove)
        if kv:
            stack.enter_context(kvcache.observing(model, {m: kv_callback(m) for m in kv}))
        if routed:
            stack.enter_context(tapping(model, routed, fold_expert, all_tokens=all_experts))
        with torch.no_grad():
            seen = run_all()
    if seen == 0:
        raise ValueError(f"{where}: no batches (the calibration data is empty or already consumed)")
    if owners is not None:
        owners = {**owners, **{k: owners[k[0]] for k in stats if type(k) is tuple and k[0] in owners}}
    stats = parallel.reduce_stats(stats, owners)
    unreached = [f"{s.module} ({s.role})" for s, st in stats.items()
                 if type(s) is not tuple and qt.observers.is_empty(st)]
    if unreached:
        raise ValueError(f"{where}: no activation reached site(s) {unreached[:5]}: the forward pass never runs "
                         "those modules")
    out = {s: v for s, v in stats.items() if type(s) is not tuple}
    for s, (m, _) in routed.items():
        if (s, 0) in stats:
            out[s] = tuple(stats[(s, e)] for e in range(modules[m].num_experts))
    return out


@contextlib.contextmanager
def evaluating(model: nn.Module):
    """``model`` in eval mode (dropout off, batch-norm statistics frozen), each module's mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, mode in modes:
            m.training = mode

"""Which BatchNorm layers of a model read the output of one convolution or linear layer, and nothing else does.

A pair ``(producer, norm)`` folds (:func:`qtransform.fold_norms`) when, in the model's forward, the norm's only
input is the producer's output and that output has no other user, each called once. Found two ways:

* **traced** (``torch.fx.symbolic_trace``): the graph says it exactly. The norm's node has the producer's node as
  its one argument, the producer's node has the norm as its one user, each module is called at one place, and
  no node reads either module's tensors directly;
* **not traced** (data-dependent control flow, unsupported calls): each child module is tried on its own,
  recursively, and the children of a plain ``nn.Sequential`` (one whose ``forward`` is ``nn.Sequential``'s)
  pair where a producer is directly followed by a BatchNorm: ``Sequential`` feeds each child's output to the
  next child alone. This trusts that the forward that did not trace calls those modules only through their
  parent (never, say, ``self.block.conv(x)`` on its own), which nothing can check without a graph.

In both, the producer is ``nn.Linear``, ``nn.ConvNd`` or ``nn.ConvTransposeNd`` (these exact classes: a subclass
may compute something else) and the norm ``nn.BatchNorm1d/2d/3d`` or ``nn.SyncBatchNorm``, of matching
dimensionality (``Conv2d`` -> ``BatchNorm2d``, ``Linear`` -> ``BatchNorm1d``), with running statistics and as
many channels as the producer has outputs; neither may be registered under two names or carry forward hooks.
``Linear`` -> ``BatchNorm1d`` folds as a ``(batch, features)`` pair: BatchNorm1d normalizes axis 1, which is the
linear's output axis only for 2-D outputs; a graph without shapes cannot tell a 3-D ``(N, L, C)`` output with
``L == C``, so such a model (rare: BatchNorm1d would normalize over ``L``) must not be folded.

Every other BatchNorm of the model is reported with the reason it stays.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import torch
from torch import nn

__all__ = ["PRODUCERS", "NORMS", "Pairs", "find_pairs"]

PRODUCERS = {nn.Linear: 1, nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3, nn.ConvTranspose1d: 1, nn.ConvTranspose2d: 2,
             nn.ConvTranspose3d: 3}
"""Producer classes -> the BatchNorm dimensionality that reads their output."""
NORMS = {nn.BatchNorm1d: 1, nn.BatchNorm2d: 2, nn.BatchNorm3d: 3, nn.SyncBatchNorm: None}
"""Norm classes -> their dimensionality (``None``: any, SyncBatchNorm)."""


class Pairs(NamedTuple):
    """What :func:`find_pairs` found: ``pairs`` ``((producer, norm, how), ...)`` with ``how`` ``"fx"`` or
    ``"sequential"``; ``skipped`` ``{norm: reason}`` for every other BatchNorm; ``untraced`` ``{module: error}``
    for the modules that did not trace (``""`` the model itself)."""

    pairs: tuple[tuple[str, str, str], ...]
    skipped: dict[str, str]
    untraced: dict[str, str]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _out_channels(m: nn.Module) -> int:
    return m.out_features if isinstance(m, nn.Linear) else m.out_channels


def _pair_problem(model: nn.Module, producer: str, norm: str, names: Counter) -> str | None:
    """Why the adjacent ``producer`` -> ``norm`` does not fold, or ``None`` (the checks both finders share)."""
    p, n = model.get_submodule(producer), model.get_submodule(norm)
    want = PRODUCERS.get(type(p))
    if want is None:
        return f"its input is the output of {producer} ({type(p).__name__}), not of a float Linear/ConvNd/ConvTransposeNd"
    if NORMS[type(n)] not in (None, want):
        return f"{type(n).__name__} after {producer} ({type(p).__name__}): dimensionalities differ"
    if not n.track_running_stats or n.running_mean is None or n.running_var is None:
        return "track_running_stats=False: it normalizes with each batch's statistics, which no weight can hold"
    if n.num_features != _out_channels(p):
        return f"{n.num_features} channels, but {producer} has {_out_channels(p)} outputs"
    for path, m in ((producer, p), (norm, n)):
        if names[id(m)] > 1:
            return f"{path} is registered under {names[id(m)]} names (a shared module)"
        if m._forward_hooks or m._forward_pre_hooks:
            return f"{path} has forward hooks (they would see the folded tensors)"
    return None


def _traced(model: nn.Module, module: nn.Module, prefix: str, names: Counter, out: dict, skipped: dict) -> None:
    """Pairs of ``module`` (at ``prefix``) from its fx graph; raises what tracing raises."""
    gm = torch.fx.symbolic_trace(module)
    nodes = list(gm.graph.nodes)
    calls = Counter(n.target for n in nodes if n.op == "call_module")
    read = {n.target.rpartition(".")[0] for n in nodes if n.op == "get_attr"}
    found, skips = {}, {}
    for node in nodes:
        if node.op != "call_module" or type(gm.get_submodule(node.target)) not in NORMS:
            continue
        norm = _join(prefix, node.target)
        src = node.args[0] if len(node.args) == 1 and not node.kwargs else None
        if calls[node.target] > 1:
            skips[norm] = f"called at {calls[node.target]} places in the forward"
        elif not isinstance(src, torch.fx.Node) or src.op != "call_module":
            what = src.format_node() if isinstance(src, torch.fx.Node) else repr(node.args)
            skips[norm] = f"its input is not the output of a module ({what})"
        elif len(src.users) > 1:
            others = sorted(u.name for u in src.users if u is not node)
            skips[norm] = f"the output of {_join(prefix, src.target)} has other users too ({', '.join(others)})"
        elif calls[src.target] > 1:
            skips[norm] = f"{_join(prefix, src.target)} is called at {calls[src.target]} places in the forward"
        elif src.target in read or node.target in read:
            skips[norm] = "the forward reads the tensors of the conv/linear or the norm directly"
        else:
            problem = _pair_problem(model, _join(prefix, src.target), norm, names)
            if problem:
                skips[norm] = problem
            else:
                found[norm] = (_join(prefix, src.target), norm, "fx")
    out.update(found)
    skipped.update(skips)


def _untraced(model: nn.Module, module: nn.Module, prefix: str, names: Counter, out: dict, skipped: dict,
              untraced: dict, error: Exception) -> None:
    untraced[prefix] = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    children = list(module.named_children())
    if isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward:
        for (a, _), (b, bm) in zip(children, children[1:]):
            if type(bm) in NORMS and type(module._modules[a]) in PRODUCERS:
                problem = _pair_problem(model, _join(prefix, a), _join(prefix, b), names)
                if problem:
                    skipped[_join(prefix, b)] = problem
                else:
                    out[_join(prefix, b)] = (_join(prefix, a), _join(prefix, b), "sequential")
    for name, child in children:
        _walk(model, child, _join(prefix, name), names, out, skipped, untraced)


def _walk(model, module, prefix, names, out, skipped, untraced) -> None:
    if type(module) in NORMS or type(module) in PRODUCERS or not any(True for _ in module.children()):
        return  # a leaf: nothing inside pairs
    try:
        _traced(model, module, prefix, names, out, skipped)
    except Exception as e:  # noqa: BLE001 -- any tracing failure: the children on their own
        _untraced(model, module, prefix, names, out, skipped, untraced, e)


def find_pairs(model: nn.Module) -> Pairs:
    """The foldable ``(producer, norm)`` pairs of ``model`` (see the module docstring). Reads the model only
    (tracing runs its forward on proxies: pass a copy where that forward has side effects)."""
    names = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    out, skipped, untraced = {}, {}, {}
    _walk(model, model, "", names, out, skipped, untraced)
    for name, m in model.named_modules():
        if type(m) in NORMS and name not in out and name not in skipped:
            where = " (in a module that did not trace)" if untraced else ""
            skipped[name] = f"not found right after a conv/linear whose output only it reads{where}"
    pairs = tuple(out[n] for n, m in model.named_modules() if n in out)
    return Pairs(pairs, {n: skipped[n] for n, m in model.named_modules() if n in skipped and n not in out},
                 untraced)

"""Calibration sites inside mixture-of-experts layers: what enters each expert's projections.

An experts module runs every expert on the tokens routed to it inside one forward, so no hook on a module
sees expert ``e``'s input. The site of a stacked experts weight is named by the weight's path
(``Site("model.layers.0.mlp.experts.gate_up_proj", "input")``: the input of that projection, per expert);
while calibration runs, the experts module computes its routed output with
:func:`bridge.modules.experts.routed_forward` and a tap folds each expert's input into that expert's
statistics. The statistics of such a site are a tuple with one entry per expert (an expert no token reached
keeps empty statistics: the steps fall back for it and report it). With ``all_tokens`` every expert's
statistics see every token (llm-compressor's calibrate-all-experts) while the layer's output stays the routed one.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Mapping

from torch import nn

import qtransform as qt

from ..modules.experts import QExperts, expert_weights, routed_forward

__all__ = ["expert_sites", "tapping", "expert_matrix"]


def expert_sites(model: nn.Module, sites) -> dict:
    """``{site: (experts module path, weight name)}`` for the sites of ``sites`` that name a stacked experts
    weight of ``model`` (role ``"input"``)."""
    modules = dict(model.named_modules())
    out = {}
    for site in sites:
        parent, _, leaf = site.module.rpartition(".")
        m = modules.get(parent)
        if m is not None and leaf in expert_weights(m) and site.module not in modules:
            if site.role != "input":
                raise ValueError(f"{site.module}: the statistics of an experts weight are of its input, not its "
                                 f"{site.role}")
            out[site] = (parent, leaf)
    return out


def expert_matrix(module: nn.Module) -> Callable:
    """``matrix(name, e, dtype)`` of an experts module (float, or quantized ``QExperts``)."""
    if isinstance(module, QExperts):
        return module.matrix
    return lambda name, e, dtype: getattr(module, name)[e].to(dtype)


@contextlib.contextmanager
def tapping(model: nn.Module, sites: Mapping, fold: Callable, *, all_tokens: bool = False):
    """While inside, the experts modules of ``sites`` (:func:`expert_sites`) call ``fold(site, e, x)`` with
    the input ``x`` of expert ``e`` to the site's projection."""
    by_module: dict[str, dict[str, qt.Site]] = {}
    for site, (parent, leaf) in sites.items():
        by_module.setdefault(parent, {})[leaf] = site
    patched = []
    try:
        for parent, leaves in by_module.items():
            module = model.get_submodule(parent)

            def forward(hidden_states, top_k_index, top_k_weights, *, _m=module, _leaves=leaves):
                def tap(name, e, x):
                    if name in _leaves:
                        fold(_leaves[name], e, x)
                return routed_forward(_m, hidden_states, top_k_index, top_k_weights, matrix=expert_matrix(_m),
                                      tap=tap, all_tokens=all_tokens)
            module.forward = forward
            patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward

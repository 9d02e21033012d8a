"""Online rotations at run time (:mod:`qtransform.rotation.online`): QuaRot's ``R4`` and ``R3``.

:func:`install_online_rotations` gives modules the rotations a rotated tree expects, ``{Site: OnlineRotation}``:

* ``Site(linear, "input")``: a forward pre-hook rotates the module's input (``x H``) before the
  module runs, so before its input quantizer; its weight already holds ``W H``. Any module with a
  weight takes one (a quantized ``QLinear`` or a float ``nn.Linear`` the recipe left alone);
* ``Site(attention, "key")``: the attention module's queries and keys are rotated after rotary
  embeddings, inside the attention function the module calls (:mod:`bridge.modules.kvcache`),
  before its key quantizer.

The rotation is recorded on the module (``module._qt_online``: ``{role: OnlineRotation}``), which
:func:`online_rotations` reads back for checkpoints; :func:`installed` applies rotations for the
duration of a block (calibration of the steps after a ``rotate`` step).

>>> import torch, qtransform as qt
>>> from qtransform.rotation import apply_online, online_hadamard
>>> lin = torch.nn.Linear(8, 3, bias=False)
>>> rot = online_hadamard(8)
>>> x = torch.randn(2, 8)
>>> y = lin(x)
>>> with torch.no_grad():
...     _ = lin.weight.copy_(apply_online(lin.weight, rot))
>>> install_online_rotations(lin, {qt.Site("", "input"): rot})
>>> torch.allclose(lin(x), y, atol=1e-6), online_rotations(lin)
(True, {Site(module='', role='input'): OnlineRotation(size=8, kind='hadamard')})
"""

from __future__ import annotations

import contextlib
from typing import Mapping

import torch
from torch import nn

import qtransform as qt
from qtransform.rotation import ONLINE_ROLES, OnlineRotation, apply_online, check_online

from . import kvcache

__all__ = ["install_online_rotations", "remove", "installed", "online_rotations", "check"]


def _rotate_input(module: nn.Module, args, kwargs):
    """Forward pre-hook: the first tensor argument rotated."""
    rot = module._qt_online["input"]
    if args and isinstance(args[0], torch.Tensor):
        return (apply_online(args[0], rot), *args[1:]), kwargs
    key = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
    if key is None:
        raise ValueError(f"online rotation of {type(module).__name__}'s input: the call passes no tensor")
    return args, {**kwargs, key: apply_online(kwargs[key], rot)}


def _width(module: nn.Module) -> int | None:
    """The input width of a linear layer (float or quantized; GPT-2's ``Conv1D`` stores (in, out))."""
    for name in ("in_features", "nx"):
        if isinstance(getattr(module, name, None), int):
            return getattr(module, name)
    w = getattr(module, "weight", None)
    return w.shape[-1] if isinstance(w, torch.Tensor) and w.dim() == 2 else None


def check(model: nn.Module, online: Mapping) -> dict:
    """``{Site: OnlineRotation}`` checked against ``model`` (``TypeError``/``ValueError`` naming the site):
    input rotations on linear layers whose input width they tile, key rotations on attention modules
    whose head width they tile."""
    if not isinstance(online, Mapping):
        raise TypeError(f"online must map qtransform Sites to OnlineRotation, got {type(online).__name__}")
    attention = None
    for site, rot in online.items():
        if not isinstance(site, qt.Site) or site.role not in ONLINE_ROLES:
            raise TypeError(f"online: keys must be qtransform.Site(module, role) with role in {list(ONLINE_ROLES)}, "
                            f"got {site!r}")
        where = f"online rotation at {site.module} ({site.role})"
        try:
            module = model.get_submodule(site.module)
        except AttributeError:
            raise ValueError(f"{where}: not a module of {type(model).__name__}") from None
        if site.role == "key":
            attention = set(kvcache.attention_modules(model)) if attention is None else attention
            if site.module not in attention:
                raise ValueError(f"{where}: {type(module).__name__} is not an attention module (one that calls "
                                 "transformers' attention functions)")
            width = getattr(module, "head_dim", None)
        else:
            width = _width(module)
        if not isinstance(width, int):
            raise ValueError(f"{where}: {type(module).__name__} has no "
                             f"{'head_dim' if site.role == 'key' else 'linear input width'}")
        check_online(rot, width, where)
    return dict(online)


def install_online_rotations(model: nn.Module, online: Mapping) -> None:
    """Apply the rotations ``{Site: OnlineRotation}`` at run time (see the module docstring); checked
    first (:func:`check`), nothing installed unless all are valid. Idempotent per site."""
    online = check(model, online)
    for site, rot in online.items():
        module = model.get_submodule(site.module)
        module._qt_online = {**getattr(module, "_qt_online", {}), site.role: rot}
        if site.role == "input" and _rotate_input not in module._forward_pre_hooks.values():
            module.register_forward_pre_hook(_rotate_input, with_kwargs=True, prepend=True)
    keyed = [s.module for s in online if s.role == "key"]
    if keyed:
        kvcache.route_attention(model, keyed)


def remove(model: nn.Module, sites) -> None:
    """Undo :func:`install_online_rotations` at ``sites`` (attention implementations are left routed: without a rotation
    or quantizer the routed function is the original)."""
    for site in sites:
        module = model.get_submodule(site.module)
        left = {r: v for r, v in getattr(module, "_qt_online", {}).items() if r != site.role}
        if site.role == "input":
            for key in [k for k, fn in module._forward_pre_hooks.items() if fn is _rotate_input]:
                del module._forward_pre_hooks[key]
                module._forward_pre_hooks_with_kwargs.pop(key, None)
        if left:
            module._qt_online = left
        else:
            module.__dict__.pop("_qt_online", None)


@contextlib.contextmanager
def installed(model: nn.Module, online: Mapping | None):
    """The rotations applied within the block, removed after (the model is left as it was)."""
    online = dict(online or {})
    before = [s for s in online if s.role in getattr(model.get_submodule(s.module), "_qt_online", {})]
    if before:
        raise ValueError(f"online rotations at {before[:3]} are already installed on the model")
    configs = {id(c): (c, c._attn_implementation) for c in (model.get_submodule(s.module).config for s in online
                                                               if s.role == "key")}
    install_online_rotations(model, online)
    try:
        yield model
    finally:
        remove(model, online)
        for c, impl in configs.values():
            c._attn_implementation = impl


def online_rotations(model: nn.Module) -> dict:
    """``{Site: OnlineRotation}`` installed on ``model``'s modules (what checkpoints record)."""
    return {qt.Site(name, role): rot for name, m in model.named_modules()
            for role, rot in getattr(m, "_qt_online", {}).items() if isinstance(rot, OnlineRotation)}

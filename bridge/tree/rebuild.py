"""Quantized tree -> module: ``to_module``.

``to_module(model, qtree)`` returns a model with the structure of ``model`` and the values
of ``qtree`` (a tree, or the pipeline's :class:`~bridge.tree.Quantized` result with its plan,
activation quantizers and online rotations: the one way from a quantized result to a model, for
:func:`bridge.quantize` and the ``qtransform`` command alike): every
:class:`~qtransform.QTensor` leaf at ``"<module>.weight"`` turns its module (Linear, Conv1d/2d/3d,
ConvTranspose1d/2d/3d, Embedding, EmbeddingBag, transformers Conv1D) into the quantized module; other
leaves are assigned as they are. With ``inplace=False`` (the default) the original model is
untouched: the copy is built as a skeleton on the ``meta`` device and filled from the tree, so no
weight is copied (unquantized tensors are shared with the tree, i.e. with the original model when
the tree came from :func:`bridge.extract`). Paths missing from the tree keep the original's tensors.

Functions registered in :data:`REBUILD_HOOKS` run on every rebuilt model (the transformers
integration records the model's quantization config there, for ``save_pretrained``).

>>> import torch, qtransform as qt
>>> from bridge.tree import extract, to_module
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
>>> qtree = qt.quantize_tree(extract(model), qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)))
>>> qmodel = to_module(model, qtree)
>>> [type(m).__name__ for m in qmodel], type(model[0]).__name__
(['QLinear', 'ReLU', 'QLinear'], 'Linear')
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import torch
from torch import nn

import qtransform as qt
from qtransform import QTensor

from ..modules import QModule, actquant, kvcache, quantized_class
from ..modules import online as online_mod
from ..step_outputs import attach_outputs
from ..modules.experts import QExperts, expert_weights, stored_shape
from ..modules.mha import QMultiheadAttention
from ..modules.mha_model import fused_paths_off, mha_owner
from .quantized import Quantized

__all__ = ["to_module", "submodule", "replace_module", "meta_skeleton", "REBUILD_HOOKS", "float_slot", "qtensor_at",
           "experts_slot", "site_buffers"]


def _check_hook(name: str, hook) -> None:
    if not callable(hook):
        raise TypeError(f"rebuild hook {name}: expected hook(model, quantized, plan), got {type(hook).__name__}")


#: ``name -> hook(model, quantized, plan)`` run at the end of :func:`to_module` (``quantized`` is
#: ``{path: QTensor}``, ``plan`` the :class:`~qtransform.Plan` when the caller has one).
REBUILD_HOOKS = qt.Registry("rebuild hook", check=_check_hook)


def submodule(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    """``(owner module, attribute name)`` of the parameter or module at ``path``."""
    parent, _, name = path.rpartition(".")
    return (model.get_submodule(parent) if parent else model), name


def float_slot(model: nn.Module, path: str) -> torch.Tensor:
    """The float tensor at weight path ``path`` (a module's ``weight``, an experts module's stacked weight)."""
    module, leaf = submodule(model, path)
    return getattr(module, leaf)


def qtensor_at(model: nn.Module, path: str) -> QTensor:
    """The quantized tensor a quantized module holds at weight path ``path`` (no copy)."""
    module, leaf = submodule(model, path)
    if isinstance(module, (QExperts, QMultiheadAttention)):
        return module.qtensor(leaf)
    if not isinstance(module, QModule) or leaf != "weight":
        raise ValueError(f"{path}: not a quantized weight ({type(module).__name__}.{leaf})")
    return module.qweight


def experts_slot(model: nn.Module, path: str) -> tuple[nn.Module | None, str]:
    """``(experts module, weight name)`` when ``path`` names a stacked experts weight of ``model`` (the module
    path of its activation sites), else ``(None, "")``."""
    parent, _, leaf = path.rpartition(".")
    try:
        module = model.get_submodule(parent)
    except AttributeError:
        return None, ""
    return (module, leaf) if leaf in expert_weights(module) else (None, "")


def site_buffers(model: nn.Module, site: qt.Site) -> dict[str, torch.Tensor]:
    """``{state-dict key: buffer}`` of the static activation quantizer at ``site`` (``<module>.input_scale``...;
    ``<experts>.down_proj_input_scale``... for a projection of an experts module)."""
    owner, leaf = experts_slot(model, site.module)
    if owner is not None:
        base, prefix = site.module.rpartition(".")[0], f"{leaf}_{actquant.PREFIX[site.role]}"
    else:
        owner, base, prefix = model.get_submodule(site.module), site.module, actquant.PREFIX[site.role]
    return {f"{base}.{n}" if base else n: b for n, b in owner._buffers.items() if b is not None and n.startswith(prefix)}


def meta_skeleton(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are on ``meta`` (ties preserved)."""
    memo = {}
    for t in [t for _, t in model.named_parameters(remove_duplicate=False)] + [t for _, t in model.named_buffers(remove_duplicate=False)]:
        if id(t) not in memo:
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def check_replacement(model: nn.Module, path: str, q: QTensor):
    """Raise ``ValueError`` naming ``path`` unless :func:`replace_module` can put ``q`` there; returns
    ``(module, quantized class)``."""
    mha, _, name = mha_owner(model, path)
    if mha is not None and name != "out_proj.weight":  # an in-projection weight of a multi-head attention
        if mha is model:
            raise ValueError(f"{path}: the root module itself cannot be replaced; wrap it in a container")
        want = mha._shape(name) if isinstance(mha, QMultiheadAttention) else tuple(getattr(mha, name).shape)
        if tuple(q.shape) != want:
            raise ValueError(f"{path}: quantized tensor has shape {tuple(q.shape)}, the MultiheadAttention weight is "
                             f"{want}")
        return mha, QMultiheadAttention
    if mha is not None and mha is model:
        raise ValueError(f"{path}: the root module itself cannot be replaced; wrap it in a container")
    module, leaf = submodule(model, path)
    if leaf in expert_weights(module):
        if module is model:
            raise ValueError(f"{path}: the root module itself cannot be replaced; wrap it in a container")
        shape = stored_shape(module, leaf)
        if tuple(q.shape) != tuple(shape):
            raise ValueError(f"{path}: quantized tensor has shape {tuple(q.shape)}, the experts weight is {tuple(shape)}")
        return module, QExperts
    cls = quantized_class(module)
    if cls is None or leaf != "weight":
        raise ValueError(f"{path}: only the weight of Linear, Conv1d/2d/3d, ConvTranspose1d/2d/3d, Embedding, "
                         f"EmbeddingBag and transformers Conv1D modules and the projection weights of "
                         f"MultiheadAttention can be quantized; this is {type(module).__name__}.{leaf}")
    if module is model and not isinstance(module, QModule):
        raise ValueError(f"{path}: the root module itself cannot be replaced; wrap it in a container")
    if not isinstance(module, QModule) and tuple(q.shape) != tuple(module.weight.shape):
        raise ValueError(f"{path}: quantized tensor has shape {tuple(q.shape)}, the {type(module).__name__} "
                         f"weight is {tuple(module.weight.shape)}")
    return module, cls


def replace_module(model: nn.Module, path: str, q: QTensor, kernel: str = "auto") -> None:
    """Make the module owning ``path`` (its weight) a quantized module holding ``q`` (in place). A projection
    weight of an ``nn.MultiheadAttention`` makes it a :class:`QMultiheadAttention` first (which calls its
    ``out_proj``; see :mod:`bridge.modules.mha`)."""
    module, cls = check_replacement(model, path, q)
    mha, where, name = mha_owner(model, path)
    if mha is not None and not isinstance(mha, QMultiheadAttention):
        new = QMultiheadAttention(mha)
        parent, attr = submodule(model, where)
        parent._modules[attr] = new
        mha = new
        if name == "out_proj.weight":
            module = new.out_proj
    if cls is QMultiheadAttention:
        mha.set_qtensor(name, q)
        return
    if cls is QExperts:
        leaf = path.rpartition(".")[2]
        if not isinstance(module, QExperts):
            new = QExperts(module)
            new.train(module.training)
            parent, name = submodule(model, path.rpartition(".")[0])
            parent._modules[name] = new
            module = new
        module.set_qtensor(leaf, q)
        return
    if isinstance(module, QModule):
        module.set_qweight(q)
        return
    new = cls.from_float(module, q, kernel=kernel)
    new.train(module.training)
    parent, name = submodule(model, path.rpartition(".")[0])
    parent._modules[name] = new


def _assign(model: nn.Module, values: Mapping[str, torch.Tensor], original: nn.Module | None) -> None:
    """Fill parameters/buffers from ``values`` (else from ``original``), preserving ties, except between
    tied names that ``values`` gives different tensors (e.g. a rotated output head): those are untied.
    Returns the paths that were untied."""
    src = dict(original.state_dict(keep_vars=True)) if original is not None else {}
    done: dict[int, tuple] = {}  # id(tensor) -> (value it was given, parameter)
    untied = set()
    for path, t in list(model.named_parameters(remove_duplicate=False)):
        owner, name = submodule(model, path)
        given, first = values.get(path), done.get(id(t))
        if first is not None and (given is None or _same(given, first[0])):  # still tied
            owner._parameters[name] = first[1]
            continue
        if first is not None:
            untied.add(path)
        v = values.get(path, src.get(path))
        if v is None:
            if t.is_meta:
                raise ValueError(f"{path}: no value in the tree or the original model")
            continue
        v = v.detach() if isinstance(v, torch.Tensor) else v
        param = nn.Parameter(v, requires_grad=t.requires_grad and v.is_floating_point())
        done.setdefault(id(t), (given, param))
        owner._parameters[name] = param
    orig_buffers = dict(original.named_buffers(remove_duplicate=False)) if original is not None else {}
    for path, b in list(model.named_buffers(remove_duplicate=False)):
        owner, name = submodule(model, path)
        if isinstance(owner, QModule) and name in owner._qnames:
            continue
        if isinstance(owner, (QExperts, QMultiheadAttention)) and any(name in meta[3] for meta in owner._qmeta.values()):
            continue
        v = values.get(path)
        if v is None and b.is_meta:
            v = orig_buffers.get(path)
            if v is None:
                raise ValueError(f"{path}: no value in the tree or the original model")
            v = v.clone() if name in owner._non_persistent_buffers_set else v
        if v is not None:
            owner._buffers[name] = v.detach()
    return untied


def _same(a, b) -> bool:
    """Whether two tree values hold the same tensor (the same object or storage, or equal values)."""
    if a is b:
        return True
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype):
        return False
    return a.data_ptr() == b.data_ptr() or bool(torch.equal(a, b))


def _check_activations(model: nn.Module, quantized: Mapping, activations: Mapping | None) -> None:
    """Each activation site names a module that is or becomes quantized, with a valid quantizer."""
    if activations is None:
        return
    if not isinstance(activations, Mapping):
        raise TypeError(f"activations must map qtransform Sites to QuantSpec/QParams, got {type(activations).__name__}")
    modules = {qt.module_of(p) for p in quantized}
    attention = None
    for site, quant in activations.items():
        if not isinstance(site, qt.Site) or site.role not in qt.spec.SITE_ROLES:
            raise TypeError(f"activations: keys must be qtransform.Site(module, role) with role in "
                            f"{list(qt.spec.SITE_ROLES)}, got {site!r}")
        owner, leaf = experts_slot(model, site.module)
        if owner is not None:
            if site.role != "input" or not isinstance(quant, (qt.QuantSpec, qt.QParams)):
                raise ValueError(f"activations[{site}]: a stacked experts weight takes an input quantizer (a dynamic "
                                 f"QuantSpec or static QParams), got role {site.role!r} with {type(quant).__name__}")
            continue
        try:
            module = model.get_submodule(site.module)
        except AttributeError:
            raise ValueError(f"activations: {site.module!r} is not a module of {type(model).__name__}") from None
        if site.role in qt.spec.KV_ROLES:
            attention = set(kvcache.attention_modules(model)) if attention is None else attention
            if site.module not in attention:
                raise ValueError(f"activations: {site.module!r} ({type(module).__name__}) is not an attention module "
                                 "(one that calls transformers' attention functions); key/value quantizers go there")
            try:  # a dry run on a scratch module (with the config: its head count): nothing is attached unless
                scratch = nn.Module()  # every quantizer is valid
                scratch.config = getattr(module, "config", None)
                actquant.attach(scratch, site.role, quant)
            except (TypeError, ValueError) as e:
                raise ValueError(f"activations[{site}]: {e}") from None
            continue
        if site.module not in modules and not isinstance(module, QModule):
            raise ValueError(f"activations: {site.module!r} ({type(module).__name__}) has no quantized weight; "
                             "activation quantizers go on quantized modules")
        if not isinstance(quant, (qt.QuantSpec, qt.QParams)):
            raise TypeError(f"activations[{site}]: expected a dynamic QuantSpec or static QParams, got "
                            f"{type(quant).__name__}")


def to_module(model: nn.Module, qtree: Any, *, inplace: bool = False, kernel: str = "auto") -> nn.Module:
    """A model with quantized modules where ``qtree`` holds QTensors (see module docstring).

    Args:
        model: the float (or already partly quantized) model giving the structure.
        qtree: a :class:`~bridge.tree.Quantized` result (:func:`bridge.quantize_params`; its changed
            tensors, with its plan, activation quantizers, online rotations and step outputs), or a tree
            ``{path: Tensor | QTensor}`` (e.g. ``qt.quantize_tree(bridge.extract(model), recipe)``).
        inplace: modify ``model`` itself instead of returning a new model.
        kernel: kernel request for every new quantized module (``"auto"`` or e.g. ``"dequant"``).

    Returns:
        The quantized model (``model`` itself when ``inplace``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    plan, activations, online, outputs = None, None, None, {}
    if isinstance(qtree, Quantized):
        qtree, plan, activations, online, outputs = (qtree.changed(), qtree.plan, qtree.activations, qtree.online,
                                                     qtree.outputs)
    leaves = qt.flatten_tree(qtree)
    known = set(model.state_dict())
    unknown = sorted(p for p in leaves if p not in known)
    if unknown:
        raise ValueError(f"to_module: tree paths not in the model: {unknown[:5]}"
                         + (f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else ""))
    quantized = {p: v for p, v in leaves.items() if isinstance(v, QTensor)}
    for path, q in quantized.items():  # every path checked before anything is replaced
        check_replacement(model, path, q)
    _check_activations(model, quantized, activations)
    if online is not None:
        online_mod.check(model, online)
    target = model if inplace else meta_skeleton(model)
    for path, q in quantized.items():
        replace_module(target, path, q, kernel)
    plain = {p: v for p, v in leaves.items() if not isinstance(v, QTensor)}
    untied = _assign(target, plain, None if inplace else model)
    if untied:  # the rebuild hooks (transformers' tie map and config) see which names were untied
        target._qt_untied = sorted(untied)
    for site, quant in (activations or {}).items():
        owner, leaf = experts_slot(target, site.module)
        if owner is not None:
            owner.set_input_quant(leaf, quant)
        elif site.role in qt.spec.KV_ROLES:
            actquant.attach(target.get_submodule(site.module), site.role, quant)
        else:
            target.get_submodule(site.module).set_activation(site.role, quant)
    fused_paths_off(target)  # nn.TransformerEncoderLayer's fused path reads weights as tensors
    online_mod.install_online_rotations(target, online or {})
    attach_outputs(target, outputs)
    kvcache.route_attention(target)
    for hook in REBUILD_HOOKS.values():
        hook(target, quantized, plan)
    for path in quantized:  # kernels chosen and packed now, not inside a first (compiled) forward
        submodule(target, path)[0].prepare()
    return target

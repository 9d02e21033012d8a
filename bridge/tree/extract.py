"""Module -> parameter tree.

``extract(model)`` returns the state-dict tree ``{path: tensor}`` (the model's own tensors,
detached, no copies), usable with ``torch.func.functional_call(model, params, args)``.
Quantized modules contribute their weight as one :class:`~qtransform.QTensor` leaf, so
``extract`` of a quantized model is the quantized tree that :func:`bridge.save` writes.
``module_types(model)`` maps each path to its module's class name, for
``Recipe.type_rules``. Tensors appear as stored: GPT-2's ``Conv1D`` weights are (in, out), so a
spec given straight to ``qt.quantize_tree`` over this tree applies to that stored layout;
:func:`bridge.plan` and :func:`bridge.quantize` apply it to the logical (out, in) layout, as for
``Linear`` (see :mod:`bridge.tree.logical`).

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
>>> params = extract(model)
>>> sorted(params), module_types(model)["0.weight"]
(['0.bias', '0.weight', '1.bias', '1.weight'], 'Linear')
>>> torch.func.functional_call(model, params, (torch.ones(1, 4),)).shape
torch.Size([1, 3])
"""

from __future__ import annotations

from torch import nn

from ..modules import QModule, quantized_class
from ..modules.experts import QExperts, expert_weights, is_experts
from ..modules.mha import MHA_TYPE, QMultiheadAttention, in_proj_names, is_mha

__all__ = ["extract", "module_types", "weight_paths", "tie_groups", "unsupported_experts"]


def _check(model):
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def extract(model: nn.Module) -> dict:
    """The parameter tree of ``model``: state-dict paths -> tensors (QTensor for quantized weights)."""
    _check(model)
    out = {}
    qmods = {name: m for name, m in model.named_modules() if isinstance(m, QModule)}
    skip = set()
    for name, m in qmods.items():
        prefix = f"{name}." if name else ""
        out[prefix + "weight"] = m.qweight
        skip.update(prefix + n for n in m._qnames)
    for name, m in model.named_modules():
        if isinstance(m, (QExperts, QMultiheadAttention)):
            prefix = f"{name}." if name else ""
            for w in m.quantized_names:
                out[prefix + w] = m.qtensor(w)
                skip.update(prefix + n for n in m._qmeta[w][3])
    for path, t in model.state_dict(keep_vars=True).items():
        if path not in skip:
            out[path] = t.detach()
    return out


_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "num_routed_experts", "n_shared_experts",
                  "total_experts")


def _moe_like(m: nn.Module) -> bool:
    return any(isinstance(getattr(m, a, None), int) for a in _EXPERT_COUNTS) or "Expert" in type(m).__name__


def unsupported_experts(model: nn.Module) -> dict[str, str]:
    """``{path: why}`` for the expert weights of ``model`` that qtransform cannot quantize: stacked (3-D) weights
    of a module without transformers' standard experts interface (``bridge.modules.experts``: JetMoe's parallel
    experts, Llama 4's, Longcat's with zero experts...) and embeddings used as experts (Doge). A recipe that
    selects them is refused by name (``bridge.plan``); they can be kept in float explicitly."""
    _check(model)
    out = {}
    for name, m in model.named_modules():
        prefix = f"{name}." if name else ""
        if is_experts(m) or isinstance(m, (nn.modules.conv._ConvNd, QModule)) or not _moe_like(m):
            continue
        for key, p in m.named_parameters(recurse=False):
            if p.is_floating_point() and p.dim() >= 3:
                out[prefix + key] = (f"a {tuple(p.shape)} stack of expert weights in {type(m).__name__}, which lacks "
                                     "transformers' standard experts interface (use_experts_implementation)")
        for child, c in m.named_children():
            if isinstance(c, nn.Embedding) and c.num_embeddings == getattr(m, "num_experts", None):
                out[f"{prefix}{child}.weight"] = (f"an embedding of {c.num_embeddings} expert vectors in "
                                                  f"{type(m).__name__} (product-key experts)")
    return out


def _outputs(m: nn.Module) -> int | None:
    """The output width of a linear layer, float or quantized (``None`` for any other module)."""
    if isinstance(m, nn.Linear):
        return m.out_features
    return m.weight_shape[0] if isinstance(m, QModule) and not m.transposed and m.weight_shape else None


_ROUTED_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "num_routed_experts", "total_experts")


def _routers(model: nn.Module) -> set[str]:
    """Module paths of the routers of mixture-of-experts layers: linear siblings of an experts module that score
    the experts (``num_experts`` outputs) or gate a shared expert (one output), and the one linear layer of a
    router module beside the experts that scores them (LongCat-Flash's ``router.classifier``, whose outputs also
    count its zero-computation experts: the router's ``n_routed_experts``; Ergo's ``gate.linear``)."""
    out = set()
    for name, m in model.named_modules():
        n = getattr(m, "num_experts", None)
        if isinstance(n, int) and not is_experts(m) and _moe_like(m):  # a block holding its router (Doge)
            out.update(f"{name}.{child}" if name else child for child, c in m.named_children()
                       if isinstance(c, nn.Linear) and c.out_features == n)
        if is_experts(m) and "." in name:
            parent = name.rpartition(".")[0]
            for child, c in model.get_submodule(parent).named_children():
                if _outputs(c) in (m.num_experts, 1):
                    out.add(f"{parent}.{child}")
                elif c is not m and _outputs(c) is None:
                    linears = [(k, sub) for k, sub in c.named_children() if _outputs(sub) is not None]
                    counts = {m.num_experts} | {getattr(c, a) for a in _ROUTED_COUNTS
                                                if isinstance(getattr(c, a, None), int)}
                    if len(linears) == 1 and _outputs(linears[0][1]) in counts:
                        out.add(f"{parent}.{child}.{linears[0][0]}")
    return out


def module_types(model: nn.Module) -> dict[str, str]:
    """``{path: module class name}`` for every state-dict path (quantized modules by their float name); the
    stacked weights of experts modules are ``"Experts"``, the routers of their layers ``"Router"``."""
    _check(model)
    owners = {p: "Experts" for p in unsupported_experts(model)}
    routers = _routers(model)
    for name, m in model.named_modules():
        prefix = f"{name}." if name else ""
        kind = type(m).__name__
        if isinstance(m, QModule):
            kind = "Conv1D" if m.transposed else kind.removeprefix("Q")
        if isinstance(m, QMultiheadAttention):
            kind = MHA_TYPE
        if name in routers:
            kind = "Router"
        for w in expert_weights(m):
            owners[prefix + w] = "Experts"
        local = [n for n, p in m._parameters.items() if p is not None]
        local += [n for n, b in m._buffers.items() if b is not None and n not in m._non_persistent_buffers_set]
        for key in local:
            owners.setdefault(prefix + key, kind)
    return owners


def weight_paths(model: nn.Module) -> dict[str, nn.Module]:
    """``{"<module>.weight": module}`` for every module a quantized module can replace,
    ``{"<experts>.gate_up_proj": experts module, ...}`` for the stacked weights of experts modules, and
    ``{"<mha>.in_proj_weight": attention module}`` for the in-projection weights of multi-head attention."""
    _check(model)
    out = {(f"{name}." if name else "") + "weight": m for name, m in model.named_modules()
           if quantized_class(m) is not None}
    out.update({(f"{name}." if name else "") + w: m for name, m in model.named_modules() for w in expert_weights(m)})
    out.update({(f"{name}." if name else "") + w: m for name, m in model.named_modules() if is_mha(m)
                for w in in_proj_names(m)})
    return out


def tie_groups(model: nn.Module) -> list[list[str]]:
    """The paths of each parameter or buffer of ``model``, one list per tensor object (tied weights
    share one; the first path is the one ``state_dict`` keeps)."""
    groups: dict[int, list[str]] = {}
    for path, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        groups.setdefault(id(t), []).append(path)
    return list(groups.values())

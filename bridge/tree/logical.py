"""Linear layers in their logical (out, in) layout, whatever layout stores them.

transformers' ``Conv1D`` (GPT-2's ``c_attn``, ``c_fc``, ``c_proj``) is a linear layer whose weight
is stored (in, out). A recipe speaks of every linear layer as ``nn.Linear`` does:

* its specs apply to the logical (out, in) weight: ``PerChannel(0)`` is one scale per *output*
  feature, ``PerGroup(g)`` groups ``g`` input features, ``PerBlock((a, b))`` tiles ``a`` outputs by
  ``b`` inputs, on a ``Conv1D`` exactly as on the ``nn.Linear`` holding the same weight;
* its ``Linear`` type rules select ``Conv1D`` weights too (a ``Conv1D`` type rule, when the recipe
  has one, wins for them: :data:`TYPE_FALLBACK`).

:func:`model_plan` resolves a recipe for a model that way. The tree keeps the tensors as stored
(``extract`` is the state dict, ``functional_call`` works on it); the plan gives a stored-transposed
weight the spec of the *stored* tensor (:func:`qtransform.transposed_spec`, axes swapped), so the steps,
``quantize_tree``, the quantized modules and checkpoints all work on the tensor as stored, with the
grid an ``nn.Linear`` gets. Checkpoints record that stored spec, so files written before this rule
(whose ``Conv1D`` specs described the stored tensor) load unchanged.

>>> import torch, qtransform as qt
>>> spec = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
>>> str(qt.transposed_spec(spec, (32, 64)).granularity)
'PerChannel(axis=1)'
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

import qtransform as qt

from ..modules import QLinear, is_conv1d, register_quantized_class
from ..modules.experts import is_experts, stacked_like
from ..modules.kvcache import attention_modules
from ..modules.mha import MHA_TYPE, OUT_TYPE, in_proj_names, is_mha
from .extract import module_types, weight_paths
from .standins import keep_read_weights

__all__ = ["TYPE_FALLBACK", "LINEAR_AS_BASE", "stored_transposed", "model_plan"]

#: ``{module type: type whose rules it follows when the recipe has no rule for it}``: a ``Linear`` rule
#: reaches GPT-2's ``Conv1D`` and the stacked ``Experts`` weights of mixture-of-experts layers (each expert is
#: a linear layer), unless the recipe has a rule of their own (``type_rules={"Experts": None}`` keeps them).
#: ``nn.Linear`` subclasses of transformers' models whose forward computes ``nn.Linear``'s ``x @ W.T + b``, written out
#: (Falcon's): a ``Linear`` rule reaches them and a quantized Linear replaces them exactly (other subclasses are kept
#: in float, said why: :func:`_subclasses`).
LINEAR_AS_BASE = ("FalconLinear",)
TYPE_FALLBACK = {"Conv1D": "Linear", "Experts": "Linear", OUT_TYPE: "Linear", **{name: "Linear" for name in LINEAR_AS_BASE}}
register_quantized_class("LinearAsBase", lambda m: isinstance(m, nn.Linear) and type(m).__name__ in LINEAR_AS_BASE,
                         QLinear)


def stored_transposed(module: nn.Module) -> bool:
    """Whether ``module`` stores its linear weight (in, out): a ``Conv1D``, or the ``QLinear`` replacing one."""
    return is_conv1d(module) or (isinstance(module, QLinear) and module.transposed)


def _stacked(path: str, m: qt.Match, module: nn.Module, stored: tuple[int, ...]) -> qt.QuantSpec:
    """The stored spec of a stacked experts weight whose recipe spec describes each expert's (out, in) matrix."""
    name = path.rpartition(".")[2]
    logical, flip = stacked_like(module, name)
    spec = m.spec
    try:
        qt.bits_per_element(spec, logical[1:])  # the matrix spec fits one expert's (out, in) matrix
        spec = qt.stacked_spec(qt.transposed_spec(spec, logical[1:]) if flip else spec, stored)
        qt.bits_per_element(spec, stored)
    except ValueError as e:
        raise ValueError(f"{path}: recipe {m.rule} ({m.spec}): {e}; an Experts weight {stored} holds {stored[0]} "
                         f"matrices {logical[1:]} (out, in), and specs apply to each as to a Linear weight") from None
    return spec


#: the torch classes a quantized module replaces; their subclasses take their type rules (unless one names them)
_BASES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
          nn.Embedding, nn.EmbeddingBag)


def _subclasses(model: nn.Module, recipe: qt.Recipe, tree: Mapping, named: set) -> dict:
    """``{path: Match}`` of the weights of subclasses of the replaceable torch classes (DeepSeek-V4's grouped
    ``nn.Linear``) that a rule for their base class would select: kept in float and said why (a quantized module
    replaces the torch class itself, not a subclass that may compute something else), never silently."""
    out = {}
    for name, mod in model.named_modules():
        base = next((b for b in _BASES if isinstance(mod, b) and type(mod) is not b), None)
        path = f"{name}.weight" if name else "weight"
        if base is None or path not in tree or type(mod).__name__ in named or type(mod).__name__ in TYPE_FALLBACK:
            continue
        m = recipe.resolve(path, module_type=base.__name__, ndim=tree[path].dim(), floating=tree[path].is_floating_point())
        if m.spec is not None and not m.rule.startswith("rules["):
            how = "overrides its forward" if type(mod).forward is not base.forward else "is its own class"
            out[path] = qt.Match(None, f"skipped ({type(mod).__name__}, a subclass of {base.__name__}, {how}: a quantized "
                                 f"{base.__name__} would replace it; kept in float)", type(mod).__name__)
    return out


def _attention_types(model: nn.Module, named: set) -> tuple[dict[str, str], set[str]]:
    """The rule types of the tensors of ``nn.MultiheadAttention`` modules (:mod:`bridge.modules.mha`): its
    in-projection weights follow ``MultiheadAttention`` rules, else ``Linear`` ones; ``out_proj`` follows
    ``NonDynamicallyQuantizableLinear`` rules, else ``MultiheadAttention``, else ``Linear`` ones. Also the paths of
    its tensors that are no projection weight (``bias_k``, ``bias_v``: no type rule quantizes them)."""
    lookup, others = {}, set()
    inner = MHA_TYPE if MHA_TYPE in named else "Linear"
    outer = OUT_TYPE if OUT_TYPE in named else inner
    for name, m in model.named_modules():
        if not is_mha(m):
            continue
        prefix = f"{name}." if name else ""
        lookup.update({prefix + w: inner for w in in_proj_names(m)})
        lookup.update({f"{prefix}out_proj.{w}": outer for w in ("weight", "bias")})
        others.update(prefix + w for w in ("bias_k", "bias_v"))
    return lookup, others


def model_plan(model: nn.Module, recipe: qt.Recipe, tree: Mapping[str, torch.Tensor]) -> qt.Plan:
    """``recipe`` resolved for ``model``'s tree ``tree`` (its :func:`~bridge.extract`), with module
    types (``Linear`` rules reaching ``Conv1D``) and the specs of stored-transposed weights turned to
    their stored layout (see the module docstring). ``ValueError`` names a path whose spec does not
    fit its logical (out, in) shape."""
    types = module_types(model)
    named = {t for t, _ in recipe.type_rules}
    lookup = {p: TYPE_FALLBACK[t] if t in TYPE_FALLBACK and t not in named else t for p, t in types.items()}
    attention, not_weights = _attention_types(model, named)
    lookup.update(attention)
    resolved = recipe.plan(tree, types=lookup, attention=attention_modules(model))
    owners = weight_paths(model)
    transposed = {p for p, m in owners.items() if stored_transposed(m)}
    matches = {}
    for path, m in resolved.items():
        spec = m.spec
        if spec is not None and types.get(path) == "Experts" and path in owners and is_experts(owners[path]):
            spec = _stacked(path, m, owners[path], tuple(tree[path].shape))
        elif spec is not None and path in transposed and tree[path].dim() == 2:
            logical = tuple(tree[path].shape[::-1])
            try:
                qt.bits_per_element(spec, logical)
            except ValueError as e:
                raise ValueError(f"{path}: recipe {m.rule} ({spec}): {e}; a {types.get(path)} weight is stored "
                                 f"(in, out) = {tuple(tree[path].shape)}, specs apply to its (out, in) layout "
                                 f"{logical} as for Linear") from None
            spec = qt.transposed_spec(spec, logical)
        if spec is not None and path in not_weights and m.rule.startswith("type_rules["):
            matches[path] = qt.Match(None, f"skipped ({path.rpartition('.')[2]} of a MultiheadAttention is no "
                                     "projection weight; a type rule leaves it in float)", types.get(path))
            continue
        matches[path] = qt.Match(spec, m.rule, types.get(path))
    matches.update(_subclasses(model, recipe, tree, named))
    matches.update(keep_read_weights(model, recipe, matches, tree))  # Mamba's dt_proj.weight @ ..., RWKV's rescaling
    flipped = [p for p, m in owners.items() if types.get(p) == "Experts" and is_experts(m) and stacked_like(m, p.rpartition(".")[2])[1]]
    return qt.Plan(recipe, matches, attention=resolved.attention, transposed_experts=flipped)

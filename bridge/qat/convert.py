"""``convert(prepared)``: the quantized model whose codes and scales are exactly those the trained fake
quantizers used.

Each weight fake quantizer's learned range becomes its stored parameters (``learn.to_qparams``: the very
parameters its forward quantized with), its parametrization is removed keeping the trained float weight, and
the model is quantized by the one pipeline with those parameters (``qt.quantize_tree(..., qparams=...)``, the
recipe's steps not run again: they ran before training, in :func:`bridge.qat.prepare`), then rebuilt by
:func:`bridge.to_module`. Static activation ranges become the modules' static quantizers, dynamic ones stay
specs, online rotations are installed on the quantized modules. So the quantized model's forward with the
``"dequant"`` kernel is the trained fake model's, bit for bit, and it saves, loads back (:func:`bridge.load`,
``from_pretrained``) and exports as any model :func:`bridge.quantize` made; the checkpoint records the recipe as
given to ``prepare``.

>>> import torch, qtransform as qt
>>> from bridge.qat import prepare
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
>>> fake = prepare(model, qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)))
>>> q = convert(fake, kernel="dequant")
>>> x = torch.randn(3, 64)
>>> [type(m).__name__ for m in q], torch.equal(q(x), fake(x))
(['QLinear', 'ReLU', 'QLinear'], True)
"""

from __future__ import annotations

import copy
import dataclasses

from torch import nn

import qtransform as qt
from qtransform import learn

from ..modules.online import online_rotations
from ..modules.online import remove as remove_online
from ..tree import Quantized, extract, to_module
from .prepare import STATE, prepared_plan
from .quantizers import ACT_NAMES, ActFakeQuant, detach_activation, detach_weight, weight_quantizer

__all__ = ["convert", "learned_qparams"]


def learned_qparams(model: nn.Module) -> tuple[dict, dict]:
    """``({weight path: QParams}, {Site: dynamic QuantSpec | static QParams})``: what ``model``'s fake quantizers
    quantize with now (paths and sites named as in ``model``)."""
    weights, activations = {}, {}
    for name, m in model.named_modules():
        fq = weight_quantizer(m)
        if fq is not None:
            path = f"{name}.weight" if name else "weight"
            weights[path] = learn.to_qparams(fq.learned(), path=path)
        for role, attr in ACT_NAMES.items():
            aq = m._modules.get(attr)
            if isinstance(aq, ActFakeQuant):
                site = qt.Site(name, role)
                activations[site] = aq.spec if aq.spec.dynamic else learn.to_qparams(aq.learned(), path=str(site))
    return weights, activations


def _check_same(what: str, have, want) -> None:
    missing, extra = sorted(map(str, set(want) - set(have))), sorted(map(str, set(have) - set(want)))
    if missing or extra:
        raise ValueError(f"model: its {what} fake quantizers are not those prepare put there (missing {missing[:3]}, "
                         f"unknown {extra[:3]}): a wrapper renamed its modules (peft: merge or unwrap it first), or "
                         "quantizers were removed")


def convert(model: nn.Module, *, inplace: bool = False, kernel: str = "auto") -> nn.Module:
    """The quantized model of a prepared ``model`` (see the module docstring).

    Args:
        model: a model :func:`bridge.qat.prepare` returned (trained or not).
        inplace: convert ``model`` itself; by default a deep copy is converted and ``model`` is left alone.
        kernel: the kernel request of every quantized module (``"auto"``, or ``"dequant"`` for the reference
            forward that equals the fake-quantized one bit for bit).

    Returns:
        The quantized model, as :func:`bridge.quantize` returns one.

    ``TypeError`` for a model that is not a module, ``ValueError`` naming ``model`` for one that is not prepared
    or whose quantizers are not those prepare put there.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    p = prepared_plan(model)
    if not isinstance(p, qt.Plan):
        raise ValueError(f"model: this {type(model).__name__} was not prepared by bridge.qat.prepare (it has no fake "
                         "quantizers to convert); bridge.quantize quantizes a float model")
    weights, activations = learned_qparams(model)  # checked on the model as given: nothing copied before
    _check_same("weight", weights, p.specs)
    _check_same("activation", activations, p.activations)
    target = model if inplace else copy.deepcopy(model)
    online = online_rotations(target)  # installed by prepare after rotation steps: the quantized model's too
    remove_online(target, online)
    for name, m in list(target.named_modules()):
        if weight_quantizer(m) is not None:
            detach_weight(m)
        for role in ACT_NAMES:
            detach_activation(m, role)
    delattr(target, STATE)
    params = extract(target)
    weights_only = p.replace(recipe=dataclasses.replace(p.recipe, steps=()))  # the steps ran in prepare
    qtree = qt.quantize_tree(params, weights_only, qparams=weights)
    return to_module(target, Quantized(params, qtree, p, activations, online=online), inplace=True, kernel=kernel)

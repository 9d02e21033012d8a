"""``prepare(model, recipe)``: a float model made trainable under quantization, in the user's own training loop.

The recipe is resolved as :func:`bridge.quantize` resolves it (:func:`bridge.plan`: module types, GPT-2's
transposed ``Conv1D``, the tensors a model keeps in float); every weight the plan quantizes gets a
:class:`~bridge.qat.quantizers.WeightFakeQuant` (a parametrization: the module's float weight stays its
trainable parameter, the learned range is the parametrization's), and every activation site of the plan an
:class:`~bridge.qat.quantizers.ActFakeQuant`. Untrained, the prepared model computes exactly what
``bridge.quantize(model, recipe)`` computes with the ``"dequant"`` kernel: its ranges start where round to
nearest starts (``learn.learnable``: the min-max of each block).

Recipes with steps (GPTQ, AWQ, SmoothQuant, SignRound, HQQ, an ``rtn`` step with another observer...) run
their steps first, once, through :func:`bridge.quantize_params` with ``calibration``: training starts from the
steps' result, each quantized weight at its dequantized value (on the steps' grid) and each range the one the
steps' parameters stand for (``learn.from_qparams``); tensors the steps rewrite (a smoothed norm) are taken as
they rewrote them, and the online rotations they record (QuaRot's, SpinQuant's) are installed on the prepared
model as :func:`bridge.to_module` installs them. Steps that make outputs beside the tensors (``lowrank``'s
corrections) are refused by name: the prepared model would not compute what the steps made.
Static activation specs start from ranges calibrated on ``calibration`` (the ``minmax`` observer, with the
weights quantized, as :func:`bridge.quantize` calibrates them) and are refused without it.

>>> import torch, qtransform as qt
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
>>> fake = prepare(model, qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)))
>>> type(fake[0].parametrizations.weight[0]).__name__, type(model[0]).__name__
('WeightFakeQuant', 'Linear')
"""

from __future__ import annotations

import copy
from typing import Iterable

from torch import nn
from torch.nn.utils import parametrize

import qtransform as qt
from qtransform import learn

from ..modules import QModule
from ..modules.experts import QExperts
from ..modules.online import install_online_rotations
from ..pipeline import nothing_selected, plan, quantize_params
from ..tree import tie_groups, weight_paths
from .quantizers import ACT_NAMES, ActFakeQuant, WeightFakeQuant, attach_activation, attach_weight, weight_quantizer
from .start import start_from_steps, static_range

__all__ = ["prepare", "prepared_plan", "quantizer_parameters", "STATE"]

#: The attribute of a prepared model holding its plan (what :func:`bridge.qat.convert` quantizes by).
STATE = "_qt_qat_plan"

#: Module types whose activations keep their layout (no (tokens, features) matrix).
_CONV = ("Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d")


def resolve_recipe(recipe):
    """A recipe as :func:`bridge.plan` takes it: a preset name becomes its recipe; other types are refused."""
    if isinstance(recipe, str):
        try:
            return qt.get_preset(recipe).recipe
        except ValueError as e:
            raise ValueError(f"recipe: {e}") from None
    if not isinstance(recipe, (qt.Recipe, qt.QuantSpec, qt.Plan)):
        raise TypeError(f"recipe must be a qtransform Recipe, QuantSpec, Plan or a preset name (str), got "
                        f"{type(recipe).__name__}")
    return recipe


def prepared_plan(model: nn.Module) -> qt.Plan | None:
    """The plan ``model`` was prepared for (:func:`prepare`), or ``None``."""
    return getattr(model, STATE, None)


def quantizer_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The learned ranges (``lo``, ``hi``) of ``model``'s fake quantizers, e.g. for their own optimiser group
    (a learning rate of their own, no weight decay)."""
    return [p for m in model.modules() if isinstance(m, (WeightFakeQuant, ActFakeQuant))
            for p in m.parameters(recurse=False) if p.requires_grad]


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for name, m in model.named_modules():
        if isinstance(m, (QModule, QExperts)):
            raise ValueError(f"model: already quantized ({name or 'the model'} is a {type(m).__name__}); prepare "
                             "the float model")
        if prepared_plan(m) is not None or weight_quantizer(m) is not None or any(n in m._modules
                                                                                 for n in ACT_NAMES.values()):
            raise ValueError(f"model: already prepared by bridge.qat.prepare ({name or 'the model'} has fake "
                             "quantizers); train it, then bridge.qat.convert it")


def _check_plan(model: nn.Module, p: qt.Plan, calibrated: bool) -> None:
    """Everything prepare refuses, before any step runs or anything is copied."""
    if not p.specs:
        raise ValueError(f"recipe: {nothing_selected(model, p)}")
    dynamic = [(path, p[path]) for path, spec in p.specs.items() if spec.dynamic]
    if dynamic:
        path, m = dynamic[0]
        raise ValueError(f"recipe: {path}: {m.rule} gives a dynamic weight spec ({m.spec}), whose parameters are "
                         "fitted to each input at run time: there is no range to train; use a static weight spec")
    experts = [path for path, m in p.items() if m.spec is not None and m.module_type == "Experts"]
    if experts:
        raise ValueError(f"recipe: {experts[0]} is a stacked mixture-of-experts weight, which bridge.qat does not "
                         "train; keep it in float (type_rules={'Experts': None}) or quantize with bridge.quantize")
    if getattr(p.recipe, "kv_cache", None) is not None:
        raise ValueError("recipe.kv_cache: bridge.qat does not train key/value cache quantizers; drop kv_cache, "
                         "or quantize with bridge.quantize")
    qt.check_steps(p.steps, calibrated=calibrated)  # a step needing data is named first
    outputs = [f"{s.name} ({', '.join(qt.get_algorithm(s.name).outputs)})" for s in p.steps
               if qt.get_algorithm(s.name).outputs]
    if outputs:
        raise ValueError(f"recipe.steps: {outputs} make step outputs beside the quantized tensors, which bridge.qat "
                         "does not train; quantize with bridge.quantize, or drop that step")
    for group in tie_groups(model):
        specs = {path: p.specs[path] for path in group if path in p.specs}
        if len(set(specs.values())) > 1:
            raise ValueError(f"recipe: the tied weights {list(specs)} get different specs "
                             f"({[str(s) for s in specs.values()]}); bridge.qat gives tied weights one quantizer")
    owners = weight_paths(model)
    for path in p.specs:
        if parametrize.is_parametrized(owners[path], "weight"):
            raise ValueError(f"model: {path} is already parametrized ({owners[path].parametrizations.weight}); "
                             "bridge.qat parametrizes the plain weights it quantizes")
    conv = {s: kind for role in ACT_NAMES for s, paths in p.sites(role).items() for path in paths
            if (kind := p[path].module_type) in _CONV}
    static = []
    for site, spec in p.activations.items():
        if spec.dynamic:
            continue
        g = spec.granularity
        fits = isinstance(g, qt.PerTensor) or (isinstance(g, qt.PerChannel) and
                                               g.axis in ((1, -1 - int(conv[site][-2])) if site in conv else (1, -1)))
        if not fits:
            raise ValueError(f"recipe: the static activation spec of {site.module} ({site.role}), {spec}, is not one "
                             "range per tensor or per feature; bridge.qat learns static ranges shared by every "
                             "token: use PerTensor / PerChannel(-1), or dynamic=True")
        static.append(f"{site.module} ({site.role})")
    if static and not calibrated:
        raise ValueError(f"calibration: the recipe's static activation specs ({static[:2]}"
                         f"{' ...' if len(static) > 2 else ''}) need a calibrated range to start from: pass "
                         "calibration=batches to bridge.qat.prepare, or use dynamic=True activation specs")


def _conv_sites(p: qt.Plan) -> dict:
    return {s: p[path].module_type in _CONV for role in ACT_NAMES for s, paths in p.sites(role).items()
            for path in paths}


def prepare(model: nn.Module, recipe, *, inplace: bool = False, calibration: Iterable | None = None,
            zero_point: str = "ste", act_observer=None) -> nn.Module:
    """``model`` with trainable fake quantizers where ``recipe`` quantizes (see the module docstring).

    Args:
        model: a float model (not quantized, not prepared already).
        recipe: a :class:`~qtransform.Recipe`, a :class:`~qtransform.QuantSpec` or a preset name
            (``"int4-g128-asym"``).
        inplace: change ``model`` itself; by default a deep copy is prepared and ``model`` is left alone.
        calibration: batches (as :func:`bridge.quantize` takes them) for the recipe's steps and the starting
            ranges of static activation specs.
        zero_point: how an integer zero point's rounding is differentiated (``learn.ZERO_POINTS``).
        act_observer: the observer of the static activation ranges' start (``"minmax"`` by default).

    Returns:
        The prepared model; :func:`bridge.qat.convert` turns it into the quantized model.

    ``TypeError`` / ``ValueError`` naming the argument for: a recipe of another type, one that selects nothing,
    a dynamic weight spec, a key/value cache spec, stacked experts weights, a static activation spec without
    ``calibration`` (or whose range would differ per token), steps with step outputs, a
    model already quantized or prepared.
    """
    _check_model(model)
    if zero_point not in learn.ZERO_POINTS:
        raise ValueError(f"zero_point must be one of {list(learn.ZERO_POINTS)}, got {zero_point!r}")
    recipe = resolve_recipe(recipe)
    p = plan(model, recipe)
    _check_plan(model, p, calibration is not None)
    result = None
    if p.steps or any(not s.dynamic for s in p.activations.values()):
        result = quantize_params(model, p, calibration=calibration, act_observer=act_observer)
    conv, acts = _conv_sites(p), {}  # every quantizer made before anything is written
    for site, spec in p.activations.items():
        tokens, name = not conv.get(site, False), f"{site.module} ({site.role})"
        r = None if spec.dynamic else static_range(result.activations[site], tokens=tokens, site=name)
        acts[site] = ActFakeQuant(spec, tokens=tokens, r=r, site=name, zero_point=zero_point)
    target = model if inplace else copy.deepcopy(model)
    ranges = start_from_steps(target, result) if p.steps else {}  # checked all, then written
    owners = weight_paths(target)
    weights: dict[str, WeightFakeQuant] = {}
    by_tensor: dict[int, WeightFakeQuant] = {}  # tied weights share one quantizer (and stay tied)
    for path, spec in p.specs.items():
        w = owners[path].weight
        if id(w) not in by_tensor:
            r = ranges[path] if path in ranges else learn.learnable(w, spec, path=path)
            by_tensor[id(w)] = WeightFakeQuant(r, path=path, zero_point=zero_point)
        weights[path] = by_tensor[id(w)]
    if result is not None and result.online:  # QuaRot's online Hadamards, before the input quantizers
        install_online_rotations(target, result.online)
    for path, fq in weights.items():
        attach_weight(owners[path], fq)
    for site, aq in acts.items():
        attach_activation(target.get_submodule(site.module), site.role, aq)
    setattr(target, STATE, p)
    return target

"""The bridge's pipeline: model -> tree -> plan -> steps (calibrated on the model) -> quantized tree -> modules.

One pipeline serves :func:`quantize`, the command line and the benchmarks; quantize-on-load runs
the same steps one tensor at a time (:mod:`bridge.hf`). Each arrow is a function:
:func:`bridge.extract`, :func:`plan`, :func:`qtransform.quantize_tree` (which runs the recipe's
steps, with a :class:`~bridge.calibrate.ModelCalibrator` for the steps that need data), and
:func:`bridge.to_module`, which turns the pipeline's result (:class:`Quantized`) into a model.

>>> import torch, qtransform as qt
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
>>> qmodel = quantize(model, qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)))
>>> [type(m).__name__ for m in qmodel], type(model[0]).__name__
(['QLinear', 'ReLU', 'QLinear'], 'Linear')
"""

from __future__ import annotations

import inspect
import re
from collections import Counter
from typing import Callable, Iterable, Mapping

from torch import nn

import qtransform as qt

from .arch import model_groups, model_layout, residual_layout, smoothing_groups, towers
from .calibrate import ModelCalibrator
from .fx import fold_batchnorm as _fold_batchnorm
from .modules.mha_model import calling_view, check_sites
from .tree import Quantized, extract, model_plan, to_module, unsupported_experts, weight_paths

__all__ = ["plan", "prepare", "calibrate_activations", "nothing_selected", "check_calibration", "Quantized", "quantize_params", "quantize"]


def plan(model: nn.Module, recipe, *, tree: Mapping | None = None) -> qt.Plan:
    """The recipe resolved once for ``model``'s whole tree (with module types, for ``type_rules``; linear
    layers in their logical (out, in) layout: a ``Linear`` rule and its spec mean the same on GPT-2's
    ``Conv1D``, see :func:`bridge.tree.model_plan`).

    Only weights of modules a quantized module can replace (Linear, transformers' Conv1D, Conv1d/2d/3d,
    ConvTranspose1d/2d/3d, Embedding, EmbeddingBag; the projection weights of MultiheadAttention, see
    :mod:`bridge.modules.mha`) can be quantized: another tensor that the recipe's
    ``default`` would select is left in full precision (rule ``"skipped (...)"``); one that an
    explicit rule selects is an error naming it. An embedding's input (token ids) is never quantized: the
    recipe's ``input`` spec and ``act_rules`` globs leave it alone, an ``act_rules`` entry naming it
    (``"emb:input"``) is an error naming it. A multimodal model's vision or audio towers and projectors
    (:func:`bridge.arch.towers`) stay in float unless a glob rule (``rules``) selects them. Every selected spec is checked against its
    tensor's shape here, before any work: a group that does not divide its axis (without
    ``pad=True``) is a ``ValueError`` naming the path and the rule.

    The plan carries the model's facts from :mod:`bridge.arch` once: ``groups`` (the smoothing groups) and
    ``layout`` (the residual layout), each ``None`` where no architecture table fits the model (a plan
    given keeps its own where it has them). The recipe is left as given: checkpoints record only the
    user's choices. ``tree``: ``extract(model)`` when the caller has it already (not extracted again).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    given = isinstance(recipe, qt.Plan)  # resolved upstream: checked against this model, not re-resolved
    tree = extract(model) if tree is None else tree
    resolved = qt.as_plan(recipe, tree) if given else model_plan(model, qt.as_recipe(recipe), tree)
    if getattr(resolved.recipe, "kv_cache", None) is not None and not resolved.attention:
        raise ValueError(f"Recipe.kv_cache quantizes the key/value cache, but the plan names no attention module of "
                         f"{type(model).__name__} (modules that call transformers' attention functions)")
    quantizable = set(weight_paths(model))
    unsupported = unsupported_experts(model)
    refused = [f"{p} ({unsupported[p]}; selected by {m.rule})" for p, m in resolved.items()
               if p in unsupported and m.spec is not None]
    if refused:
        raise ValueError(f"the recipe quantizes mixture-of-experts weights that qtransform cannot: {refused[:3]}"
                         + (f" and {len(refused) - 3} more" if len(refused) > 3 else "")
                         + "; keep them in float explicitly (type_rules={'Experts': None}, or exclude=[their paths])")
    keep, casts, parts = _kept_in_float32(model), _casting_callers(model), towers(model)
    matches = {}
    for path, m in resolved.items():
        tower = next((t for t in parts if path.startswith(t + ".")), None)
        if m.spec is not None and tower is not None and not m.rule.startswith("rules[") and not given:
            m = qt.Match(None, f"skipped (default: {tower}, a tower or projector of a multimodal model, stays in "
                         "float; a glob rule selects it)", m.module_type)
        kept = next((k for k in keep if f".{k}." in f".{qt.module_of(path)}."), None)
        if m.spec is not None and kept is not None and not m.rule.startswith("rules[") and not given:
            m = qt.Match(None, f"skipped ({type(model).__name__} keeps {kept} in float32: _keep_in_fp32_modules; "
                         "a glob rule selects it)", m.module_type)
        caller = casts.get(qt.module_of(path))
        if m.spec is not None and caller is not None and not given:
            if m.rule.startswith("rules["):
                raise ValueError(f"{path}: recipe {m.rule} selects a weight whose caller ({caller}.forward) casts its "
                                 "input to the weight's dtype, which a quantized module stores as integer codes; "
                                 "keep it in float")
            m = qt.Match(None, f"skipped ({caller}.forward casts its input to this weight's dtype)", m.module_type)
        if m.spec is not None and m.module_type == "Router" and m.rule == "default" and not given:
            m = qt.Match(None, "skipped (default: a mixture-of-experts router stays in float; a rule selects it)",
                         m.module_type)
        if m.spec is not None and path not in quantizable:
            if given or m.rule != "default":
                what = f"a tensor of a {m.module_type}" if m.module_type else "a tensor"
                raise ValueError(f"{path}: recipe {m.rule} selects {what} that is not the weight of a quantizable "
                                 "module; only the weights of Linear, Conv1D, Conv1d/2d/3d, ConvTranspose1d/2d/3d, "
                                 "Embedding and EmbeddingBag modules and the projection weights of "
                                 "MultiheadAttention can be quantized")
            m = qt.Match(None, "skipped (default: not the weight of a quantizable module)", m.module_type)
        if m.spec is not None:
            _check_grid(path, m, tuple(tree[path].shape))
        matches[path] = m
    resolve = getattr(resolved.recipe, "resolve_activation", None)
    named = [(qt.module_of(p), m.module_type, rule) for p, m in matches.items() if m.spec is not None and resolve
             and m.module_type in ("Embedding", "EmbeddingBag")
             and (rule := _literal_act_rule(resolved.recipe, qt.module_of(p), "input")) is not None]
    if named:
        module, kind, rule = named[0]
        raise ValueError(f"{module}: recipe act_rules[{rule}] quantizes the input of an {kind}, which is token ids, "
                         "never quantized (a recipe's input= spec or a glob leaves it alone); quantize its output, "
                         "or drop that rule")
    _check_named_sites(resolved.recipe, matches)
    outputs = [p for p, m in matches.items() if m.spec is not None and m.module_type == "Experts" and resolve
               and resolve(p, "output").spec is not None]
    if outputs:
        raise ValueError(f"{outputs[0]}: the recipe quantizes the output of a stacked experts weight; experts take input "
                         "quantizers only (their outputs are summed over the routed experts): drop the output spec for "
                         f"them (act_rules={{'*.experts.*:output': None}})")
    groups = resolved.groups if resolved.groups is not None else model_groups(model)
    layout = resolved.layout if resolved.layout is not None else model_layout(model)
    out = qt.Plan(resolved.recipe, matches, attention=resolved.attention, groups=groups, layout=layout,
                  transposed_experts=resolved.transposed_experts)
    check_sites(model, out.activations)  # what nn.MultiheadAttention's quantized form takes, named
    return out


def _kept_in_float32(model: nn.Module) -> tuple[str, ...]:
    """The module names a transformers model keeps in float32 (``_keep_in_fp32_modules``, e.g. DeepSeek-V3.2's
    ``indexer.weights_proj``, whose caller casts its input to the weight's dtype)."""
    names = []
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        value = getattr(model, attr, None)
        names += [v for v in (value or ()) if isinstance(v, str)]
    return tuple(dict.fromkeys(names))


_WEIGHT_DTYPE = re.compile(r"\bself\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\.weight\.dtype\b")


def _casting_callers(model: nn.Module) -> dict[str, str]:
    """``{module path: caller class}`` for the modules whose weight dtype a ``forward`` above them reads to cast
    activations: ``self.<child>.weight.dtype`` (DeepSeek-V3.2-style indexers' ``weights_proj``, whose input is
    cast to it) or a deeper ``self.<a>.<b>.weight.dtype`` (Ergo's decoder layer casts both branches' inputs to
    ``self.self_attn.o_proj.weight.dtype``). Quantized, that dtype would be the codes' (an integer), so such a
    weight stays in float."""
    out, sources, modules = {}, {}, dict(model.named_modules())
    for name, m in modules.items():
        cls = type(m)
        if cls not in sources:
            try:
                src = inspect.getsource(cls.forward)
            except (OSError, TypeError):
                src = ""
            sources[cls] = tuple(dict.fromkeys(_WEIGHT_DTYPE.findall(src)))
        for sub in sources[cls]:
            path = f"{name}.{sub}" if name else sub
            if path in modules:  # a submodule (not an attribute that merely has a weight)
                out[path] = cls.__name__
    return out


_FACTS = {"groups": smoothing_groups, "layout": residual_layout}


def check_facts(model: nn.Module, p: qt.Plan) -> None:
    """``ValueError`` naming the step and the model when a step needs a model fact (``Plan.groups``,
    ``Plan.layout``) that the architecture tables do not give for ``model`` (and no option stands in)."""
    for i, step in enumerate(p.steps):
        for fact in qt.get_algorithm(step.name).requires:
            if getattr(p, fact, None) is None and step.options.get(fact) is None and fact in _FACTS:
                try:
                    _FACTS[fact](model)
                    why = "the plan has none"
                except ValueError as e:
                    why = str(e)
                raise ValueError(f"recipe.steps[{i}] ({step.name}): needs the {fact} of {type(model).__name__}, which "
                                 f"bridge.arch cannot give: {why}")


def _check_grid(path: str, m: qt.Match, shape: tuple[int, ...]) -> None:
    """The spec's blocks fit ``shape`` (shapes only, nothing allocated): a group that does not
    divide its axis fails here, not after calibration."""
    where = f"{path}: recipe {m.rule} ({m.spec})"
    try:
        block = m.spec.granularity.block_size(shape)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    what = "group size" if isinstance(m.spec.granularity, qt.PerGroup) else "block size"
    for axis, (n, b) in enumerate(zip(shape, block)):
        if n % b and not m.spec.pad:
            raise ValueError(f"{where}: {what} {b} does not divide axis {axis - len(shape)} of size {n} "
                             f"(shape {shape}); pass pad=True to pad the last block")


def _check_named_sites(recipe, matches) -> None:
    """An ``act_rules`` entry without wildcards that gives a module's input or output a spec, where that module's
    weight is not quantized, would quantize nothing: a ``ValueError`` naming it (a glob may match nothing on
    purpose, a recipe made for many models; a literal name is meant for this one)."""
    quantized = {qt.module_of(p) for p, m in matches.items() if m.spec is not None}
    quantized |= {p for p, m in matches.items() if m.spec is not None and m.module_type == "Experts"}
    for glob, spec in getattr(recipe, "act_rules", ()):
        module, _, role = glob.rpartition(":")
        if spec is None or role not in ("input", "output") or any(c in glob for c in "*?[") or module in quantized:
            continue
        what = "has no weight the recipe quantizes" if any(qt.module_of(p) == module for p in matches) else \
            "is not a module of this model"
        raise ValueError(f"{module}: recipe act_rules[{glob}] quantizes its {role}, but {module} {what}; "
                         "activation quantizers sit on the inputs and outputs of quantized modules: quantize its "
                         "weight, or drop that rule")


def _literal_act_rule(recipe, module: str, role: str) -> str | None:
    """The ``act_rules`` pattern without wildcards that gives ``module``'s ``role`` a spec, else ``None``."""
    m = recipe.resolve_activation(module, role)
    pattern = m.rule[len("act_rules["):-1] if m.rule.startswith("act_rules[") else None
    return pattern if m.spec is not None and pattern is not None and not any(c in pattern for c in "*?[") else None


def nothing_selected(model: nn.Module, p: qt.Plan) -> str:
    """Why plan ``p`` quantizes no tensor of ``model``: the recipe's rules, the patterns and module
    types that match nothing, and what decided for the tensors (for the error messages)."""
    recipe = p.recipe
    parts = [f"rules {[g for g, _ in recipe.rules]}"] if recipe.rules else []
    parts += [f"type_rules {[t for t, _ in recipe.type_rules]}"] if recipe.type_rules else []
    parts += ["a default spec"] if recipe.default is not None else []
    parts += [f"exclude {list(recipe.exclude)}"] if recipe.exclude else []
    msg = (f"the recipe ({', '.join(parts) or 'no rule, type rule or default'}) selects no tensor of this "
           f"{type(model).__name__} to quantize")
    unmatched = recipe.unmatched(p)
    if unmatched:
        msg += f"; {unmatched} match no tensor"
    types = {m.module_type for m in p.values()}
    absent = [t for t, _ in recipe.type_rules if t not in types]
    if absent:
        msg += f"; the model has no module of type {absent}"
    decided = Counter(m.rule for m in p.values())
    return msg + f" ({len(p)} tensors: " + ", ".join(f"{n} {rule}" for rule, n in decided.most_common(3)) + (
        ", ..." if len(decided) > 3 else "") + ")"


def check_calibration(recipe, *, calibrated: bool) -> None:
    """``ValueError`` when ``recipe`` quantizes activations with static scales (calibrated from data) and
    no calibration data is given. ``recipe``: a :class:`~qtransform.Plan` (its activation sites), or a
    recipe alone (its activation specs: checked before any model is loaded, as the command does).

    >>> import qtransform as qt
    >>> check_calibration(qt.Recipe(input=qt.QuantSpec(format="int8", dynamic=True)), calibrated=False)
    >>> check_calibration(qt.Recipe(input=qt.QuantSpec(format="int8")), calibrated=False)
    Traceback (most recent call last):
    ...
    ValueError: the recipe's static activation specs (['input']) need calibration data ... --calib N ...
    """
    if calibrated:
        return
    if isinstance(recipe, qt.Plan):
        static = [f"{s.module} ({s.role})" for s, spec in recipe.activations.items() if not spec.dynamic]
    else:
        r = qt.as_recipe(recipe)
        named = [("input", r.input), ("output", r.output), ("kv_cache", getattr(r, "kv_cache", None)),
                 *((f"act_rules[{glob}]", spec) for glob, spec in r.act_rules)]
        static = [name for name, spec in named if spec is not None and not spec.dynamic]
    if static:
        raise ValueError(f"the recipe's static activation specs ({static[:2]}{' ...' if len(static) > 2 else ''}) need "
                         "calibration data (static scales are calibrated from it): pass calibration=batches to "
                         "bridge.quantize or --calib N to `qtransform quantize`, or use dynamic=True activation specs")


def prepare(model: nn.Module, recipe, *, calibrated: bool, tree: Mapping | None = None) -> qt.Plan:
    """The one pre-run check of both drivers (:func:`quantize_params` in memory,
    :func:`bridge.stream.quantize_checkpoint` streamed, which hands it the model's skeleton): ``recipe`` planned
    on ``model`` (:func:`plan`), then ``ValueError`` when it selects no tensor, quantizes activations with static
    scales without calibration data, has a step that cannot run (unknown, bad options, needs data it lacks), or
    needs a model fact the architecture tables do not give. Returns the plan."""
    p = plan(model, recipe, tree=tree)
    if not p.specs:
        raise ValueError(nothing_selected(model, p))
    check_calibration(p, calibrated=calibrated)  # before any step runs
    qt.check_steps(p.steps, calibrated=calibrated)  # a step needing data is named first
    check_facts(model, p)
    return p


def calibrate_activations(qtree: Mapping, p: qt.Plan, calibrator, *, act_observer=None, online=None) -> dict:
    """The plan's activation quantizers, for both drivers (in memory the whole tree, streamed one block):
    static ones calibrated by ``act_observer`` (a name or ``{"name": ..., **options}``; default ``"minmax"``) over
    the calibrator's data with ``qtree``'s weights quantized and the ``online`` rotations applied, dynamic ones
    as specs; ``{}`` when the plan has none."""
    if not p.activations:
        return {}
    observer = dict(act_observer) if isinstance(act_observer, Mapping) else {"name": act_observer}
    weights = {path: qt.dequantize(v) if isinstance(v, qt.QTensor) else v for path, v in qtree.items()}
    return qt.activation_quantizers(weights, p, calibrator, observer=observer.pop("name", None), online=online,
                                    **observer)


def quantize_params(model: nn.Module, recipe, *, calibration: Iterable | None = None,
                    qparams: Mapping | None = None, progress: Callable | None = None, generator=None,
                    act_observer=None, all_experts: bool = False) -> Quantized:
    """Run the pipeline up to the quantized tree (the model is not changed).

    Args:
        model: the float model.
        recipe: a :class:`~qtransform.Recipe` or :class:`~qtransform.QuantSpec` (or a plan of :func:`plan`).
        calibration: batches for the steps that need data (see :class:`~bridge.calibrate.ModelCalibrator`).
        qparams: precomputed quantization parameters by path (paths the steps do not fit).
        progress: ``progress(iterable, desc=..., total=...)``, e.g. ``tqdm.tqdm``.
        generator: ``torch.Generator`` or seed for stochastic rounding.
        act_observer: the observer of static activation specs (``"minmax"``, the default;
            ``"percentile"``, ``"mse"``... or ``{"name": ..., **options}``), folded over ``calibration``
            with the weights quantized.
        all_experts: calibrate every expert of a mixture-of-experts layer on every token (the layer's output stays
            the routed one; see :class:`~bridge.calibrate.ModelCalibrator`).
    """
    params = extract(model)
    meta = next((path for path, t in params.items() if getattr(t, "is_meta", False)), None)
    if meta is not None:
        raise ValueError(f"{meta}: the model's tensors are on the meta device (no values to quantize); load its "
                         "weights first, or quantize while loading (from_pretrained with a QTransformConfig)")
    p = prepare(model, recipe, calibrated=calibration is not None, tree=params)
    calibrator = None if calibration is None else ModelCalibrator(calling_view(model), calibration, progress=progress,
                                                                  all_experts=all_experts)  # out_proj called
    qtree, fit = qt.quantize_tree(params, p, qparams=qparams, calibrator=calibrator, progress=progress,
                                  generator=generator, with_info=True)
    acts = calibrate_activations(qtree, p, calibrator, act_observer=act_observer, online=fit.online)
    return Quantized(params, qtree, p, acts, fit.info, fit.online, fit.outputs)


def quantize(model: nn.Module, recipe, *, inplace: bool = False, kernel: str = "auto",
             calibration: Iterable | None = None, qparams: Mapping | None = None, progress: Callable | None = None,
             generator=None, act_observer=None, all_experts: bool = False, fold_batchnorm: bool = False) -> nn.Module:
    """``extract -> plan -> steps -> quantize_tree -> to_module`` in one call (:func:`quantize_params`, then
    :func:`bridge.to_module` of its result, as the ``qtransform`` command does).

    Returns a new model, or ``model`` itself with ``inplace=True``. The new model is not a deep
    copy: the tensors it does not quantize (norms, biases, embeddings the recipe leaves alone...)
    are the very tensors of ``model`` (copying would double the memory of a large model), so an
    in-place change to one shows in the other; quantize a ``copy.deepcopy(model)`` to keep them
    apart. A recipe that selects no tensor is a ``ValueError`` naming its rules.

    ``fold_batchnorm=True`` (off by default) first folds the model's BatchNorm layers into the conv/linear
    before them (:func:`bridge.fold_batchnorm`, eval-mode semantics: a BatchNorm in training mode is refused),
    then quantizes that folded copy: the input model is untouched, so it cannot be combined with ``inplace``.
    """
    if not isinstance(fold_batchnorm, bool):
        raise TypeError(f"fold_batchnorm must be a bool, got {type(fold_batchnorm).__name__}")
    if fold_batchnorm:
        if inplace:
            raise ValueError("fold_batchnorm=True quantizes a folded copy of the model (the input is untouched): "
                             "it cannot be combined with inplace=True")
        model, inplace = _fold_batchnorm(model).model, True  # the copy is ours: quantized in place
    r = quantize_params(model, recipe, calibration=calibration, qparams=qparams, progress=progress,
                        generator=generator, act_observer=act_observer, all_experts=all_experts)
    return to_module(model, r, inplace=inplace, kernel=kernel)

"""Kinds of step output beyond tensors, quantization parameters and online rotations: one registry.

A step may return, beside the tensors it changed, values that run *beside* a quantized tensor: the
``lowrank`` step's rank-r corrections today (:class:`~qtransform.LowRank`), learned scales, codebooks or
training state tomorrow. Each such kind is declared once, here, with :func:`register_output_kind`:

* ``name``: the key of :attr:`Fit.outputs <qtransform.Fit>` (``{kind: {tree path: value}}``), also
  accepted as a keyword and an attribute of :class:`~qtransform.Fit` (``Fit(lowrank=...)``, ``fit.lowrank``);
* ``type``: the type of each value (checked when a ``Fit`` is made);
* ``check(value, tensor, *, path, plan)``: raises ``ValueError`` naming ``path`` unless ``value`` fits the
  tensor of the tree at ``path`` (``None`` when the tree has none there) under ``plan``;
  :func:`qtransform.run_steps` calls it on every value a step returns;
* ``stale_after``: which of a later step's fields make an earlier value stale (:meth:`Fit.then` drops
  it): ``"params"`` (the later step changed the tensor) and/or ``"qparams"`` (it fitted its parameters anew).

A step returning a kind names it when it registers (``register_algorithm(..., outputs=("lowrank",))``),
so a driver that cannot carry a kind refuses the step up front. What the torch side does with a kind
(modules, checkpoint tensors, config, exporters) is its registration in :mod:`bridge.step_outputs`.

>>> import torch, qtransform as qt
>>> def fits(value, tensor, *, path, plan):
...     if tensor is None or value.shape != tensor.shape[:1]:
...         raise ValueError(f"{path}: a scale per row, got {tuple(value.shape)}")
>>> kind = qt.register_output_kind("row_scale_demo", torch.Tensor, check=fits)
>>> fit = qt.Fit(row_scale_demo={"fc.weight": torch.ones(8)})
>>> list(fit.outputs), fit.row_scale_demo["fc.weight"].shape
(['row_scale_demo'], torch.Size([8]))
>>> fit.then(qt.Fit(params={"fc.weight": torch.zeros(8, 4)})).outputs
{}
>>> _ = qt.OUTPUT_KINDS.unregister("row_scale_demo")
"""

from __future__ import annotations

import builtins
import dataclasses
from typing import Any, Callable, Mapping

from ..registry import Registry

__all__ = ["OutputKind", "OUTPUT_KINDS", "register_output_kind", "check_path_map", "check_outputs", "combine_outputs",
           "check_against", "with_keywords"]

#: The ``Fit`` fields a kind's name may not take (it is also a keyword of ``Fit``).
RESERVED = ("params", "qparams", "info", "online", "outputs")
STALE = ("params", "qparams")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutputKind:
    """A declared kind of step output (see the module docstring)."""

    name: str
    type: type
    check: Callable[..., None] | None = None
    stale_after: tuple[str, ...] = STALE
    description: str = ""


def _check_kind(name: str, kind) -> None:
    if not isinstance(kind, OutputKind):
        raise TypeError(f"register_output_kind: expected an OutputKind, got {type(kind).__name__}")
    if name != kind.name or not name.isidentifier() or name in RESERVED:
        raise ValueError(f"register_output_kind: name must be an identifier other than {list(RESERVED)} "
                         f"(and the kind's own name), got {name!r}")


#: The registry: kind name -> :class:`OutputKind`.
OUTPUT_KINDS = Registry("step output kind", check=_check_kind)


def register_output_kind(name: str, type: type, *, check: Callable[..., None] | None = None,
                         stale_after=STALE, description: str = "", replace: bool = False) -> OutputKind:
    """Declare the kind of step output ``name`` (see the module docstring); returns the :class:`OutputKind`."""
    if not isinstance(type, builtins.type):
        raise TypeError(f"register_output_kind {name}: type must be a class, got {type!r}")
    if check is not None and not callable(check):
        raise TypeError(f"register_output_kind {name}: check must be callable, got {check!r}")
    stale_after = (stale_after,) if isinstance(stale_after, str) else tuple(stale_after)
    if any(s not in STALE for s in stale_after):
        raise ValueError(f"register_output_kind {name}: stale_after must name fields among {list(STALE)}, "
                         f"got {list(stale_after)}")
    kind = OutputKind(name=name, type=type, check=check, stale_after=stale_after, description=description)
    return OUTPUT_KINDS.register(name, kind, replace=replace)


def check_path_map(value: Any, kind: type, name: str) -> dict:
    """``value`` as a new dict when it maps tree paths (str) to ``kind`` values, else ``TypeError`` naming
    ``Fit.<name>`` (the one check of every path-keyed field of ``Fit``: its params, qparams and each kind)."""
    if not isinstance(value, Mapping):
        raise TypeError(f"Fit.{name} must be a mapping of path -> {kind.__name__}, got {type(value).__name__}")
    keys = [k for k in value if not isinstance(k, str)]
    if keys:
        raise TypeError(f"Fit.{name} must be keyed by tree paths (str), got the key {keys[0]!r}")
    bad = [k for k, v in value.items() if not isinstance(v, kind)]
    if bad:
        raise TypeError(f"Fit.{name}[{bad[0]!r}] must be a {kind.__name__}, got {type(value[bad[0]]).__name__}")
    return dict(value)


def check_outputs(outputs: Any) -> dict:
    """``{kind: {path: value}}`` checked (a new dict; kinds without values left out): each kind registered,
    keyed by tree paths (str), each value of the kind's type; ``TypeError``/``ValueError`` naming ``Fit.<kind>``."""
    if not isinstance(outputs, Mapping):
        raise TypeError(f"Fit.outputs must be a mapping of kind -> {{path: value}}, got {type(outputs).__name__}")
    checked = {name: check_path_map(values, OUTPUT_KINDS[name].type, name) for name, values in outputs.items()}
    return {name: values for name, values in checked.items() if values}


def with_keywords(outputs: Any, kinds: Mapping[str, Any]) -> Any:
    """``outputs`` with the kinds given as ``Fit`` keywords (``Fit(lowrank=...)``) added; ``TypeError`` for a
    keyword that names no registered kind, or a kind given both ways."""
    unknown = [k for k in kinds if k not in OUTPUT_KINDS]
    if unknown:
        raise TypeError(f"Fit: unexpected keyword {unknown[0]!r} (fields: {', '.join(RESERVED)}; registered kinds "
                        f"of step output: {list(OUTPUT_KINDS)})")
    if not kinds or not isinstance(outputs, Mapping):
        return outputs  # a wrong outputs is named by check_outputs
    both = [k for k in kinds if k in outputs]
    if both:
        raise TypeError(f"Fit: {both[0]!r} given both as a keyword and in outputs")
    return {**outputs, **kinds}


def combine_outputs(earlier: Mapping, later: Mapping, touched: Mapping[str, Any]) -> dict:
    """``earlier`` followed by ``later`` (both ``{kind: {path: value}}``): an earlier value is dropped where its
    kind's ``stale_after`` fields of the later step (``touched``: ``{"params": paths, "qparams": paths}``) name
    its path; a later value replaces an earlier one of the same kind and path."""
    out = {}
    for name in {**earlier, **later}:
        stale = set().union(*(touched[f] for f in OUTPUT_KINDS[name].stale_after))
        kept = {p: v for p, v in earlier.get(name, {}).items() if p not in stale}
        merged = {**kept, **later.get(name, {})}
        if merged:
            out[name] = merged
    return out


def check_against(outputs: Mapping, current: Mapping, plan, *, at: str) -> None:
    """Each value of ``outputs`` (``{kind: {path: value}}``) checked by its kind against the tree ``current``
    under ``plan``; ``ValueError`` prefixed by ``at`` (the step)."""
    for name, values in outputs.items():
        check = OUTPUT_KINDS[name].check
        for path, value in values.items() if check is not None else ():
            try:
                check(value, current.get(path), path=path, plan=plan)
            except ValueError as e:
                raise ValueError(f"{at}: {e}") from None

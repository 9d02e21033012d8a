"""What a step returns: :class:`Fit` (the tensors it changed, the quantization parameters it fitted, what it
reports, the online rotations its weights expect, and its outputs of registered kinds), and :func:`apply_fit`."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from .. import _pytree
from .._pytree import pytree_dataclass
from ..rotation import OnlineRotation
from ..spec import Site
from ..tensor import QParams
from .outputs import OUTPUT_KINDS, check_outputs, check_path_map, combine_outputs, with_keywords

__all__ = ["Fit", "apply_fit"]


@pytree_dataclass(static=("info", "online"))
class Fit:
    """What a step returns: ``params`` ``{path: tensor}`` it changed and ``qparams``
    ``{path: QParams}`` it fitted (a pytree: tensors are leaves), ``info`` ``{path: {name:
    number or str}}``, what it reports about them (GPTQ's loss, SmoothQuant's α; static, not leaves),
    ``online`` ``{Site: OnlineRotation}``, the rotations its weights expect at run time (static), and
    ``outputs`` ``{kind: {path: value}}`` of registered kinds of step output (:mod:`.outputs`), each also a
    keyword and an attribute: ``Fit(lowrank={...})`` is ``Fit(outputs={"lowrank": {...}})``, ``fit.lowrank``
    is ``fit.outputs.get("lowrank", {})`` (``{weight path: LowRank}`` corrections run beside quantized linears)."""

    params: Mapping[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    qparams: Mapping[str, QParams] = dataclasses.field(default_factory=dict)
    info: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    online: Mapping[Site, OnlineRotation] = dataclasses.field(default_factory=dict)
    outputs: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    def __init__(self, *, params=None, qparams=None, info=None, online=None, outputs=None, **kinds):
        outputs = with_keywords({} if outputs is None else outputs, kinds)  # a kind by its name
        for name, value in (("params", params), ("qparams", qparams), ("info", info), ("online", online),
                            ("outputs", outputs)):
            object.__setattr__(self, name, {} if value is None else value)
        self.__post_init__()

    def __getattr__(self, name: str):
        if name in OUTPUT_KINDS:  # only reached when no field has the name
            return self.__dict__.get("outputs", {}).get(name, {})
        raise AttributeError(f"'Fit' object has no attribute {name!r}")

    def __post_init__(self):
        for name, kind in (("params", torch.Tensor), ("qparams", QParams)):
            object.__setattr__(self, name, check_path_map(getattr(self, name), kind, name))
        object.__setattr__(self, "outputs", check_outputs(self.outputs))
        if not isinstance(self.info, Mapping) or not all(
                isinstance(k, str) and isinstance(v, Mapping) for k, v in self.info.items()):
            raise TypeError(f"Fit.info must map tree paths (str) to dicts of reported values, got {self.info!r:.80}")
        object.__setattr__(self, "info", {k: dict(v) for k, v in self.info.items()})
        if not isinstance(self.online, Mapping) or not all(
                isinstance(k, Site) and isinstance(v, OnlineRotation) for k, v in self.online.items()):
            raise TypeError(f"Fit.online must map qtransform.Site to OnlineRotation, got {self.online!r:.80}")
        object.__setattr__(self, "online", dict(self.online))

    def then(self, later: "Fit") -> "Fit":
        """This fit followed by ``later``: ``later``'s tensors replace this one's, and a tensor ``later`` changes
        drops the quantization parameters fitted before for it; an output is dropped where its kind says ``later``
        made it stale (a correction: its tensor changed or refitted); online rotations add up (twice: ``ValueError``).

        >>> import torch, qtransform as qt
        >>> a = qt.Fit(params={"w": torch.zeros(1)}, qparams={"w": qt.choose_qparams(torch.ones(1), qt.QuantSpec(format="int8"))})
        >>> b = qt.Fit(params={"w": torch.ones(1)})
        >>> sorted(a.then(b).params), sorted(a.then(b).qparams)
        (['w'], [])
        """
        if not isinstance(later, Fit):
            raise TypeError(f"Fit.then: expected a Fit, got {type(later).__name__}")
        kept = {p: q for p, q in self.qparams.items() if p not in later.params}
        outputs = combine_outputs(self.outputs, later.outputs, {"params": later.params, "qparams": later.qparams})
        info = {p: dict(v) for p, v in self.info.items()}
        for p, v in later.info.items():
            info[p] = {**info.get(p, {}), **v}
        twice = sorted(f"{s.module} ({s.role})" for s in set(self.online) & set(later.online))
        if twice:
            raise ValueError(f"Fit.then: two online rotations at {twice[:3]}: rotate once")
        return Fit(params={**self.params, **later.params}, qparams={**kept, **later.qparams}, info=info,
                   online={**self.online, **later.online}, outputs=outputs)


def apply_fit(params: Any, fit: Fit) -> Any:
    """``params`` with the tensors ``fit`` changed put in (a new tree; the input is untouched).

    Like optax's ``apply_updates``: the one function that applies a step's result. Raises
    ``ValueError`` naming the path for a path not in the tree or a changed shape or dtype.
    """
    if not isinstance(fit, Fit):
        raise TypeError(f"apply_fit: fit must be a Fit, got {type(fit).__name__}")
    seen = set()

    def one(path, leaf):
        if path not in fit.params:
            return leaf
        new = fit.params[path]
        if not isinstance(leaf, torch.Tensor) or new.shape != leaf.shape or new.dtype != leaf.dtype:
            got = f"{tuple(leaf.shape)} {leaf.dtype}" if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            raise ValueError(f"{path}: a step returned a tensor of shape {tuple(new.shape)} and dtype {new.dtype} "
                             f"for a leaf of {got}; steps keep shapes and dtypes")
        seen.add(path)
        return new

    out = _pytree.map_with_path(one, params)
    unknown = sorted(set(fit.params) - seen)
    if unknown:
        raise ValueError(f"apply_fit: a step returned tensors for paths not in the tree: {unknown[:5]}")
    return out

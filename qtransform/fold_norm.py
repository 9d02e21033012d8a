"""Folding a normalization in inference form (BatchNorm with its running statistics) into the convolution or
linear layer whose output it normalizes.

A :class:`NormFold` names a producer (module path of a linear or a convolution of any dimensionality, grouped
or depthwise, or a transposed convolution) and the norm that reads its output, channel by channel. In
inference form the norm is an affine map per output channel ``c``::

    y_c = (x_c - mean_c) * gamma_c / sqrt(var_c + eps) + beta_c

so with ``k_c = gamma_c / sqrt(var_c + eps)`` the producer's weight rows of output channel ``c`` become
``W_c * k_c`` and its bias ``(b_c - mean_c) * k_c + beta_c`` (``b = 0`` when the producer has none: the bias
is created). The tree paths are those of ``torch.nn`` state dicts:

* producer: ``<producer>.weight`` (and ``<producer>.bias`` if any). Output channels on axis 0 (``Linear``
  ``(out, in)``, ``ConvNd`` ``(out, in / groups, *kernel)``), or with ``transposed=True`` on axis 1 per group
  (``ConvTransposeNd`` ``(in, out / groups, *kernel)``: output channel ``g * out / groups + j`` is column
  ``j`` of rows ``g * in / groups ...``; with ``groups=1`` also GPT-2's ``Conv1D`` ``(in, out)``);
* norm: ``<norm>.running_mean`` and ``<norm>.running_var`` (required: a norm without running statistics,
  ``track_running_stats=False``, normalizes with each batch's statistics and cannot be folded), ``<norm>.weight``
  (gamma) and ``<norm>.bias`` (beta), each optional (``affine=False``: 1 and 0); ``eps`` is given in the
  :class:`NormFold` since it is no tensor.

The folded tree has no entry under the norm's paths (``weight``, ``bias``, ``running_mean``, ``running_var``,
``num_batches_tracked``): the norm becomes the identity, a module without parameters (``nn.Identity`` on the
torch side, :func:`bridge.fold_batchnorm`). Computed in float64 and cast back to the producer weight's dtype
(the bias to its own dtype, a created bias to the weight's), so a float32 model folds to within float32
rounding of the unfolded one. Pure: the input tree is not modified, unchanged entries are the same tensors,
and the arithmetic is differentiable (``torch.func.grad`` through it reaches gamma, beta, the statistics and
the weights).

>>> import torch
>>> params = {"fc.weight": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
...           "bn.weight": torch.tensor([2.0, 1.0]), "bn.bias": torch.tensor([0.5, 0.0]),
...           "bn.running_mean": torch.tensor([1.0, -1.0]), "bn.running_var": torch.tensor([16.0, 1.0])}
>>> new = fold_norms(params, [NormFold("fc", "bn", eps=0.0)])  # k = gamma / sqrt(var) = [0.5, 1.0]
>>> list(new), new["fc.weight"].tolist(), new["fc.bias"].tolist()
(['fc.weight', 'fc.bias'], [[0.5, 1.0], [3.0, 4.0]], [0.0, 1.0])
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

import torch

from ._checks import check_finite, check_float_tensor, under_transform

__all__ = ["NormFold", "NORM_ENTRIES", "fold_norms"]

NORM_ENTRIES = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
"""The entries of a norm that a fold removes from the tree (those present)."""


class NormFold(NamedTuple):
    """One fold: the norm at ``norm`` into the producer at ``producer`` (see the module docstring).

    Attributes:
        producer: module path of the linear or convolution (its ``.weight``, optional ``.bias``).
        norm: module path of the norm reading the producer's output (``.running_mean``, ``.running_var``,
            optional ``.weight`` / ``.bias``).
        eps: the norm's epsilon (``var + eps`` is square-rooted), a finite float ``>= 0``.
        transposed: the producer's output channels are on axis 1, per group (``ConvTransposeNd``).
        groups: the producer's groups; only a ``transposed`` producer's layout depends on it.
    """

    producer: str
    norm: str
    eps: float
    transposed: bool = False
    groups: int = 1


def _check_fold(i: int, f) -> NormFold:
    if not isinstance(f, tuple):
        raise TypeError(f"folds[{i}] must be a NormFold (producer, norm, eps[, transposed, groups]), "
                        f"got {type(f).__name__}")
    if not 3 <= len(f) <= 5:
        raise TypeError(f"folds[{i}] must be a NormFold (producer, norm, eps[, transposed, groups]), got a tuple "
                        f"of {len(f)}")
    f = NormFold(*f)
    for name in ("producer", "norm"):
        v = getattr(f, name)
        if not isinstance(v, str) or not v:
            raise TypeError(f"folds[{i}].{name} must be a non-empty module path (str), got {v!r}")
    if isinstance(f.eps, bool) or not isinstance(f.eps, (int, float)) or not math.isfinite(f.eps) or f.eps < 0:
        raise ValueError(f"folds[{i}] ({f.norm}): eps must be a finite number >= 0, got {f.eps!r}")
    if not isinstance(f.transposed, bool):
        raise TypeError(f"folds[{i}] ({f.producer}): transposed must be a bool, got {f.transposed!r}")
    if isinstance(f.groups, bool) or not isinstance(f.groups, int) or f.groups < 1:
        raise ValueError(f"folds[{i}] ({f.producer}): groups must be an int >= 1, got {f.groups!r}")
    if f.producer == f.norm:
        raise ValueError(f"folds[{i}]: producer and norm are the same module {f.producer!r}")
    return f


def _tensor(params: Mapping, path: str, *, what: str, required: bool) -> torch.Tensor | None:
    t = params.get(path)
    if t is None:
        if required:
            raise ValueError(f"{path}: {what} is not in params")
        return None
    if not isinstance(t, torch.Tensor):  # a QTensor among others: fold before quantizing
        raise TypeError(f"{path}: {what} must be a float torch.Tensor (fold norms before quantizing), got "
                        f"{type(t).__name__}")
    return check_float_tensor(t, name=what, path=path)


def _out_channels(w: torch.Tensor, f: NormFold, path: str) -> int:
    if w.dim() < 2:
        raise ValueError(f"{path}: a producer weight has at least 2 dimensions (linear (out, in), conv (out, in / "
                         f"groups, *kernel)), got shape {tuple(w.shape)}")
    if not f.transposed:
        return w.shape[0]
    if w.shape[0] % f.groups:
        raise ValueError(f"{path}: groups={f.groups} does not divide axis 0 (in channels) of the transposed weight "
                         f"of shape {tuple(w.shape)}")
    return w.shape[1] * f.groups


def _check_stats(f: NormFold, mean: torch.Tensor, var: torch.Tensor) -> None:
    """Statistics: finite, ``var + eps > 0`` (a data check: skipped under vmap / compile)."""
    for name, t in (("running_mean", mean), ("running_var", var)):
        check_finite(t, name=name, path=f"{f.norm}.{name}")
    if under_transform(var):
        return
    bad = (var.detach().double() + f.eps <= 0).nonzero()
    if bad.numel():
        c = int(bad[0, 0])
        raise ValueError(f"{f.norm}.running_var: var + eps must be > 0 in every channel; channel {c} has var "
                         f"{float(var[c])} with eps {f.eps}")


def _fold_one(params: Mapping, f: NormFold) -> dict[str, torch.Tensor]:
    wpath, bpath = f"{f.producer}.weight", f"{f.producer}.bias"
    w = _tensor(params, wpath, what="producer weight", required=True)
    b = _tensor(params, bpath, what="producer bias", required=False)
    n = f.norm
    if params.get(f"{n}.running_mean") is None or params.get(f"{n}.running_var") is None:
        raise ValueError(f"{n}: the norm has no running statistics ({n}.running_mean / {n}.running_var missing: "
                         "track_running_stats=False normalizes with each batch's statistics, which no weight can "
                         "hold); only norms with running statistics fold")
    mean = _tensor(params, f"{n}.running_mean", what="running_mean", required=True)
    var = _tensor(params, f"{n}.running_var", what="running_var", required=True)
    gamma = _tensor(params, f"{n}.weight", what="norm weight", required=False)
    beta = _tensor(params, f"{n}.bias", what="norm bias", required=False)
    c = _out_channels(w, f, wpath)
    for name, t in (("running_mean", mean), ("running_var", var), ("weight", gamma), ("bias", beta)):
        if t is not None and tuple(t.shape) != (c,):
            raise ValueError(f"{n}.{name}: shape {tuple(t.shape)} does not match the {c} output channels of "
                             f"{wpath} (shape {tuple(w.shape)}{', transposed' if f.transposed else ''}"
                             f"{f', groups={f.groups}' if f.transposed else ''}); expected ({c},)")
    if b is not None and tuple(b.shape) != (c,):
        raise ValueError(f"{bpath}: shape {tuple(b.shape)}, expected ({c},) (the output channels of {wpath})")
    for t, name in ((mean, "running_mean"), (var, "running_var"), (gamma, "weight"), (beta, "bias")):
        if t is not None and t.device != w.device:
            raise ValueError(f"{n}.{name} is on {t.device}, {wpath} on {w.device}: put them on one device")
    _check_stats(f, mean, var)
    for t, name in ((gamma, "weight"), (beta, "bias")):
        if t is not None:
            check_finite(t, name=name, path=f"{n}.{name}")
    d = torch.float64
    root = torch.sqrt(var.to(d) + f.eps)
    k = 1.0 / root if gamma is None else gamma.to(d) / root
    shift = -mean.to(d) * k if b is None else (b.to(d) - mean.to(d)) * k
    if beta is not None:
        shift = shift + beta.to(d)
    if f.transposed:  # (in, out / groups, *kernel): rows per group, columns per channel of that group
        g = f.groups
        w64 = w.to(d).reshape(g, w.shape[0] // g, w.shape[1], *w.shape[2:])
        kw = k.reshape(g, 1, w.shape[1], *([1] * (w.dim() - 2)))
        new_w = (w64 * kw).reshape(w.shape)
    else:
        new_w = w.to(d) * k.reshape(-1, *([1] * (w.dim() - 1)))
    return {wpath: new_w.to(w.dtype), bpath: shift.to(w.dtype if b is None else b.dtype)}


def fold_norms(params: Mapping[str, torch.Tensor], folds: Sequence[NormFold]) -> dict[str, torch.Tensor]:
    """``params`` with each norm of ``folds`` folded into its producer (see the module docstring).

    Args:
        params: flat tree ``{path: tensor}`` (a state dict; not modified).
        folds: :class:`NormFold` (or ``(producer, norm, eps[, transposed, groups])`` tuples); each producer and
            each norm at most once.

    Returns:
        A new tree: the producers' ``weight`` (same shape and dtype) and ``bias`` (created where missing)
        replaced, every entry of the norms (:data:`NORM_ENTRIES`) removed, the other entries the same tensors.

    Raises:
        TypeError: ``params`` not a mapping, a fold not a :class:`NormFold`, a tensor that is not a float tensor
            (a quantized weight: fold before quantizing).
        ValueError: a missing producer weight, a norm without running statistics, a norm whose channels are not
            the producer's output channels, non-finite statistics or gamma/beta, ``var + eps <= 0``, a producer
            or norm named twice, a norm that is another fold's producer.
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping {{path: tensor}}, got {type(params).__name__}")
    if isinstance(folds, (str, bytes)) or not isinstance(folds, Sequence):
        raise TypeError(f"folds must be a sequence of NormFold, got {type(folds).__name__}")
    folds = [_check_fold(i, f) for i, f in enumerate(folds)]
    seen: dict[str, str] = {}
    for f in folds:
        for role, path in (("producer", f.producer), ("norm", f.norm)):
            if path in seen:
                raise ValueError(f"{path}: named twice in folds (as {seen[path]} and as {role}); each module folds "
                                 "once")
            seen[path] = role
    new = {}
    for f in folds:
        new.update(_fold_one(params, f))
    gone = {f"{f.norm}.{e}" for f in folds for e in NORM_ENTRIES}
    biases = {f"{f.producer}.weight": f"{f.producer}.bias" for f in folds}
    out = {}
    for path, t in params.items():  # the order of params, a created bias right after its weight
        if path in gone:
            continue
        out[path] = new.get(path, t)
        if path in biases:
            out[biases[path]] = new[biases[path]]
    return out

"""``fold_batchnorm``: a model's BatchNorm layers folded into the convolution or linear layer before them.

The pairs are found by :func:`bridge.fx.find_pairs` (a ``torch.fx`` graph where the model traces, the
children of plain ``nn.Sequential`` containers where it does not); each is folded by
:func:`qtransform.fold_norms` (the producer's weight scaled per output channel by ``gamma / sqrt(var + eps)``,
its bias, created where missing, ``(b - mean) * gamma / sqrt(var + eps) + beta``; float64 arithmetic cast back
to the weight's dtype) and the BatchNorm is replaced by ``nn.Identity``. The new model computes what the input
model computes **in eval mode**, to float32 rounding. The input model is not touched (the new model is a deep
copy).

A BatchNorm in training mode normalizes with each batch's own statistics, which no weight can hold: folding one
is refused (``ValueError`` naming it) unless ``allow_training=True``, which folds its running statistics all the
same (the new model then equals the input model put in eval mode, and keeps the input's training flags).

Before quantization (the order matters for static activation scales and for every step that measures the
layers: they should see the layers the deployed model runs)::

    folded = bridge.fold_batchnorm(model.eval()).model
    qmodel = bridge.quantize(folded, recipe)
    # or, in one call: bridge.quantize(model.eval(), recipe, fold_batchnorm=True)

>>> import torch, bridge
>>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).eval()
>>> r = bridge.fold_batchnorm(model)
>>> r.folded, type(r.model[1]).__name__, type(model[1]).__name__
((('0', '1'),), 'Identity', 'BatchNorm2d')
>>> x = torch.randn(1, 3, 8, 8)
>>> torch.allclose(r.model(x), model(x), rtol=1e-5, atol=1e-6)
True
"""

from __future__ import annotations

import copy
from typing import NamedTuple

from torch import nn

import qtransform as qt

from .pairs import find_pairs

__all__ = ["BatchNormFolding", "fold_batchnorm"]


class BatchNormFolding(NamedTuple):
    """What :func:`fold_batchnorm` returns.

    Attributes:
        model: the new model, its folded BatchNorm layers ``nn.Identity``.
        folded: ``((producer, norm), ...)`` module paths, in the model's order.
        skipped: ``{norm: reason}`` for each BatchNorm left in place (its input feeds another layer too, it has
            no running statistics, it does not follow a conv/linear...).
        untraced: ``{module: error}`` for the modules ``torch.fx`` could not trace (``""``: the model), whose
            children were searched on their own (:mod:`bridge.fx.pairs`).
    """

    model: nn.Module
    folded: tuple[tuple[str, str], ...]
    skipped: dict[str, str]
    untraced: dict[str, str]


def _transposed(m: nn.Module) -> bool:
    return isinstance(m, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d))


def _tree(model: nn.Module, producer: str, norm: str) -> dict:
    """The float tensors of one pair, by their paths in ``model``."""
    out = {}
    for prefix in (producer, norm):
        for name, t in model.get_submodule(prefix).state_dict(keep_vars=True).items():
            out[f"{prefix}.{name}"] = t.detach()
    return out


def _set(module: nn.Module, name: str, value, like) -> None:
    grad = like.requires_grad if like is not None else module.weight.requires_grad
    setattr(module, name, nn.Parameter(value, requires_grad=grad))


def fold_batchnorm(model: nn.Module, *, allow_training: bool = False) -> BatchNormFolding:
    """``model`` with each foldable BatchNorm folded into the conv/linear before it (see the module docstring).

    Args:
        model: any ``nn.Module`` (not modified).
        allow_training: fold BatchNorm layers in training mode too (their running statistics); by default a
            ``ValueError`` names the first one.

    Returns:
        :class:`BatchNormFolding`: the new model, the folded pairs, the BatchNorm layers left and why.

    Raises:
        TypeError: ``model`` not an ``nn.Module``, ``allow_training`` not a bool.
        ValueError: a BatchNorm to fold in training mode (without ``allow_training``), or what
            :func:`qtransform.fold_norms` refuses (non-finite statistics, a variance with ``var + eps <= 0``,
            tensors on two devices), named by path.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(allow_training, bool):
        raise TypeError(f"allow_training must be a bool, got {type(allow_training).__name__}")
    new = copy.deepcopy(model)  # traced and changed: the input model is never touched, not even by tracing
    found = find_pairs(new)
    pairs = [(p, n) for p, n, _ in found.pairs]
    for p, n in pairs:
        if new.get_submodule(n).training and not allow_training:
            raise ValueError(f"{n}: BatchNorm in training mode (it normalizes with each batch's statistics, which "
                             "no weight can hold): call model.eval() before folding, or pass allow_training=True "
                             "to fold its running statistics (the folded model then equals the model in eval mode)")
    folds, params = [], {}
    for p, n in pairs:
        prod, norm = new.get_submodule(p), new.get_submodule(n)
        folds.append(qt.NormFold(p, n, float(norm.eps), transposed=_transposed(prod),
                                 groups=getattr(prod, "groups", 1)))
        params.update(_tree(new, p, n))
    tree = qt.fold_norms(params, folds)  # every check before anything changes
    for p, n in pairs:
        prod = new.get_submodule(p)
        _set(prod, "weight", tree[f"{p}.weight"], prod.weight)
        _set(prod, "bias", tree[f"{p}.bias"], prod.bias)
        parent, _, name = n.rpartition(".")
        owner = new.get_submodule(parent) if parent else new
        identity = nn.Identity()
        identity.train(owner._modules[name].training)
        owner._modules[name] = identity
    return BatchNormFolding(new, tuple(pairs), found.skipped, found.untraced)

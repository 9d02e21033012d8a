"""The tensors a qtransform checkpoint stores beside its quantized weights, by module: the static
activation quantizers' parameters (``<module>.input_scale``...) and the low-rank corrections of quantized
linears (``<module>.lowrank_a``, ``<module>.lowrank_b``): their names, shapes and dtypes as the
checkpoint's config and the model fix them, for :func:`bridge.load` to check before reading data."""

from __future__ import annotations

from torch import nn

import qtransform as qt

from .checkpoint.metadata import CheckpointError
from .checkpoint.tree_io import CONFIG
from .modules.actquant import static_buffers
from .modules.linear import QLinear, is_conv1d
from .modules.lowrank import NAMES

__all__ = ["activation_parts", "lowrank_parts", "take_lowrank", "lowrank_tensors"]


def _experts_input(like: nn.Module, path: str) -> nn.Module:
    """A stand-in (its width) for the input of the experts weight ``path`` (``<experts>.gate_up_proj``)."""
    from .modules.experts import input_holder
    from .tree.rebuild import experts_slot
    owner, weight = experts_slot(like, path)
    if owner is None:
        raise CheckpointError(f"{CONFIG}: activation quantizer of {path!r} names no module of "
                              f"{type(like).__name__}") from None
    return input_holder(owner, weight)


def activation_parts(like: nn.Module, meta) -> dict:
    """``{Site: {stored name: (shape, dtype)}}`` of the checkpoint's static activation quantizers."""
    out = {}
    for site, spec in meta.activations.items():
        try:
            module, sep = like.get_submodule(site.module), "."
        except AttributeError:  # an experts weight: its buffers are the module's <weight>_input_scale...
            module, sep = _experts_input(like, site.module), "_"
        if not spec.dynamic:
            try:
                parts = static_buffers(module, site.role, spec)
            except ValueError as e:
                raise CheckpointError(f"{CONFIG}: activation quantizer {site.module}:{site.role}: {e}") from None
            out[site] = {f"{site.module}{sep}{n}": v for n, v in parts.items()}
    return out


def lowrank_parts(like: nn.Module, meta) -> dict:
    """``{stored name: (shape, dtype)}`` of the checkpoint's low-rank corrections (``meta.lowrank``, ``{module:
    rank}``): ``<module>.lowrank_a`` ``(rank, in)`` and ``.lowrank_b`` ``(out, rank)`` in the weight entry's
    dtype, ``in``/``out`` the logical widths of ``like``'s linear (a ``Conv1D`` stores its weight (in, out))."""
    out = {}
    for module, r in meta.lowrank.items():
        e = meta.entries[f"{module}.weight"]
        try:
            m = like.get_submodule(module)
        except AttributeError:
            raise CheckpointError(f"{CONFIG}: low-rank correction of {module!r} names no module of "
                                  f"{type(like).__name__}") from None
        if not isinstance(m, nn.Linear) and not is_conv1d(m) and not isinstance(m, QLinear):
            raise CheckpointError(f"{CONFIG}: low-rank correction of {module!r}: a {type(m).__name__}, not a linear")
        n_out, n_in = e.shape[::-1] if (is_conv1d(m) or getattr(m, "transposed", False)) else e.shape
        out[f"{module}.{NAMES[0]}"] = ((r, n_in), e.dtype)
        out[f"{module}.{NAMES[1]}"] = ((n_out, r), e.dtype)
    return out


def take_lowrank(tree: dict, meta) -> dict:
    """``{weight path: LowRank}`` popped from a read ``tree`` (its ``<module>.lowrank_a``/``_b`` tensors)."""
    return {f"{m}.weight": qt.LowRank(a=tree.pop(f"{m}.{NAMES[0]}"), b=tree.pop(f"{m}.{NAMES[1]}"))
            for m in meta.lowrank}


def lowrank_tensors(lowrank) -> dict:
    """The stored tensors of ``{weight path: LowRank}`` (a :class:`~bridge.tree.Quantized` result's)."""
    out = {}
    for path, c in lowrank.items():
        module = path.rpartition(".")[0]
        out.update({f"{module}.{NAMES[0]}": c.a, f"{module}.{NAMES[1]}": c.b})
    return out

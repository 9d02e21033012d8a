"""The tensors a qtransform checkpoint stores beside its quantized weights, by module: the static
activation quantizers' parameters (``<module>.input_scale``...) and the low-rank corrections of quantized
linears (``<module>.lowrank_a``, ``<module>.lowrank_b``): their names, shapes and dtypes as the
checkpoint's config and the model fix them, for :func:`bridge.load` to check before reading data."""

from __future__ import annotations

from torch import nn

from .checkpoint.metadata import CheckpointError
from .checkpoint.tree_io import CONFIG
from .modules.actquant import static_buffers

__all__ = ["activation_parts"]


def _experts_input(like: nn.Module, path: str) -> nn.Module:
    """A stand-in (its width) for the input of the experts weight ``path`` (``<experts>.gate_up_proj``)."""
    from .modules.experts import expert_weights, stacked_like
    parent, _, weight = path.rpartition(".")
    experts = dict(like.named_modules()).get(parent)
    if experts is None or weight not in expert_weights(experts):
        raise CheckpointError(f"{CONFIG}: activation quantizer of {path!r} names no module of "
                              f"{type(like).__name__}") from None
    holder = nn.Module()
    holder.in_features = holder.out_features = stacked_like(experts, weight)[0][2]
    holder.experts_input = True  # its buffers are the experts module's <weight>_input_scale...
    return holder


def activation_parts(like: nn.Module, meta) -> dict:
    """``{Site: {stored name: (shape, dtype)}}`` of the checkpoint's static activation quantizers."""
    out = {}
    for site, spec in meta.activations.items():
        try:
            module = like.get_submodule(site.module)
        except AttributeError:
            module = _experts_input(like, site.module)
        if not spec.dynamic:
            try:
                parts = static_buffers(module, site.role, spec)
            except ValueError as e:
                raise CheckpointError(f"{CONFIG}: activation quantizer {site.module}:{site.role}: {e}") from None
            sep = "_" if getattr(module, "experts_input", False) else "."
            out[site] = {f"{site.module}{sep}{n}": v for n, v in parts.items()}
    return out

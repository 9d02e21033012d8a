"""The tensors a qtransform checkpoint stores beside its quantized weights, by module: the static
activation quantizers' parameters (``<module>.input_scale``...): their names, shapes and dtypes as the
checkpoint's config and the model fix them, for :func:`bridge.load` to check before reading data (the
step outputs' tensors: :func:`bridge.step_outputs.output_parts`)."""

from __future__ import annotations

from torch import nn

from .checkpoint.metadata import CheckpointError
from .checkpoint.tree_io import CONFIG
from .modules.actquant import static_buffers

__all__ = ["activation_parts"]


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

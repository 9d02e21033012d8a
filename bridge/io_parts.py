"""What :func:`bridge.load` checks before reading data, besides the quantized weights: the model it loads into
(:func:`model_of`: the float model or a factory of it), the tensors a qtransform checkpoint stores beside its
quantized weights, by module: the static activation quantizers' parameters (``<module>.input_scale``...),
their names, shapes and dtypes as the checkpoint's config and the model fix them (the step outputs' tensors:
:func:`bridge.step_outputs.output_parts`), the float dtype a tensor is stored in, the model's tied tensors."""

from __future__ import annotations

from torch import nn

from .checkpoint import store
from .checkpoint.metadata import CheckpointError
from .checkpoint.tree_io import CONFIG
from .modules.actquant import static_buffers
from .tree import tie_groups

__all__ = ["activation_parts", "model_of", "stored_float", "tied_aliases"]


def model_of(like) -> nn.Module:
    """The model ``load(like=...)`` rebuilds into: ``like`` itself, or what the zero-argument callable ``like``
    builds (``TypeError`` naming ``like`` for anything else, or a factory that builds no module)."""
    if isinstance(like, nn.Module):
        return like
    if not callable(like):
        raise TypeError(f"load: like must be a torch.nn.Module or a zero-argument callable that builds one, got "
                        f"{type(like).__name__}")
    model = like()
    if not isinstance(model, nn.Module):
        raise TypeError(f"load: like is a factory, and like() must build a torch.nn.Module; it returned "
                        f"{type(model).__name__}")
    return model


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


def stored_float(handles, located, name: str):
    """The float dtype ``name`` is stored in (``None`` when it is not stored, or not as a float)."""
    if name not in located:
        return None
    st = handles[located[name]].get_slice(name).get_dtype()
    return next((dt for dt in store.FLOAT_DTYPES if store.ST_DTYPES[dt] == st), None)


def tied_aliases(like: nn.Module, stored: set) -> dict[str, str]:
    """Paths of ``like`` whose parameter or buffer *is* another stored path's (tied weights, which
    ``save_pretrained`` writes once)."""
    out = {}
    for paths in tie_groups(like):
        present = [p for p in paths if p in stored]
        if present:
            out.update({p: present[0] for p in paths if p not in stored})
    return out

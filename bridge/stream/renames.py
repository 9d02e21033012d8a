"""The stored tensors of a checkpoint as the tensors of its model: transformers' own conversion mapping, applied
one model tensor at a time.

transformers stores some tensors under other names than the model's (Mixtral's ``block_sparse_moe.gate`` is the
model's ``mlp.gate``) and builds some model tensors from several stored ones: the experts of a
mixture-of-experts layer are stored expert by expert (``mlp.experts.3.gate_proj.weight``, ``up_proj``,
``down_proj``) and are one stacked tensor in the model (``mlp.experts.gate_up_proj`` ``(E, 2I, H)``, the
experts' ``cat(gate, up)`` stacked). ``from_pretrained`` does this with the model's conversion mapping
(:func:`transformers.conversion_mapping.get_model_conversion_mapping`): every stored name is renamed by
:func:`transformers.core_model_loading.rename_source_key` (its renamings, then at most one converter), and
a converter's operations (``MergeModulelist``, ``Concatenate``, ``Chunk``...) build the model tensor from
the stored tensors its source patterns collected. :class:`Renames` does the same with the same objects,
without a table of its own: the names are mapped when the checkpoint is opened, each built tensor's dtype and
shape come from its operations run on ``meta`` tensors (nothing read), and :meth:`Renames.read` reads the
stored tensors of one model tensor only (one layer's experts) and converts them in their stored dtype.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Callable, NamedTuple

import torch

__all__ = ["Built", "Renames", "identity"]


class Built(NamedTuple):
    """A model tensor transformers builds from the stored tensors ``sources`` (``{source pattern: [stored
    names]}`` in the order it collects them), with its dtype and shape (from the operations on ``meta``)."""

    dtype: torch.dtype
    shape: tuple
    sources: dict
    first: str  # the name transformers converts the group under (its first target)

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def _mapping(model) -> list:
    """The model's conversion mapping (``[]`` for a model transformers has none for, or not a transformers model)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # pragma: no cover - transformers is what builds the model
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    return list(get_model_conversion_mapping(model))


def identity(stored: dict) -> "Renames":
    """The stored tensors taken by their own names (no model to map them to)."""
    r = Renames.__new__(Renames)
    r.model, r.converters, r.entries, r.unused = None, {}, dict(stored), []
    r.names, r.broken = {n: n for n in stored}, {}
    return r


class Renames:
    """``entries`` ``{model path: Stored | Built}``: each model tensor, either a stored tensor (under its name or
    renamed) or :class:`Built` from several; ``unused``: the stored names the model does not load (as
    ``from_pretrained`` reports them unexpected); ``names`` ``{model path: stored name}`` of the stored ones.
    ``stored`` ``{name: Stored}`` is the checkpoint's table, ``model`` the model (its parameters may be on meta)."""

    def __init__(self, stored: dict, model):
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        self.model = model
        mapping = _mapping(model)
        renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        converters = [t for t in mapping if isinstance(t, WeightConverter)]
        self.converters = {k: c for c in converters for k in c.source_patterns}
        meta = {p: t for p, t in model.state_dict(keep_vars=True).items()}
        prefix = getattr(model, "base_model_prefix", None)
        self.entries, self.names, self.unused, groups = {}, {}, [], {}
        for name in sorted(stored, key=dot_natural_key):  # transformers' order: experts 0, 1, ..., 10
            target, pattern = rename_source_key(name, renamings, converters, prefix, meta)
            if target not in meta and name in meta:  # as from_pretrained: a key of the model is taken as it is
                target, pattern = rename_source_key(name, [], [], base_model_prefix=prefix, meta_state_dict=meta)
            if target not in meta:
                self.unused.append(name)
            elif pattern is None:
                if target in self.entries:
                    self.unused.append(name)  # two stored names for one tensor: the first is loaded
                else:
                    self.entries[target], self.names[target] = stored[name], name
            else:
                groups.setdefault(target, {}).setdefault(pattern, []).append(name)
        self.broken = {}  # {first target: (its sources, why they do not convert)} (a missing or extra expert...)
        for first, sources in groups.items():
            try:
                out = self._convert(first, sources, lambda n: torch.empty(stored[n].shape, dtype=stored[n].dtype,
                                                                         device="meta"))
            except (RuntimeError, ValueError, IndexError) as e:
                self.broken[first] = (sources, f"{type(e).__name__}: {e}")
                continue
            for path, t in out.items():
                self.entries[path] = Built(t.dtype, tuple(t.shape), sources, first)

    def _convert(self, first: str, sources: dict, load: Callable[[str], torch.Tensor]) -> dict:
        """``{model path: tensor}`` the converter of ``sources`` builds (``load(stored name)`` gives each source)."""
        conv = deepcopy(self.converters[next(iter(sources))])  # one instance per target, as transformers does
        for pattern, names in sources.items():
            for n in names:
                conv.add_tensor(first, n, pattern, lambda n=n: load(n))
        out = conv.convert(first, model=self.model, config=self.model.config)
        return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}

    def read(self, path: str, load: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The model tensor ``path`` built from its stored tensors (``load(stored name)``) by transformers'
        operations (its sibling targets, if the converter makes several, are dropped)."""
        e = self.entries[path]
        out = self._convert(e.first, e.sources, load)
        if path not in out:
            raise RuntimeError(f"conversion of {sorted(e.sources)} gave {sorted(out)}, not {path!r}")
        return out[path]

    def consumed(self, paths) -> set:
        """The stored names that the model tensors ``paths`` are read from."""
        got = set()
        for p in paths:
            e = self.entries.get(p)
            if isinstance(e, Built):
                got.update(n for names in e.sources.values() for n in names)
            elif e is not None:
                got.add(self.names[p])
        return got

    def saved_names(self, path: str, shape) -> list:
        """The stored names ``save_pretrained`` gives the model tensor ``path`` of ``shape`` (transformers'
        reversed conversion, on ``meta``): where the tensors it is built from are looked for."""
        if self.model is None:
            return [path]
        from transformers.core_model_loading import revert_weight_conversion

        try:
            return sorted(revert_weight_conversion(self.model, {path: torch.empty(shape, device="meta")}))
        except Exception:  # a reversal transformers cannot do on meta: the name itself
            return [path]

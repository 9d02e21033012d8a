"""The inventory of a checkpoint's tensors: what becomes of each stored tensor, and the check that the output
holds them all before it is published.

The plan starts from the model, and the model from transformers' load, which renames some stored tensors,
builds some from several (experts stored one by one) and leaves out the ones its class does not know: the
multi-token-prediction layers of DeepSeek-V3, GLM-4-MoE, Qwen3-Next or Nemotron-H (``model.layers.<n>.eh_proj``,
``mtp.*``: ``_keys_to_ignore_on_load_unexpected``), whatever else a class ignores. :class:`Inventory` starts
from the stored tensors instead (the safetensors headers, before transformers renames or drops anything): each
one is *loaded* into a model tensor (which the plan then quantizes or keeps) or *carried*: not a tensor of the
model, written to the output as it is stored (its dtype, its bytes), in memory and streamed alike.

Before a checkpoint appears, :meth:`Inventory.check` reads the names the output holds and fails naming every
stored tensor that is in it neither under its own name, nor under the name of the model tensor it was loaded
into (with its quantized parts: ``<name>_scale``...), nor as a tied alias. Nothing is dropped with exit status 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from ..checkpoint import CheckpointError, checksum
from ..checkpoint.config_file import read_config
from ..checkpoint.store import read_index
from .source import Built, Source

__all__ = ["Inventory", "Carried", "take", "check_rules"]


class Inventory(NamedTuple):
    """``loaded`` ``{stored name: model path it is (part of)}``; ``carried`` the stored names the model does not
    load (written as they are stored); ``source`` the checkpoint read."""

    source: Source
    loaded: dict
    carried: tuple

    def groups(self) -> list:
        """The carried tensors as the output layout's groups (``{name: (dtype, shape)}``, one each)."""
        return [{n: (self.source.tensors[n].dtype, self.source.tensors[n].shape)} for n in self.carried]

    def read(self, name: str):
        return self.source.read_stored(name)

    def summary(self) -> dict:
        """What the report says: counts of stored tensors loaded and carried, and the carried names."""
        return {"stored": len(self.loaded) + len(self.carried), "loaded": len(self.loaded),
                "carried": list(self.carried)}

    def check(self, directory) -> None:
        """The checkpoint in ``directory`` holds every stored tensor (see the module docstring), or
        :class:`~bridge.checkpoint.CheckpointError` names the missing ones."""
        directory = Path(directory)
        names = set(written_names(directory))
        qc = read_config(directory / "config.json").get("quantization_config") or {}
        aliases = set((qc.get("aliases") or {}) if isinstance(qc, dict) else ())
        prefixes = {n.rsplit("_", 1)[0] for n in names if "_" in n.rsplit(".", 1)[-1]}  # X.weight_scale -> X.weight
        missing = []
        for name in [*self.loaded, *self.carried]:
            target = self.loaded.get(name, name)
            if not ({name, target} & (names | aliases | prefixes)):
                missing.append(name if target == name else f"{name} (as {target})")
        if missing:
            more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
            raise CheckpointError(f"{directory}: the output lacks {len(missing)} tensor(s) of the input "
                                  f"{self.source.root}: {', '.join(missing[:8])}{more}; refusing to publish it")


class Carried(NamedTuple):
    """The carried tensors of another tool's checkpoint made by our export (its importer's
    :attr:`~bridge.interop.Checkpoint.carried`: ``{name: tensor}`` as stored), written as they are by a new recipe's
    output: the inventory of those (the importer refused whatever else it could not map)."""

    tensors: dict

    @property
    def carried(self) -> tuple:
        return tuple(self.tensors)

    def read(self, name: str):
        return self.tensors[name]

    def check(self, directory) -> None:
        """The checkpoint in ``directory`` holds every carried tensor, or CheckpointError names the missing ones."""
        names = set(written_names(Path(directory)))
        missing = [n for n in self.tensors if n not in names]
        if missing:
            raise CheckpointError(f"{directory}: the output lacks {len(missing)} carried tensor(s) of the input: "
                                  f"{', '.join(missing[:8])}; refusing to publish it")


def check_rules(recipe, carried) -> None:
    """A glob rule of ``recipe`` (``rules``) that selects a carried tensor is a ``ValueError`` naming both: the
    carried tensors are written as stored (no module of the model holds them to be quantized), never ignored
    silently by a rule that names them."""
    for name in carried:
        m = recipe.resolve(name)
        if m.spec is not None and m.rule.startswith("rules["):
            raise ValueError(f"{name}: recipe {m.rule} selects a tensor the model class does not load (carried: "
                             "written as stored, as transformers would ignore it); qtransform keeps carried tensors "
                             "as stored: narrow the rule or exclude it (exclude=[...])")


def take(source, model) -> Inventory:
    """The inventory of the checkpoint ``source`` (a directory or :class:`~.source.Source`) as ``model`` loads it
    (transformers' conversion mapping; its parameters may be on ``meta``)."""
    src = source if isinstance(source, Source) else Source(source)
    src.map_to(model)
    view = src.view
    loaded = {}
    for path, e in view.entries.items():
        if isinstance(e, Built):
            loaded.update({n: path for names in e.sources.values() for n in names})
        else:
            loaded[view.names[path]] = path
    # a stored tensor of a buffer the model does not save (old BERTs' embeddings.position_ids) is the model's to
    # recompute, as transformers does: neither loaded nor carried
    kept = set(model.state_dict(keep_vars=True))
    transient = {n for n, _ in model.named_buffers()} - kept
    loaded = {n: p for n, p in loaded.items() if p not in transient}
    tied = _tied_names(model)
    carried = tuple(n for n in src.tensors if n not in loaded and n not in tied and n not in transient)
    loaded.update({n: tied[n] for n in src.tensors if n in tied and n not in loaded and n not in transient})
    return Inventory(src, loaded, carried)


def _tied_names(model) -> dict:
    """``{name: name}`` of the model's tied tensors (a checkpoint may store either of a tied pair, or both)."""
    from ..tree import tie_groups

    return {p: p for paths in tie_groups(model) for p in paths}


def written_names(directory: Path) -> list:
    """The tensor names a checkpoint directory holds (its shards' headers)."""
    _, files = read_index(directory)
    out = []
    for f in files:
        header, _ = checksum.read_header(directory / f)
        out.extend(n for n in header if n != "__metadata__")
    return out

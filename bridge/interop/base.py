"""Exports of qtransform checkpoints to other ecosystems' formats: the interface every target implements.

A target (``quark``, ``compressed-tensors``, ``gguf``, ``onnx``...) is an :class:`Exporter` in its own
package of :mod:`bridge.interop` (its importer beside it), registered in :data:`EXPORTERS` under its name. It says, per quantized
tensor, whether its format can hold the spec (:meth:`Exporter.support`: ``"exact"``, ``"nearest"``
with the reason, or ``"no"``) and writes a :class:`Checkpoint` (a qtransform checkpoint read without a
model: its metadata, tree and ``config.json``) into a directory (:meth:`Exporter.write`).

:func:`export` is what the ``qtransform export`` command and ``qtransform quantize --to`` call:
it reads the checkpoint (checksums verified), asks the target about every quantized tensor and
activation quantizer first and refuses with one ``ValueError`` listing the tree paths it cannot
express (nothing is written then), and writes the export into a temporary directory renamed into
place at the end (:func:`bridge.checkpoint.store.atomic_directory`): never half a directory.

Carried tensors (the input checkpoint's tensors its model class does not load, multi-token-prediction layers:
``quantization_config["carried"]``, :mod:`bridge.stream.inventory`) are read here, once for every target, into
:attr:`Checkpoint.carried`, apart from the tree. A target that writes them as stored under their own names sets
:attr:`Exporter.carries` (and names them in its format's list of layers left float); every other target refuses
them by name in :meth:`Exporter.problems`: never dropped.
"""

from __future__ import annotations

import abc
import inspect
import shutil
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, NamedTuple

import torch

import qtransform as qt

from ..checkpoint import checksum, config_file, store
from ..checkpoint.layout import dtype_from_name
from ..checkpoint.metadata import CheckpointError, Metadata
from ..checkpoint.tree_io import CONFIG, TOKENIZER_FILES, load_tree, read_metadata
from ..modules.experts import EXPERT_WEIGHTS
from ..step_outputs import SLOTS

__all__ = ["Checkpoint", "Support", "Exporter", "EXPORTERS", "register_exporter", "Importer", "IMPORTERS",
           "register_importer", "detect_format", "read_source", "read_imported", "verify_digests", "verify_shards",
           "export", "split_carried", "carried_problem", "carried_modules",
           "EXTRA_FILES", "copy_extras", "write_config", "SUPPORT_KINDS", "FLOAT_SCALES", "judged_spec"]

#: What :meth:`Exporter.support` answers: the target holds the spec bit for bit, holds the nearest
#: format it has (extra error, said in the note), or cannot hold it.
SUPPORT_KINDS = ("exact", "nearest", "no")

#: Float scale dtypes the targets keep as they are (compressed-tensors stores them as given, Quark reads them
#: into its float32 scale buffers without loss).
FLOAT_SCALES = ("float32", "float16", "bfloat16")

#: Files a transformers checkpoint carries beside its weights, copied into exports that keep
#: the transformers directory shape: generation settings and the tokenizer's files
#: (:data:`bridge.checkpoint.tree_io.TOKENIZER_FILES`, chat template included).
EXTRA_FILES = ("generation_config.json", *TOKENIZER_FILES)


class Checkpoint(NamedTuple):
    """A qtransform checkpoint read without a model.

    ``tree``: ``{path: Tensor | QTensor}`` (tied paths included, bit for bit as stored);
    ``meta``: its decoded ``quantization_config`` (specs of every quantized tensor, activation and
    key/value-cache quantizers, online rotations); ``config``: ``config.json`` without its
    ``quantization_config`` (the transformers model config; ``{}`` for a checkpoint of a plain
    module); ``directory``: where it was read (tokenizer files sit there); ``carried``: ``{name: tensor}`` of the
    tensors the model does not load, as stored (``meta.carried`` names them; not in ``tree``)."""

    directory: Path
    meta: Metadata
    tree: dict
    config: dict
    carried: Mapping = MappingProxyType({})


class Support(NamedTuple):
    """``kind`` in :data:`SUPPORT_KINDS`; ``note``: the target's name for it, or why not / what is lost."""

    kind: str
    note: str = ""


class Exporter(abc.ABC):
    """One target format. Subclasses set :attr:`name` and :attr:`suffix` and implement
    :meth:`support` and :meth:`write`; :meth:`problems` has a default built on :meth:`support`."""

    #: The ``--to`` name.
    name: str = ""
    #: One line for ``qtransform export --help`` and the README table.
    description: str = ""
    #: The kinds of step output (names in :data:`bridge.step_outputs.SLOTS`) the target can hold; a checkpoint
    #: carrying any other is refused by :meth:`problems`, entry by entry.
    holds: frozenset[str] = frozenset()
    #: The target writes :attr:`Checkpoint.carried` as stored, under their own names; a checkpoint carrying any is
    #: refused by :meth:`problems` (naming them) where it does not.
    carries: bool = False

    @abc.abstractmethod
    def support(self, spec: qt.QuantSpec, role: str = "weight") -> Support:
        """Can this target hold a tensor quantized with ``spec``? ``role``: ``"weight"``, or an
        activation site's role (``"input"``, ``"output"``, ``"key"``, ``"value"``)."""

    @abc.abstractmethod
    def write(self, source: Checkpoint, out: Path, *, allow_nearest: bool = False) -> None:
        """Write the export of ``source`` into the (empty, temporary) directory ``out``."""

    def problems(self, source: Checkpoint, *, allow_nearest: bool = False) -> list[str]:
        """Why ``source`` cannot be exported (one line per tree path or site; empty when it can).
        Targets with whole-model conditions (an architecture, online rotations) extend it."""
        out = [] if self.carries or not source.carried else [carried_problem(source, self.name)]
        for path, entry in source.meta.entries.items():
            out += self._judge(path, judged_spec(path, entry), "weight", allow_nearest)
        for site, spec in source.meta.activations.items():
            out += self._judge(f"{site.module}:{site.role}", spec, site.role, allow_nearest)
        for site in source.meta.online:
            out.append(f"{site.module}:{site.role}: an online rotation, which {self.name} cannot express "
                       "(dequantize-and-fold it first: model.dequantize(), or quantize without R3/R4)")
        for kind, record in getattr(source.meta, "outputs", {}).items():
            for key, entry in ({} if kind in self.holds else record).items():
                out.append(f"{key}: {SLOTS[kind].describe(key, entry)}, which {self.name} cannot hold (quantize "
                           f"without the step returning {kind!r} outputs, or keep the qtransform checkpoint)")
        return out

    def _judge(self, where: str, spec: qt.QuantSpec, role: str, allow_nearest: bool) -> list[str]:
        s = self.support(spec, role)
        if s.kind not in SUPPORT_KINDS:
            raise TypeError(f"{type(self).__name__}.support returned kind {s.kind!r}, not one of {SUPPORT_KINDS}")
        if s.kind == "no" or (s.kind == "nearest" and not allow_nearest):
            extra = " (pass allow_nearest=True / --allow-nearest to accept it)" if s.kind == "nearest" else ""
            return [f"{where}: {spec}: {s.note or 'not expressible'}{extra}"]
        return []


def carried_problem(source: Checkpoint, target: str) -> str:
    """The line refusing a checkpoint's carried tensors for a target that cannot write them."""
    names = sorted(source.carried)
    more = f" (and {len(names) - 8} more)" if len(names) > 8 else ""
    return (f"{source.directory}: carried tensor(s) {', '.join(names[:8])}{more}: stored as they are beside the "
            f"model's (layers the model class does not load, e.g. multi-token prediction), which {target} cannot "
            "hold (export to compressed-tensors or quark, which keep them, or keep the qtransform checkpoint)")


def carried_modules(names) -> list[str]:
    """The module names of the carried tensors ``names`` (``mtp.fc`` of ``mtp.fc.weight``), sorted: what a
    target's list of layers left in floating point names (compressed-tensors' ``ignore``, Quark's ``exclude``), so
    that its loaders build them unquantized.

    >>> carried_modules(["mtp.fc.weight", "mtp.norm.weight", "mtp.fc.bias"])
    ['mtp.fc', 'mtp.norm']
    """
    return sorted({n.rpartition(".")[0] or n for n in names})


def judged_spec(path: str, entry) -> qt.QuantSpec:
    """The spec a target is asked about for the tree entry ``path``: a stacked experts weight (a 3-D
    ``<experts>.gate_up_proj``/``up_proj``/``down_proj``, :mod:`bridge.modules.experts`) by the spec of one
    expert's matrix (:func:`qtransform.matrix_spec`), which is what per-expert exports write."""
    if len(entry.shape) == 3 and path.rpartition(".")[2] in EXPERT_WEIGHTS:
        return qt.matrix_spec(entry.spec, tuple(entry.shape))
    return entry.spec


class Importer(abc.ABC):
    """Reads another tool's checkpoint into a :class:`Checkpoint` (our tree and metadata) without
    re-quantizing where its format maps to one of ours. Subclasses set :attr:`name`."""

    name: str = ""

    @abc.abstractmethod
    def detect(self, directory: Path) -> bool:
        """True when ``directory`` (or file) is a checkpoint of this format (cheap: headers, config)."""

    @abc.abstractmethod
    def read(self, directory: Path, *, verify: bool = True) -> Checkpoint:
        """The checkpoint as a :class:`Checkpoint`; ``ValueError`` (a :class:`~bridge.CheckpointError` for a
        damaged file) naming the file and the tensor or key it cannot map. What it reads is validated
        before anything is built; digests written with the tensors are checked unless ``verify=False``
        (:func:`verify_digests`, :func:`verify_shards`)."""


def _check_exporter(name: str, exporter) -> None:
    if not isinstance(exporter, Exporter):
        raise TypeError(f"register_exporter: expected an Exporter, got {type(exporter).__name__}")
    if name != exporter.name:
        raise ValueError(f"register_exporter: name {name!r} differs from the exporter's name {exporter.name!r}")


#: ``--to`` name -> :class:`Exporter`.
EXPORTERS = qt.Registry("export target", check=_check_exporter)


def _check_importer(name: str, importer) -> None:
    if not isinstance(importer, Importer) or name != importer.name:
        raise TypeError(f"register_importer: expected an Importer named {name!r}, got {importer!r}")


#: format name -> :class:`Importer`.
IMPORTERS = qt.Registry("import format", check=_check_importer)


def register_importer(importer: Importer, *, replace: bool = False) -> Importer:
    """Add ``importer`` under its :attr:`~Importer.name`."""
    return IMPORTERS.register(getattr(importer, "name", None), importer, replace=replace)


def detect_format(path) -> str | None:
    """The name of the :data:`IMPORTERS` entry that reads ``path`` (``None``: none does)."""
    p = Path(path)
    return next((name for name, imp in IMPORTERS.items() if imp.detect(p)), None)


def quantization_config_of(config, file) -> dict:
    """``config["quantization_config"]`` of a decoded ``config.json`` of another tool's export, after the checks
    every importer makes first: a JSON object whose ``dtype``/``torch_dtype`` (when given) name a torch dtype and
    whose ``quantization_config`` is an object; :class:`~bridge.CheckpointError` naming ``file`` and the key.

    >>> quantization_config_of({"dtype": "bfloat16", "quantization_config": {"quant_method": "quark"}}, "config.json")
    {'quant_method': 'quark'}
    >>> quantization_config_of({"dtype": "float33", "quantization_config": {}}, "config.json")
    Traceback (most recent call last):
    ...
    bridge.checkpoint.metadata.CheckpointError: config.json: dtype must name a torch dtype, got 'float33'
    """
    if not isinstance(config, dict):
        raise CheckpointError(f"{file}: the file must hold a JSON object, got {type(config).__name__}")
    for k in ("dtype", "torch_dtype"):
        if config.get(k) is not None:
            try:
                dtype_from_name(config[k])
            except ValueError:
                raise CheckpointError(f"{file}: {k} must name a torch dtype, got {config[k]!r}") from None
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        raise CheckpointError(f"{file}: quantization_config must be a JSON object, got {type(q).__name__}")
    return q


def read_imported(fmt: str, path, *, verify: bool = True, like=None) -> Checkpoint:
    """``IMPORTERS[fmt].read(path, verify=verify, like=like)``, passing only the options its ``read`` takes: an
    importer registered before ``verify`` existed (its ``read`` takes the path alone) checks no digests, and
    ``like`` (the model the tree is for) goes to importers that check the file's hyperparameters against it."""
    if not isinstance(verify, bool):
        raise TypeError(f"read_imported: verify must be True or False, got {verify!r}")
    if fmt not in IMPORTERS:
        raise ValueError(f"read_imported: fmt must be one of {sorted(IMPORTERS)}, got {fmt!r}")
    importer = IMPORTERS[fmt]
    try:
        takes = inspect.signature(importer.read).parameters
    except (TypeError, ValueError):
        takes = {}
    options = {k: v for k, v in (("verify", verify), ("like", like)) if k in takes}
    return importer.read(Path(path), **options)


def verify_digests(where, recorded: Mapping[str, str], actual: Mapping[str, str]) -> int:
    """Compare the digests a file recorded with those of what it holds now (both ``{tensor name: hex digest}``,
    e.g. :func:`bridge.checkpoint.checksum.digest` of each tensor's dtype name, shape and raw bytes).

    Every tensor in ``actual`` must have its recorded digest and match it; a recorded name no longer
    stored is reported too. Returns the number of tensors checked; raises :class:`~bridge.CheckpointError`
    naming ``where`` (the file) and the first tensor that differs (changed bytes, tensors swapped or renamed).

    >>> verify_digests("m.gguf", {"a": "00"}, {"a": "00"})
    1
    >>> verify_digests("m.gguf", {"a": "00", "b": "11"}, {"a": "11", "b": "00"})
    Traceback (most recent call last):
    ...
    bridge.checkpoint.metadata.CheckpointError: m.gguf: tensor 'a' (and ['b']) does not match the digest written with it: the file was corrupted or edited (tensors swapped, bytes or header changed); verify=False skips this check
    """
    unlisted = sorted(n for n in actual if n not in recorded)
    if unlisted:
        raise CheckpointError(f"{where}: tensor(s) {unlisted[:5]} have no recorded digest (renamed or added after "
                              "writing)")
    gone = sorted(n for n in recorded if n not in actual)
    if gone:
        raise CheckpointError(f"{where}: tensor(s) {gone[:5]} have a recorded digest but are not stored (deleted or "
                              "renamed after writing)")
    bad = sorted(n for n in actual if actual[n] != recorded[n])
    if bad:
        raise CheckpointError(f"{where}: tensor {bad[0]!r}" + (f" (and {bad[1:5]})" if len(bad) > 1 else "")
                              + " does not match the digest written with it: the file was corrupted or edited "
                              "(tensors swapped, bytes or header changed); verify=False skips this check")
    return len(actual)


def verify_shards(root, located: Mapping[str, str], *, verify: bool = True) -> int:
    """Check the safetensors shards of an export (``located``: ``{tensor name: file name}``, as
    :func:`bridge.checkpoint.store.open_shards` returns) against the per-tensor SHA-256 digests our
    exporters write into their metadata (:mod:`bridge.checkpoint.checksum`). Shards written by other tools
    carry none and are not checked (0 returned); ``verify=False`` checks nothing."""
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be True or False, got {verify!r}")
    if not verify:
        return 0
    return checksum.verify_files(Path(root) / f for f in sorted(set(located.values())))


def register_exporter(exporter: Exporter, *, replace: bool = False) -> Exporter:
    """Add ``exporter`` under its :attr:`~Exporter.name`."""
    return EXPORTERS.register(getattr(exporter, "name", None), exporter, replace=replace)


def read_source(checkpoint, *, verify: bool = True) -> Checkpoint:
    """Read a qtransform checkpoint directory into a :class:`Checkpoint` (checksums verified unless
    ``verify=False``); :class:`~bridge.CheckpointError` when it is not one. Its carried tensors
    (``meta.carried``) are :attr:`Checkpoint.carried`, not in the tree."""
    root = Path(checkpoint)
    meta = read_metadata(root)
    tree = load_tree(root, verify=verify)
    config = config_file.read_config(root / CONFIG)  # infinity and NaN as Python floats, tagged or bare
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    tree, carried = split_carried(tree, meta.carried, root / CONFIG)
    return Checkpoint(root, meta, tree, config, carried)


def split_carried(tree: Mapping, names, where) -> tuple[dict, dict]:
    """``(tree without them, {name: tensor})`` of the carried tensors ``names`` (a checkpoint's or an export's
    record of them); :class:`~bridge.CheckpointError` naming ``where`` when one is not a stored plain tensor."""
    bad = sorted(n for n in names if n not in tree or not isinstance(tree[n], torch.Tensor))
    if bad:
        raise CheckpointError(f"{where}: carried tensor(s) {bad[:5]} are recorded but not stored as plain tensors "
                              "(deleted, renamed or quantized)")
    names = set(names)
    return {p: v for p, v in tree.items() if p not in names}, {n: tree[n] for n in sorted(names)}


def copy_extras(source: Checkpoint, out: Path, names=EXTRA_FILES) -> list[str]:
    """Copy the tokenizer and generation files that sit beside the checkpoint; the names copied."""
    copied = []
    for name in names:
        src = source.directory / name
        if src.is_file():
            shutil.copy2(src, out / name)
            copied.append(name)
    return copied


def write_config(out: Path, config: Mapping) -> None:
    """``config.json`` in transformers' style (sorted keys, two-space indent, infinity and NaN encoded as the
    installed transformers reads them: :func:`bridge.checkpoint.config_file.config_text`)."""
    config_file.write_config(Path(out) / CONFIG, config)


def export(checkpoint, *, to: str, out, overwrite: bool = False, allow_nearest: bool = False,
           verify: bool = True, like=None, **trace) -> Path:
    """Export the qtransform checkpoint directory ``checkpoint`` to format ``to`` in directory ``out``.

    Raises ``ValueError`` (a :class:`~bridge.CheckpointError` for a damaged checkpoint) before
    anything is written: an unknown target, a checkpoint that is not one, tensors or activation
    quantizers the target cannot hold (each listed by tree path), an ``out`` that exists and is not
    empty without ``overwrite``. ``allow_nearest`` accepts specs the target holds only
    approximately (see :meth:`Exporter.support`). Returns ``Path(out)``.

    ``like`` (the float model, or a zero-argument callable building it, as :func:`bridge.load` takes it) exports a
    checkpoint of a model that is not a transformers one, for targets that trace a forward (``onnx``); ``trace``
    are their options (``example_inputs``, ``dynamic_shapes``, ``opset``...: see
    :func:`bridge.interop.onnx.export_module`)."""
    if not isinstance(to, str) or to not in EXPORTERS:
        raise ValueError(f"export: to must be one of {sorted(EXPORTERS)}, got {to!r}")
    for name, flag in (("overwrite", overwrite), ("allow_nearest", allow_nearest), ("verify", verify)):
        if not isinstance(flag, bool):
            raise TypeError(f"export: {name} must be True or False, got {flag!r}")
    target = Path(out)
    if target.exists() and not target.is_dir():
        raise ValueError(f"export: out {target} exists and is not a directory")
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise ValueError(f"export: out {target} exists and is not empty (pass overwrite=True / --overwrite)")
    if Path(checkpoint).resolve() == target.resolve():
        raise ValueError(f"export: out {target} is the checkpoint itself")
    exporter = EXPORTERS[to]
    if like is None and trace:
        raise TypeError(f"export: {sorted(trace)} are options of like= (a model traced on example inputs)")
    if like is not None and "like" not in inspect.signature(exporter.write).parameters:
        raise ValueError(f"export: like= is for targets that trace a model's forward (onnx), not {to!r}")
    options = {} if like is None else {"like": like, **trace}
    source = read_source(checkpoint, verify=verify)
    problems = exporter.problems(source, allow_nearest=allow_nearest, **options)
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise ValueError(f"export to {to}: {len(problems)} item(s) of {source.directory} cannot be expressed:\n  {shown}")
    try:
        with store.atomic_directory(target, overwrite=overwrite) as tmp:
            exporter.write(source, Path(tmp), allow_nearest=allow_nearest, **options)
    except FileExistsError as e:
        raise ValueError(f"export: {e}") from None
    return target

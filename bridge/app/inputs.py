"""What the ``qtransform`` command reads: plugins, recipes (presets or JSON/TOML files), models,
corpora and calibration batches. Every failure is a :class:`UserError`: one line, no traceback."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

__all__ = ["UserError", "load_plugins", "load_recipe", "model_source", "skeleton", "model_and_tokenizer",
           "check_seq_len", "check_vocab", "corpus_text", "sequences", "calibration"]


class UserError(Exception):
    """A mistake in the command line or its inputs: reported in one line, no traceback."""


def load_plugins(plugins) -> None:
    """Import each ``--plugin`` (a ``.py`` file or a module name), for what it registers."""
    import importlib
    import importlib.util

    for i, plugin in enumerate(plugins or ()):
        try:
            if plugin.endswith(".py") or os.sep in plugin:
                path = Path(plugin)
                if not path.is_file():
                    raise UserError(f"plugin file not found: {plugin}")
                spec = importlib.util.spec_from_file_location(f"qtransform_plugin_{i}_{path.stem}", path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = module
                spec.loader.exec_module(module)
            else:
                importlib.import_module(plugin)
        except UserError:
            raise
        except Exception as e:  # anything the plugin raises while importing: one line, named
            raise UserError(f"plugin {plugin}: {type(e).__name__}: {e}") from None


def load_recipe(name_or_file: str):
    """A :class:`qtransform.Preset` (its name is the label) from a preset name or a JSON/TOML recipe file."""
    import qtransform as qt

    path = Path(name_or_file)
    if path.suffix.lower() in (".json", ".toml") or path.exists():
        if not path.is_file():
            raise UserError(f"recipe file not found: {path}")
        try:
            text = path.read_text()
            if path.suffix.lower() == ".toml":
                try:
                    import tomllib
                except ImportError:  # Python 3.10
                    import tomli as tomllib
                data = tomllib.loads(text)
            else:
                data = json.loads(text)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read recipe file {path}: {e}") from None
        try:
            return qt.recipe_from_dict(data, name=str(path))
        except (TypeError, ValueError) as e:
            raise UserError(f"recipe file {path}: {e}") from None
    try:
        return qt.get_preset(name_or_file)
    except ValueError as e:
        raise UserError(str(e)) from None


def corpus_text(source: str, part: str = "eval") -> str:
    from . import corpus

    what = "corpus" if part == "eval" else f"{part} corpus"
    try:
        return corpus.load_text(source, part=part)
    except (OSError, ValueError, ImportError) as e:
        raise UserError(f"cannot read {what} {source!r}: {e}") from None


def sequences(tokenizer, text: str, source: str, seq_len: int, count: int):
    from . import corpus

    try:
        return corpus.token_sequences(text, tokenizer, seq_len=seq_len, max_sequences=count)
    except corpus.CorpusError as e:
        raise UserError(f"corpus {source!r}: {e}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def model_source(model_arg):
    """Where ``--model`` lives and in which format (:func:`bridge.app.models.resolve`, once per
    command): a transformers directory or a GGUF file (checked by its magic bytes), or the default
    model's package is installed. Reads no weights."""
    from . import models

    try:
        source = models.resolve(model_arg)
        models.check_gguf(source)
    except (OSError, ValueError, TypeError) as e:
        raise UserError(_first_line(e)) from None
    return source


def skeleton(source, model_class=None):
    """The model on the ``meta`` device from its config (``model_class``: the class of a task other than
    causal-lm; ``None`` for GGUF files, or when the config cannot be built that way: loading then reports the
    problem)."""
    from . import models

    try:
        return models.skeleton(source, model_class=model_class)
    except Exception:  # noqa: BLE001  (an optional early check; model_and_tokenizer names any real problem)
        return None


def model_and_tokenizer(model_arg, *, source=None, dequantize_imported: bool = False):
    """``(model, tokenizer)`` of ``--model`` (from its ``source`` when :func:`model_source` gave it
    already); any failure to read the user's files (a truncated or corrupted checkpoint, a damaged
    GGUF file) is one line naming the model. A Quark or compressed-tensors checkpoint is read by
    our importer (dequantized with ``dequantize_imported``)."""
    from ..checkpoint import CheckpointError
    from . import models

    source = model_source(model_arg) if source is None else source
    try:
        return models.load_with_tokenizer(source, dequantize_imported=dequantize_imported)
    except ImportError as e:  # a missing optional package: the message says what to install
        raise UserError(_first_line(e)) from None
    except CheckpointError as e:  # ours: names the file and the tensor
        name = models.DEFAULT_MODEL if model_arg is None else model_arg
        raise UserError(f"cannot load model {name}: {_first_line(e)}") from None
    except Exception as e:  # noqa: BLE001  (whatever transformers or safetensors raise on a bad file)
        name = models.DEFAULT_MODEL if model_arg is None else model_arg
        if source.gguf_file is not None:  # transformers words these as "not a valid JSON file"
            root = _root_cause(e)
            raise UserError(f"cannot load model {name}: not a readable GGUF file "
                            f"({type(root).__name__}: {_first_line(root)})") from None
        raise UserError(f"cannot load model {name}: {type(e).__name__}: {_first_line(e)}") from None


def _root_cause(e: BaseException) -> BaseException:
    seen = set()
    while (e.__cause__ or e.__context__) is not None and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return e


def check_seq_len(model, seq_len: int) -> None:
    """``--seq-len`` must fit the model's positions (learned position tables crash beyond them)."""
    config = getattr(model, "config", None)
    limit = next((getattr(config, k) for k in ("max_position_embeddings", "n_positions")
                  if isinstance(getattr(config, k, None), int)), None)
    if limit is not None and seq_len > limit:
        raise UserError(f"--seq-len {seq_len} exceeds the model's {limit} positions")


def check_vocab(model, batches, what: str) -> None:
    """Every token id of ``batches`` (tensors, or ``None``) has a row in ``model``'s input embeddings: a tokenizer
    larger than the model's vocabulary is refused with both numbers, before any forward pass."""
    from ..arch.embeddings import input_embeddings

    emb = input_embeddings(model)
    rows = getattr(getattr(emb, "weight", None), "shape", (None,))[0]
    if rows is None or batches is None:
        return
    ids = [b["input_ids"] if isinstance(b, dict) else b for b in ([batches] if hasattr(batches, "max") else batches)]
    top = max((int(b.max()) for b in ids if b.numel()), default=-1)
    if top >= rows:
        raise UserError(f"the tokenizer gives token id {top} in the {what}, but the model's embedding has {rows} "
                        f"rows (vocabulary size {rows}): the tokenizer does not belong to this model")


def calibration(a, tokenizer, text: str | None):
    """``--calib N``: N sequences of ``--seq-len`` tokens of ``text``, the corpus's calibration part
    (the built-in corpus's is disjoint from its evaluation part), as batches of ``--calib-batch``
    sequences; ``None`` without ``--calib``."""
    import torch

    if not a.calib:
        return None
    seqs = sequences(tokenizer, text, a.corpus, a.seq_len, a.calib)
    if seqs.shape[0] < a.calib:
        raise UserError(f"corpus {a.corpus!r} holds {seqs.shape[0]} calibration sequences of {a.seq_len} tokens, "
                        f"--calib asks for {a.calib}")
    return list(torch.split(seqs, a.calib_batch))

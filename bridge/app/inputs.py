"""What the ``qtransform`` command reads: plugins, recipes (presets or JSON/TOML files), models,
corpora and calibration batches. Every failure is a :class:`UserError`: one line, no traceback."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

__all__ = ["UserError", "load_plugins", "load_recipe", "load_model", "corpus_text", "sequences", "calibration"]


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


def corpus_text(source: str) -> str:
    from . import corpus

    try:
        return corpus.load_text(source, part="eval")
    except (OSError, ValueError, ImportError) as e:
        raise UserError(f"cannot read corpus {source!r}: {e}") from None


def sequences(tokenizer, text: str, source: str, seq_len: int, count: int):
    from . import corpus

    try:
        return corpus.token_sequences(text, tokenizer, seq_len=seq_len, max_sequences=count)
    except corpus.CorpusError as e:
        raise UserError(f"corpus {source!r}: {e}") from None


def load_model(model_arg):
    from . import models

    try:
        return models.load(model_arg)
    except (FileNotFoundError, ImportError, OSError, ValueError) as e:
        raise UserError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def calibration(a, tokenizer):
    """``--calib N``: N sequences of ``--seq-len`` tokens of the corpus's calibration part (the built-in
    corpus's is disjoint from its evaluation part), as batches of ``--calib-batch`` sequences."""
    import torch

    from . import corpus

    if not a.calib:
        return None
    try:
        text = corpus.load_text(a.corpus, part="calibration")
    except (OSError, ValueError, ImportError) as e:
        raise UserError(f"cannot read calibration corpus {a.corpus!r}: {e}") from None
    seqs = sequences(tokenizer, text, a.corpus, a.seq_len, a.calib)
    if seqs.shape[0] < a.calib:
        raise UserError(f"corpus {a.corpus!r} holds {seqs.shape[0]} calibration sequences of {a.seq_len} tokens, "
                        f"--calib asks for {a.calib}")
    return list(torch.split(seqs, a.calib_batch))

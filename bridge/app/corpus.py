"""Text corpora for perplexity and calibration that work offline, and their token sequences.

Sources (:func:`load_text`):

* ``"builtin"`` (default): the documentation strings of a fixed list of Python standard-library
  modules, present on every machine. Deterministic for a given Python version; the
  ``"eval"`` and ``"calibration"`` parts come from disjoint module lists and share no text.
* a path to a local UTF-8 text file (used whole, for either part);
* ``"hf:NAME"`` or ``"hf:NAME/CONFIG"`` (e.g. ``"hf:wikitext/wikitext-2-raw-v1"``): a Hugging Face
  dataset through the ``datasets`` package when the hub (or its cache) is reachable; the
  ``"eval"`` part reads the ``test`` split, ``"calibration"`` the ``train`` split.

>>> from bridge.app import corpus
>>> docs = corpus.builtin_documents("eval")
>>> len(docs) > 100, set(docs).isdisjoint(corpus.builtin_documents("calibration"))
(True, True)
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import warnings
from pathlib import Path

import torch

__all__ = ["PARTS", "MAX_CONTROL_FRACTION", "EVAL_MODULES", "CALIBRATION_MODULES", "CorpusError",
           "builtin_documents", "module_docstrings", "load_text", "control_fraction", "check_text", "token_sequences"]

PARTS = ("eval", "calibration")
#: A corpus with a larger fraction of control characters (NUL, escape...) is refused as not text.
MAX_CONTROL_FRACTION = 0.1
_CONTROL = re.compile("[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f]")

#: Standard-library modules whose docstrings make the evaluation text.
EVAL_MODULES = ("argparse", "calendar", "csv", "difflib", "fractions", "heapq", "ipaddress",
                "pathlib", "statistics", "textwrap", "typing", "zipfile")
#: Disjoint from EVAL_MODULES: the calibration text.
CALIBRATION_MODULES = ("abc", "ast", "base64", "bisect", "collections", "configparser", "contextlib",
                       "copy", "dataclasses", "datetime", "decimal", "enum", "functools", "gettext",
                       "glob", "gzip", "hashlib", "inspect", "json", "logging", "mailbox", "numbers",
                       "operator", "optparse", "pickle", "platform", "pprint", "queue", "random",
                       "shlex", "shutil", "smtplib", "socket", "string", "subprocess", "tarfile",
                       "tempfile", "threading", "tokenize", "traceback", "unittest", "urllib.parse",
                       "uuid", "warnings", "weakref")


class CorpusError(ValueError):
    """A corpus that cannot be read (missing file, unreachable dataset, empty text)."""


def _check_part(part: str) -> None:
    if part not in PARTS:
        raise ValueError(f"part must be one of {list(PARTS)}, got {part!r}")


def _module_docs(name: str) -> list[str]:
    """Docstrings of module ``name``: the module, then its own classes (and their methods) and
    functions, in name order; objects imported from elsewhere are skipped."""
    return module_docstrings(importlib.import_module(name))


def module_docstrings(mod) -> list[str]:
    """The docstrings (40 characters or more, cleaned) of module ``mod``, its own classes (and their
    methods) and functions, in name order; objects imported from elsewhere are skipped."""
    with warnings.catch_warnings():  # reading a deprecated alias's docstring (typing.io) warns: not ours to fix
        warnings.simplefilter("ignore", DeprecationWarning)
        found = _object_docs(mod)
    return [inspect.cleandoc(d) for d in found if isinstance(d, str) and len(d.strip()) >= 40]


def _object_docs(mod) -> list:
    found = [mod.__doc__]
    for attr, obj in sorted(vars(mod).items()):
        if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isclass(obj):
            found.append(obj.__doc__)
            found += [getattr(m, "__doc__", None) for k, m in sorted(vars(obj).items())
                      if not k.startswith("_") and (inspect.isfunction(m) or isinstance(m, property))]
        elif inspect.isfunction(obj):
            found.append(obj.__doc__)
    return found


def _unique(docs: list[str], exclude: frozenset = frozenset()) -> list[str]:
    seen, out = set(exclude), []
    for d in docs:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def builtin_documents(part: str = "eval") -> list[str]:
    """The built-in corpus as a list of documents (docstrings), deterministic and de-duplicated.

    No text occurs in both parts: calibration documents equal to an evaluation one are dropped.
    """
    _check_part(part)
    eval_docs = _unique([d for m in EVAL_MODULES for d in _module_docs(m)])
    if part == "eval":
        docs = eval_docs
    else:
        docs = _unique([d for m in CALIBRATION_MODULES for d in _module_docs(m)], frozenset(eval_docs))
    if not docs:
        raise CorpusError("the built-in corpus is empty: Python runs without docstrings (-OO or "
                          "PYTHONOPTIMIZE=2); pass a text file instead")
    return docs


def _read_file(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CorpusError(f"cannot read corpus file {path}: {e}") from None
    if not text.strip():
        raise CorpusError(f"corpus file {path} is empty")
    check_text(text, f"corpus file {path}")
    return text


def control_fraction(text: str) -> float:
    """The fraction of ``text``'s characters that are NUL or other control characters (tab, newline,
    carriage return and form feed count as text).

    >>> control_fraction("ab\\x00\\x01"), control_fraction("a\\tb\\n")
    (0.5, 0.0)
    """
    if not text:
        return 0.0
    return (len(text) - len(_CONTROL.sub("", text))) / len(text)


def check_text(text: str, what: str = "corpus") -> None:
    """``CorpusError`` when more than :data:`MAX_CONTROL_FRACTION` of ``text`` is control characters
    (a binary file read as text: calibrating on it would fit the quantization to noise)."""
    fraction = control_fraction(text)
    if fraction > MAX_CONTROL_FRACTION:
        raise CorpusError(f"{what} is not text: {fraction:.1%} of its {len(text)} characters are NUL or control "
                          f"characters (at most {MAX_CONTROL_FRACTION:.0%} allowed)")


def _read_dataset(spec: str, part: str, text_field: str) -> str:
    name, _, config = spec.partition("/")
    if not name:
        raise CorpusError(f"bad dataset name {'hf:' + spec!r}; expected hf:NAME or hf:NAME/CONFIG")
    try:
        import datasets
    except ImportError:
        raise CorpusError(f"reading hf:{spec} needs the datasets package: pip install datasets") from None
    split = "test" if part == "eval" else "train"
    try:
        ds = datasets.load_dataset(name, config or None, split=split)
    except Exception as e:  # network, offline mode, unknown name or split: one clear message
        raise CorpusError(f"cannot load dataset hf:{spec} (split {split}): {type(e).__name__}: {e}. "
                          "Without network access use the built-in corpus or a local text file.") from None
    if text_field not in ds.column_names:
        raise CorpusError(f"dataset hf:{spec} has no {text_field!r} column (columns: {ds.column_names})")
    text = "\n\n".join(t for t in ds[text_field] if t and t.strip())
    check_text(text, f"dataset hf:{spec}")
    return text


def load_text(source: str | os.PathLike = "builtin", *, part: str = "eval", text_field: str = "text") -> str:
    """The text of a corpus ``source`` (see the module docstring) for ``part``."""
    _check_part(part)
    if isinstance(source, os.PathLike):
        return _read_file(Path(source))
    if not isinstance(source, str):
        raise TypeError(f"corpus source must be a string or a path, got {type(source).__name__}")
    if source == "builtin":
        return "\n\n".join(builtin_documents(part))
    if source.startswith("hf:"):
        return _read_dataset(source[3:], part, text_field)
    path = Path(source).expanduser()
    if not path.exists():
        raise CorpusError(f"corpus not found: {source!r} (use 'builtin', a text file path, or "
                          "hf:NAME[/CONFIG] for a Hugging Face dataset)")
    return _read_file(path)


def token_sequences(text: str, tokenizer, *, seq_len: int = 512, max_sequences: int | None = None) -> torch.Tensor:
    """Consecutive, non-overlapping ``seq_len``-token windows of ``text``: int64 ``(n, seq_len)``.

    Tokens come from ``tokenizer(text, add_special_tokens=False)``; the incomplete tail is
    dropped. ``max_sequences`` keeps the first ones (only as much text as needed is tokenized).
    """
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
    if max_sequences is not None and (isinstance(max_sequences, bool) or not isinstance(max_sequences, int)
                                      or max_sequences < 1):
        raise ValueError(f"max_sequences must be a positive int or None, got {max_sequences!r}")
    if not isinstance(text, str) or not text:
        raise CorpusError("no text to tokenize")
    need = None if max_sequences is None else max_sequences * seq_len
    end = len(text) if need is None else _paragraph_end(text, 8 * need)  # ~4 characters a token
    while True:
        ids = tokenizer(text[:end], add_special_tokens=False)["input_ids"]
        if need is None or len(ids) >= need or end == len(text):
            break
        end = _paragraph_end(text, 2 * end)
    n = len(ids) // seq_len if need is None else min(len(ids) // seq_len, max_sequences)
    if n == 0:
        raise CorpusError(f"the text has {len(ids)} tokens, fewer than one sequence of {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.int64).reshape(n, seq_len)


def _paragraph_end(text: str, at_least: int) -> int:
    """The first paragraph break at or after ``at_least`` characters (or the end of ``text``)."""
    if at_least >= len(text):
        return len(text)
    end = text.find("\n\n", at_least)
    return len(text) if end < 0 else end

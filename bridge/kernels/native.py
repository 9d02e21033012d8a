"""Building the project's small C++ CPU kernels at first use (``torch.utils.cpp_extension``).

Each kernel source sits beside its Python module; :func:`build_extension` compiles it once per machine
(gcc and ninja) into a directory of torch's extension cache named after what the build depends
on (the source's bytes, the flags, torch's version and the Python environment), so later
processes only load it, and two checkouts or virtualenvs of different versions never rebuild over
each other's files; a build lock left by a killed build (older than :data:`STALE_LOCK_S`) is
removed instead of waited on forever. It returns the extension, or ``None`` and the reason it cannot run here: no AVX2 + FMA, no
C++ compiler, a build error, or ``QTRANSFORM_NO_NATIVE_KERNELS`` set. Callers keep a plain-torch
path for that case, so a machine without a compiler computes the same results, only slower.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import shutil
import sys
import time

import torch

__all__ = ["build_extension", "build_directory", "CFLAGS", "STALE_LOCK_S"]

CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-DNDEBUG")
#: A build lock older than this (seconds) belongs to a build that was killed: builds take < 2 min.
STALE_LOCK_S = 900


def build_directory(path: pathlib.Path, name: str) -> pathlib.Path:
    """Where the build of ``path`` goes: torch's extension cache, ``<name>-<digest>`` of the source's
    bytes and place, the flags, torch's version and this Python environment (two checkouts of the same
    source get two builds: the ninja file names the source by its path, and one shared build directory
    would be rebuilt each time the other checkout loads it)."""
    from torch.utils import cpp_extension

    h = hashlib.sha256(path.read_bytes())
    h.update(repr((CFLAGS, torch.__version__, sys.prefix, str(path.resolve()))).encode())
    root = pathlib.Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / "qtransform"
    return root / f"{name}-{h.hexdigest()[:16]}"


def _remove_stale_lock(directory: pathlib.Path) -> None:
    lock = directory / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
    except FileNotFoundError:
        pass


@functools.cache
def build_extension(source: str, name: str, *, env: str | None = None):
    """``(extension, None)`` when ``source`` (a file name beside this module) builds and runs here,
    else ``(None, reason)``; once per process. ``env``: a variable that, when set, turns it off."""
    for var in filter(None, ("QTRANSFORM_NO_NATIVE_KERNELS", env)):
        if os.environ.get(var):
            return None, f"disabled by {var}"
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in ("AVX2", "AVX512"):
        return None, f"CPU capability {cap}: the kernel needs AVX2 + FMA"
    path = pathlib.Path(__file__).with_name(source)
    if not path.is_file():
        return None, f"kernel source {source} is not installed"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return None, "no C++ compiler found (set CXX)"
    try:
        from torch.utils import cpp_extension
        directory = build_directory(path, name)
        directory.mkdir(parents=True, exist_ok=True)
        _remove_stale_lock(directory)
        mod = cpp_extension.load(name=name, sources=[str(path)], extra_cflags=list(CFLAGS),
                                 extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
    except Exception as e:  # no ninja, a compiler error, a read-only cache: fall back, say why
        return None, f"building {source} failed: {type(e).__name__}: {str(e).strip()[:300]}"
    return mod, None

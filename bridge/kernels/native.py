"""Building the project's small C++ CPU kernels at first use (``torch.utils.cpp_extension``).

Each kernel source sits beside its Python module; :func:`build` compiles it once per machine
(gcc and ninja; the build is cached in torch's extension directory, so later processes only load
it) and returns the extension, or ``None`` and the reason it cannot run here: no AVX2 + FMA, no
C++ compiler, a build error, or ``QTRANSFORM_NO_NATIVE_KERNELS`` set. Callers keep a plain-torch
path for that case, so a machine without a compiler computes the same results, only slower.
"""

from __future__ import annotations

import functools
import os
import pathlib
import shutil

import torch

__all__ = ["build", "CFLAGS"]

CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-DNDEBUG")


@functools.cache
def build(source: str, name: str, *, env: str | None = None):
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
        mod = cpp_extension.load(name=name, sources=[str(path)], extra_cflags=list(CFLAGS),
                                 extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no ninja, a compiler error, a read-only cache: fall back, say why
        return None, f"building {source} failed: {type(e).__name__}: {str(e).strip()[:300]}"
    return mod, None

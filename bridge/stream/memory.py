"""Memory settings of a streamed run.

A streamed run allocates and frees tensors of hundreds of megabytes, one after another. glibc serves every
allocation that large with a fresh ``mmap`` and unmaps it when freed, so each new tensor pays a page fault
per 4 KiB page (on an 8B model that is ~50 million faults, more time in the kernel than in the arithmetic).
:func:`reuse_freed_memory` asks glibc to serve them from its heap and keep what is freed for the next
tensor (``mallopt``: no ``mmap`` for large blocks, no trimming): the same peak, without the faults. It does
nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["reuse_freed_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_done = False


def reuse_freed_memory() -> bool:
    """Keep freed heap memory for reuse (see the module docstring); ``True`` when glibc took the settings."""
    global _done
    if _done or not sys.platform.startswith("linux"):
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**30))
    return _done

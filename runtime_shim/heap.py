"""Freed heap memory handed back to the OS after the one-off steps that churn it.

glibc's malloc keeps what a process frees for its next requests, so a step that builds
and drops tens of MiB of temporaries leaves them resident for the life of the process:
building the tokenizer (the ``tokenizers`` library's serde temporaries) and parsing its
JSON do, once each, before the first forward pass. ``malloc_trim(0)`` returns the free
pages; C libraries without it (musl, macOS, Windows) get nothing done here.
"""

from __future__ import annotations

import sys
from functools import lru_cache
from typing import Any

__all__ = ["release_freed_memory"]


@lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim`` as a ctypes function, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """Return the heap's free pages to the OS; True if any were (False: none, or no
    ``malloc_trim`` on this platform)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False

"""Freed heap memory handed back to the OS after the one-off steps that churn it.

glibc's malloc keeps what a process frees for its next requests, so a step that builds
and drops tens of MiB of temporaries leaves them resident for the life of the process:
building the tokenizer (the ``tokenizers`` library's serde temporaries) and parsing its
JSON do, once each, before the first forward pass. ``malloc_trim(0)`` returns the free
pages; C libraries without it (musl, macOS, Windows) get nothing done here.

A library's code is resident as far as it ran: the ``tokenizers`` extension's 6.5 MiB
once a prompt is encoded. :func:`release_code_pages` unmaps those clean file pages from
the process when it is done with the library (the kernel reads them back if it runs
again), as it would under memory pressure; :func:`release_library_code` does it for
every library once a run's one-off steps are over. Linux only (``/proc/self/smaps``).
"""

from __future__ import annotations

import mmap
import re
import sys
from collections.abc import Callable
from functools import lru_cache
from typing import Any

__all__ = ["release_code_pages", "release_freed_memory", "release_library_code"]


@lru_cache(maxsize=1)
def _libc() -> Any:
    """The C library this process already runs on (ctypes), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


@lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim`` as a ctypes function, or None where there is none."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        import ctypes

        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


@lru_cache(maxsize=1)
def _madvise() -> Any:
    """``madvise`` as a ctypes function, or None off Linux."""
    libc = _libc()
    if libc is None or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    import ctypes

    advise = libc.madvise
    advise.argtypes, advise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return advise


def release_freed_memory() -> bool:
    """Return the heap's free pages to the OS; True if any were (False: none, or no
    ``malloc_trim`` on this platform)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


def _clean_mappings(wanted: Callable[[str], bool]) -> list[tuple[int, int]]:
    """(start, length) of the read-only mappings of the files ``wanted`` accepts that hold
    no private copy of a page (``Anonymous: 0 kB``: every resident page is the file's)."""
    spans: list[tuple[int, int]] = []
    current: tuple[int, int] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
                lo, hi = (int(a, 16) for a in fields[0].split("-"))
                mapped = len(fields) > 5 and wanted(fields[5]) and "w" not in fields[1]
                current = (lo, hi - lo) if mapped else None
            elif current is not None and fields[0] == "Anonymous:" and fields[1] == "0":
                spans.append(current)
    return spans


def release_code_pages(path: str) -> int:
    """Unmap the resident pages of the shared library at ``path`` from this process (its
    read-only mappings with no private page: code and constants, never relocated data);
    the bytes of the mappings advised (0: none, or not Linux)."""
    return _release(lambda mapped: mapped == path)


_SHARED_LIBRARY = re.compile(r"\.so(\.\d+)*$")  # libx.so, libx.so.6, libx.so.1.0.30


def release_library_code() -> int:
    """:func:`release_code_pages` of every shared library this process maps: after the
    one-off steps of a run (imports, open, the tokenizer) only the code it runs from then
    on faults back in. The bytes of the mappings advised."""
    return _release(lambda mapped: _SHARED_LIBRARY.search(mapped) is not None)


def _release(wanted: Callable[[str], bool]) -> int:
    advise = _madvise()
    if advise is None:
        return 0
    try:
        spans = _clean_mappings(wanted)
    except OSError:
        return 0
    done = 0
    for start, length in spans:
        if advise(start, length, mmap.MADV_DONTNEED) == 0:
            done += length
    return done

"""Map a file's pages read-only at a fixed address inside memory the caller reserved.

The KV pool keeps one array per KV part, block ids indexing it (that is all the native
attention reads). A stored prefix's pages live in the package file; mapping them over a
reserved stretch of that array (``MAP_FIXED``, read-only, private) makes them pool blocks
without a copy, and any write to them would fault instead of changing what others read.
Python's :mod:`mmap` cannot map at a given address, hence libc through :mod:`ctypes`;
where that is not available (not Linux or macOS, not 64-bit) :func:`map_file_pages`
says so and the caller copies instead.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from functools import cache

__all__ = ["PAGE", "map_file_pages"]

PAGE = mmap.PAGESIZE
_PROT_READ = 0x1
_MAP_FIXED = 0x10  # the same value on Linux (every architecture it runs on here) and macOS


@cache
def _mmap():  # -> the libc function, or None
    if sys.platform not in ("linux", "darwin") or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    try:
        # the C library the process runs on (ctypes.util.find_library would name the same
        # one, importing subprocess and more for it: +1.3 MiB resident at every open)
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = libc.mmap
    fn.restype = ctypes.c_void_p
    fn.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_int64,
    ]  # fmt: skip
    return fn


def map_file_pages(address: int, length: int, fd: int, offset: int) -> bool:
    """Map ``length`` bytes of ``fd`` from ``offset`` read-only over ``address`` (both
    page aligned; the range must be the caller's own mapping, which this replaces).
    False when this platform cannot or the kernel refused (nothing changed then)."""
    fn = _mmap()
    if fn is None or address % PAGE or offset % PAGE or length <= 0:
        return False
    got = fn(address, length, _PROT_READ, mmap.MAP_PRIVATE | _MAP_FIXED, fd, offset)
    return got == address

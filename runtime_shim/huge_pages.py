"""Map the package's weights in 2 MiB pages, still zero-copy.

Decode streams every weight once per token: with 4 KiB pages that is ~35k TLB misses a
token for SmolLM2 int8 (136 MB), each a page walk (two-dimensional under a hypervisor),
and it cost 1.6-1.8x decode time on the shared 2-core test VM (int8 and int4 alike).
Linux maps a file's page-cache folios with one entry each when they are 2 MiB and the
mapping is aligned, and a mapping advised ``MADV_HUGEPAGE`` has its faults read the file
in such folios. Pages cached before in small folios (the file was just written, or read
with ``read()``) stay small; then the file's cached pages are dropped once, so the
next faults read them back huge (a re-read of the file, only while they are small).
The page size changes nothing else: the same bytes, the same bits out.
"""

from __future__ import annotations

import bisect
import os
import sys

import numpy as np

from edgepack.format.reader import Package, QuantizedTensor

__all__ = ["HUGE_PAGE", "map_weights_huge"]

HUGE_PAGE = 2 << 20
_PROBES = 8  # pages touched to tell how the file is mapped


def map_weights_huge(pkg: Package) -> str:
    """Ask for huge pages and make them take: 'huge' (already, or read so), 'refreshed'
    (small cached pages dropped, read back huge), 'small' (the kernel keeps them small, or
    there is no sign it makes huge file folios, so the cache is kept),
    'unsupported' (not Linux, no THP, a file under 2 huge pages, a mapping not aligned to
    them). Call it before anything reads the data: what was read before the advice stays
    small until dropped. The probes' 2 MiB pages stay resident: the Model releases the
    package's pages once bound."""
    if sys.platform != "linux" or not _thp_enabled() or not pkg.advise_huge_pages():
        return "unsupported"
    probes = _probe_views(pkg)
    if len(probes) < 2 or _address(probes[0]) % HUGE_PAGE:
        return "unsupported"  # (a mapping whose address is not aligned to huge pages)
    if _touch_and_count(pkg, probes):
        return "huge"
    if not _file_huge_pages_seen():
        return "small"  # no evidence this kernel makes huge file folios: keep the cache
    pkg.release_resident_pages()  # mapped pages are never dropped from the cache
    os.posix_fadvise(pkg.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return "refreshed" if _touch_and_count(pkg, probes) else "small"


def _thp_enabled() -> bool:
    """Transparent huge pages not switched off (the advice is then worth giving)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _file_huge_pages_seen() -> bool:
    """The page cache holds some 2 MiB file folios already: evidence that this kernel's
    file systems make them, else dropping the cache would only cost a re-read. (A package
    not cached when opened is read in huge folios by the advice alone, which is how the
    first evidence appears on a fresh boot.)"""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("FileHugePages:"):
                    return int(line.split()[1]) > 0
    except OSError:
        pass
    return False


def _probe_views(pkg: Package) -> list[np.ndarray]:
    """One byte view at each of up to _PROBES 2 MiB-aligned file offsets spread over the
    tensors' data (distinct huge pages), taken from the tensors' zero-copy views."""
    parts: list[tuple[int, np.ndarray]] = []
    for name in pkg.tensor_names:
        if pkg.entry(name).factors:
            continue  # a low-rank entry's data are its factors, themselves entries
        t = pkg.tensor(name)
        arrays = (t.codes, t.scales, t.zeros) if isinstance(t, QuantizedTensor) else (t,)
        for a in arrays:
            off = None if a is None or a.nbytes == 0 else pkg.mapped_offset(a)
            if off is not None and a.flags.c_contiguous:
                parts.append((off, a.reshape(-1).view(np.uint8)))
    if not parts:
        return []
    parts.sort(key=lambda p: p[0])
    starts = [p[0] for p in parts]
    lo, hi = starts[0], max(off + a.nbytes for off, a in parts)
    pages = sorted({-(-(lo + i * (hi - lo) // _PROBES) // HUGE_PAGE) for i in range(_PROBES)})
    views = []
    for page in pages:
        at = page * HUGE_PAGE
        i = bisect.bisect_right(starts, at) - 1
        if i >= 0 and at + HUGE_PAGE <= hi and at - parts[i][0] < parts[i][1].nbytes:
            views.append(parts[i][1][at - parts[i][0] :][:1])
    return views


def _touch_and_count(pkg: Package, probes: list[np.ndarray]) -> bool:
    """Fault each probe in; True when the mapping then holds them all in huge pages."""
    for v in probes:
        int(v[0])
    return _pmd_mapped_kib(_address(probes[0])) >= len(probes) * (HUGE_PAGE >> 10)


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _pmd_mapped_kib(address: int) -> int:
    """FilePmdMapped of the mapping holding ``address`` (/proc/self/smaps), 0 if absent."""
    inside = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and not head.endswith(":"):
                    a, _, b = head.partition("-")
                    inside = int(a, 16) <= address < int(b, 16)
                elif inside and line.startswith("FilePmdMapped:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0

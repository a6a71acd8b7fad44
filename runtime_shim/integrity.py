"""Weights are hash-checked before they run; a verified-install record may stand in for that.

A package's signature covers its header digest, and the header binds the SHA-256 of every
tensor, so a trusted signature vouches for the weights only once their bytes are checked
against those hashes. :func:`verify_weights` does that at open for every tensor, on
several threads (SHA-256 releases the GIL); bench/integrity.py measures what it costs.

The escape for the update client: :func:`record_verified` fully verifies an installed
package (signature and every hash) and writes an :class:`IntegrityRecord` naming the
file's identity. A later :func:`check_weights` with the same ``records_dir`` skips
re-hashing only when the open file still has exactly that identity.

How a record is protected, and what it does not protect against:

* It is keyed by the header digest (checked at every open, and what signatures cover)
  and holds the file's ``st_dev``, ``st_ino``, ``st_size``, ``st_mtime_ns`` and
  ``st_ctime_ns``, read with ``fstat`` from the descriptor that is mapped (not the path,
  so the file cannot be swapped between check and use). Any write to the file, and any
  ``utime`` resetting its mtime, moves ``st_ctime`` to the present; user space cannot
  set ctime back. A record is written only if the identity is the same before and after
  the full hash, so a write during verification voids it.
* The record directory is trusted by permission only: records are plain JSON (mode
  0600) in a directory of mode 0700; a record, or a records directory, that is not owned
  by the current user or is writable by group or others is ignored (the weights are
  hashed instead).
* Not protected: anyone who can write the records directory (the same user as the
  update client, root); writes that bypass the filesystem (the raw block device, an
  offline disk edit) or a root-set clock, which can leave ctime unchanged; a write in the
  same timestamp tick as the check that starts verification (coarse-ctime filesystems);
  and modification of the file *after* it was opened (true of hashing at open too: the
  mapping is shared with the file).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edgepack.format import Encoding, Package

__all__ = [
    "IntegrityRecord",
    "check_weights",
    "find_record",
    "record_verified",
    "verify_weights",
]

_log = logging.getLogger("edgepack.runtime")
RECORD_SCHEMA = 1


@dataclass(frozen=True)
class IntegrityRecord:
    """What was verified: the file identity of one package, by its header digest."""

    header_digest: str  # hex
    st_dev: int
    st_ino: int
    st_size: int
    st_mtime_ns: int
    st_ctime_ns: int
    verified_at_ns: int = 0
    schema: int = RECORD_SCHEMA

    @classmethod
    def of(cls, pkg: Package) -> IntegrityRecord:
        st = pkg.file_stat()
        return cls(
            pkg.preamble.header_digest.hex(),
            st.st_dev,
            st.st_ino,
            st.st_size,
            st.st_mtime_ns,
            st.st_ctime_ns,
        )

    def same_file(self, other: IntegrityRecord) -> bool:
        """Equal in everything but when it was verified."""
        keep = ("verified_at_ns",)
        mine, theirs = asdict(self), asdict(other)
        return all(mine[k] == theirs[k] for k in mine if k not in keep)


def verify_weights(pkg: Package, threads: int | None = None) -> int:
    """Hash every stored tensor against the header (raises ``CorruptPackageError``);
    return the bytes hashed. Tensors are spread over ``threads`` (default: all CPUs)."""
    entries = [t for t in pkg.header.tensors if t.encoding != Encoding.LOW_RANK]
    entries.sort(key=lambda t: t.nbytes, reverse=True)  # big ones first balances threads
    workers = max(1, min(threads or os.cpu_count() or 1, len(entries) or 1))
    if workers == 1:
        for t in entries:
            pkg.verify_tensor(t.name)
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="edgepack-verify") as pool:
            list(pool.map(pkg.verify_tensor, (t.name for t in entries)))
    return sum(t.nbytes for t in entries)


def _record_path(records_dir: Path, header_digest_hex: str) -> Path:
    return records_dir / f"{header_digest_hex}.json"


def _private(path: Path) -> bool:
    """Owned by us and not writable by group or others."""
    try:
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def find_record(pkg: Package, records_dir: str | os.PathLike[str]) -> IntegrityRecord | None:
    """The record vouching for ``pkg``'s open file, or None when there is none that is
    trustworthy (see the module docstring) and matches the file's identity now."""
    directory = Path(records_dir)
    current = IntegrityRecord.of(pkg)
    path = _record_path(directory, current.header_digest)
    if not path.is_file():
        return None
    if not (_private(directory) and _private(path)):
        _log.warning("ignoring integrity record %s: writable by others or not ours", path)
        return None
    try:
        raw = json.loads(path.read_text())
        record = IntegrityRecord(**raw)
    except (OSError, ValueError, TypeError) as exc:
        _log.warning("ignoring unreadable integrity record %s: %s", path, exc)
        return None
    return record if record.schema == RECORD_SCHEMA and record.same_file(current) else None


def record_verified(
    path: str | os.PathLike[str],
    trusted_keys: Sequence[Any],
    records_dir: str | os.PathLike[str],
    *,
    threshold: int = 1,
) -> IntegrityRecord:
    """Fully verify the package at ``path`` (``threshold`` of ``trusted_keys`` signed it,
    every tensor and section hash) and record its file identity in ``records_dir``.

    For the update client, right after installing a package. Raises the package's
    ``SignatureError`` / ``CorruptPackageError``, or ``CorruptPackageError`` when the file
    changed while it was being verified."""
    from edgepack.format import CorruptPackageError

    from .model import load_trusted_keys

    keys = load_trusted_keys(trusted_keys)
    if not keys:
        raise ValueError("record_verified needs trusted keys: a record vouches for a signature")
    directory = Path(records_dir)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    with Package.open(path) as pkg:
        before = IntegrityRecord.of(pkg)
        pkg.verify(keys, threshold=threshold)
        after = IntegrityRecord.of(pkg)
    if not before.same_file(after):
        raise CorruptPackageError(f"{path} changed while it was being verified")
    record = IntegrityRecord(**{**asdict(after), "verified_at_ns": time.time_ns()})
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-record-")
    try:
        with os.fdopen(fd, "w") as f:  # mkstemp files are mode 0600
            json.dump(asdict(record), f, sort_keys=True)
        os.replace(tmp, _record_path(directory, record.header_digest))
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return record


def check_weights(
    pkg: Package,
    records_dir: str | os.PathLike[str] | None = None,
    threads: int | None = None,
) -> str:
    """Make sure ``pkg``'s tensors match its header before they are used: through a valid
    record in ``records_dir`` (``"record"``), else by hashing them (``"hashed"``)."""
    if records_dir is not None and find_record(pkg, records_dir) is not None:
        return "record"
    verify_weights(pkg, threads)
    return "hashed"

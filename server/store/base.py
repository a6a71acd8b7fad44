"""The store interface: a flat namespace of objects under ``/``-separated keys.

Two kinds of objects live in a store:

* **payloads** (packages, deltas) under ``objects/sha256/<hex>``: content addressed,
  written once, never changed. :meth:`Store.put_object` hashes the file, skips the
  upload when the object is already there, and checks what landed;
* **metadata** (small JSON files): written whole and atomically with
  :meth:`Store.put_bytes`, optionally conditional - ``if_absent`` (create only) or
  ``if_match`` (compare-and-swap against the ETag returned by :meth:`Store.get_bytes`).
  A lost condition raises :class:`~edgepack.server.errors.ConcurrentUpdateError`.

A reader never sees a partial object: local writes go through a temporary file and a
rename, S3 makes an object visible only once its upload completed. Publishing payloads
first and metadata last (see ``edgepack.server.releases``) therefore never exposes
metadata that points at missing or partial bytes.

Backends implement the abstract methods; the content addressing, hashing and
verification live here once.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from edgepack.format.output_file import STALE_AGE_SECONDS

from ..errors import ObjectNotFoundError, StoreError

__all__ = [
    "CHUNK_SIZE",
    "OBJECTS_PREFIX",
    "ObjectInfo",
    "PendingUpload",
    "Store",
    "check_key",
    "object_key",
    "sha256_file",
]

CHUNK_SIZE = 1024 * 1024
OBJECTS_PREFIX = "objects/sha256/"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_KEY_PART = re.compile(r"^[A-Za-z0-9._+=@-]+$")


def object_key(sha256_hex: str) -> str:
    """The key of the content-addressed object with this SHA-256."""
    if not _HEX64.fullmatch(sha256_hex):
        raise ValueError(f"not a lowercase hex SHA-256: {sha256_hex!r}")
    return OBJECTS_PREFIX + sha256_hex


def check_key(key: str) -> str:
    """Refuse keys that could escape the store root or differ between backends."""
    if not key or len(key) > 1024 or key.startswith("/") or key.endswith("/"):
        raise ValueError(f"invalid store key {key!r}")
    for part in key.split("/"):
        if part in ("", ".", "..") or not _KEY_PART.fullmatch(part) or part.startswith(".tmp"):
            raise ValueError(f"invalid store key {key!r}")
    return key


def sha256_file(path: str | os.PathLike[str]) -> tuple[str, int]:
    """(hex SHA-256, size) of a file, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_SIZE):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


@dataclass(frozen=True)
class ObjectInfo:
    """What a store knows about an object without reading it.

    ``sha256`` is known for content-addressed objects (from the key) and for objects
    the backend recorded it for; ``etag`` is an opaque token for ``if_match``;
    ``modified`` the time of the last write (POSIX seconds), when the backend says.
    """

    key: str
    size: int
    etag: str = ""
    sha256: str | None = None
    modified: float | None = None


@dataclass(frozen=True)
class PendingUpload:
    """An upload begun and never completed (S3 multipart): invisible to readers, billed
    as storage until aborted. ``last_activity`` is its newest part's time (its start if
    it has none): a live uploader lands a part every few seconds, so a long-idle upload
    is a killed one's."""

    key: str
    upload_id: str
    started: float  # POSIX seconds
    last_activity: float
    size: int  # bytes in the parts received

    def idle(self, now: float) -> float:
        return now - self.last_activity


class Store(ABC):
    """Abstract store. ``url`` is the canonical URL it was opened with."""

    url: str

    # -- backend primitives --------------------------------------------------------
    @abstractmethod
    def stat(self, key: str) -> ObjectInfo | None:
        """Size/ETag of ``key``, or None if it does not exist."""

    @abstractmethod
    def iter_bytes(
        self, key: str, start: int = 0, length: int | None = None, chunk_size: int = CHUNK_SIZE
    ) -> Iterator[bytes]:
        """Stream ``length`` bytes (default: to the end) of ``key`` from ``start``.

        Raises :class:`ObjectNotFoundError` before yielding if the key does not exist.
        """

    @abstractmethod
    def get_bytes(self, key: str, *, max_length: int = 16 * 1024 * 1024) -> tuple[bytes, str]:
        """Whole content and ETag of a small object; refuses objects above max_length."""

    @abstractmethod
    def put_bytes(
        self,
        key: str,
        data: bytes,
        *,
        if_absent: bool = False,
        if_match: str | None = None,
        content_type: str = "application/octet-stream",
    ) -> str:
        """Atomically replace (or create) ``key`` with ``data``; return the new ETag.

        ``if_absent``: fail with ConcurrentUpdateError if the key exists.
        ``if_match``: fail with ConcurrentUpdateError unless the current ETag equals it.
        """

    @abstractmethod
    def _put_object_file(self, path: Path, key: str, sha256_hex: str, size: int) -> None:
        """Upload a file whose hash is known to ``key`` (backend part of put_object)."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Objects whose key starts with ``prefix``, in key order."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; missing keys are not an error."""

    def remove_stale_temporaries(self, older_than: float = STALE_AGE_SECONDS) -> int:
        """Delete what killed writers left in the store; return how many. Publish runs
        this first. The default: the uploads idle for ``older_than`` seconds."""
        return len(self.abort_idle_uploads(older_than))

    def pending_uploads(self) -> list[PendingUpload]:
        """Incomplete uploads of this store's objects (a backend without them: none)."""
        return []

    def abort_idle_uploads(
        self, idle_seconds: float, now: float | None = None
    ) -> list[PendingUpload]:
        """Abort the :meth:`pending_uploads` idle for ``idle_seconds`` or more (listed
        afresh, so one that moved since an earlier listing is kept); return them."""
        clock = time.time() if now is None else now
        idle = [u for u in self.pending_uploads() if u.idle(clock) >= idle_seconds]
        for upload in idle:
            self.abort_upload(upload)
        return idle

    def abort_upload(self, upload: PendingUpload) -> None:
        """Discard the parts of ``upload`` (only backends that list uploads have any)."""
        raise NotImplementedError(f"{type(self).__name__} has no pending uploads")

    def touch(self, key: str) -> None:  # noqa: B027 - optional hook
        """Set the object's modification time to now (a backend without times: no-op)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    # -- shared logic ----------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.stat(key) is not None

    def put_object(
        self, path: str | os.PathLike[str], *, expected_sha256: str | None = None
    ) -> ObjectInfo:
        """Store a file content-addressed at ``objects/sha256/<hex>``; idempotent.

        When an object with that hash and size is already there the upload is skipped.
        The file is hashed first; ``expected_sha256`` (if given) must match, so a file
        that changed between verification and upload is refused.
        """
        path = Path(path)
        sha, size = sha256_file(path)
        if expected_sha256 is not None and sha != expected_sha256:
            raise StoreError(
                f"{path} changed while publishing (sha256 {sha[:16]}, expected "
                f"{expected_sha256[:16]})"
            )
        key = object_key(sha)
        have = self.stat(key)
        if have is not None and have.size == size:
            self.touch(key)  # reused: `repo gc` must see it as young (server/releases/gc.py)
            return ObjectInfo(key, size, have.etag, sha)
        self._put_object_file(path, key, sha, size)
        landed = self.stat(key)
        if landed is None or landed.size != size:
            raise StoreError(
                f"upload of {key} did not land intact (size {landed and landed.size}, "
                f"expected {size})",
                retriable=True,
                key=key,
            )
        if landed.sha256 is not None and landed.sha256 != sha:
            raise StoreError(f"upload of {key} landed with the wrong hash", retriable=True, key=key)
        return ObjectInfo(key, size, landed.etag, sha)

    def put_object_stream(
        self,
        stream: BinaryIO,
        *,
        expected_sha256: str | None = None,
        spool_dir: str | os.PathLike[str] | None = None,
    ) -> ObjectInfo:
        """Like :meth:`put_object` for a stream: spooled to a temporary file first (the
        key is the content's hash, known only at the end)."""
        fd, name = tempfile.mkstemp(prefix="edgepack-spool-", dir=spool_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in read_stream(stream):
                    f.write(chunk)
            return self.put_object(name, expected_sha256=expected_sha256)
        finally:
            os.unlink(name)

    def download(
        self,
        key: str,
        dest: str | os.PathLike[str],
        *,
        expected_sha256: str | None = None,
        expected_size: int | None = None,
    ) -> Path:
        """Copy ``key`` to ``dest`` (temporary file + rename), checking size and hash.

        For content-addressed keys the expected hash defaults to the one in the key.
        """
        dest = Path(dest)
        if expected_sha256 is None and key.startswith(OBJECTS_PREFIX):
            expected_sha256 = key[len(OBJECTS_PREFIX) :]
        tmp = dest.with_name(f".{dest.name}.part")
        digest = hashlib.sha256()
        size = 0
        try:
            with open(tmp, "wb") as f:
                for chunk in self.iter_bytes(key):
                    f.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            if expected_size is not None and size != expected_size:
                raise StoreError(f"{key}: got {size} bytes, expected {expected_size}", key=key)
            if expected_sha256 is not None and digest.hexdigest() != expected_sha256:
                raise StoreError(f"{key}: content does not match its sha256", key=key)
            os.replace(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return dest

    def local_path(self, key: str) -> Path | None:
        """A filesystem path holding the object's bytes, if the backend has one."""
        return None

    def read_range(self, key: str, start: int, length: int) -> bytes:
        return b"".join(self.iter_bytes(key, start, length))

    def require(self, key: str) -> ObjectInfo:
        info = self.stat(key)
        if info is None:
            raise ObjectNotFoundError(f"{self.url}: no object {key}", key=key)
        return info

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def read_stream(stream: BinaryIO, chunk_size: int = CHUNK_SIZE) -> Iterator[bytes]:
    while chunk := stream.read(chunk_size):
        yield chunk

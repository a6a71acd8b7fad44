"""The embedded default store: a local directory.

Keys map to files under the root. Every write goes to a temporary file in the target's
directory, is fsynced, then renamed over (or hard-linked to, for create-only writes)
the final name, and the directory is fsynced: a crash leaves the old content or the
new, never a torn file. Temporary names start with ``.tmp`` and are never valid keys,
so :meth:`LocalStore.list` does not see them; :meth:`LocalStore.remove_stale_temporaries`
clears ones a crash left behind.

Conditional writes (``if_absent``/``if_match``) are serialised by an ``flock`` on
``<root>/.lock``; the ETag of a metadata file is the SHA-256 of its content.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from edgepack.format.output_file import pid_is_running

from ..errors import (
    ConcurrentUpdateError,
    InvalidStoreURLError,
    ObjectNotFoundError,
    StoreError,
)
from .base import CHUNK_SIZE, OBJECTS_PREFIX, ObjectInfo, Store, check_key

__all__ = ["LocalStore"]

_LOCK_NAME = ".lock"


class LocalStore(Store):
    def __init__(self, root: str | os.PathLike[str], *, create: bool = True) -> None:
        self.root = Path(root).absolute()
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        elif not self.root.is_dir():
            raise InvalidStoreURLError(f"store directory {self.root} does not exist")
        self.url = self.root.as_uri()

    # -- paths -------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def local_path(self, key: str) -> Path | None:
        path = self._path(key)
        return path if path.is_file() else None

    # -- reads ---------------------------------------------------------------------
    def stat(self, key: str) -> ObjectInfo | None:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _os_error(exc, key) from None
        sha = key[len(OBJECTS_PREFIX) :] if key.startswith(OBJECTS_PREFIX) else None
        return ObjectInfo(key, st.st_size, "", sha, st.st_mtime)

    def iter_bytes(
        self, key: str, start: int = 0, length: int | None = None, chunk_size: int = CHUNK_SIZE
    ) -> Iterator[bytes]:
        if start < 0 or (length is not None and length < 0):
            raise ValueError("negative range")
        try:
            f = open(self._path(key), "rb")
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{self.url}: no object {key}", key=key) from None
        except OSError as exc:
            raise _os_error(exc, key) from None
        return _read_chunks(f, start, length, chunk_size)

    def get_bytes(self, key: str, *, max_length: int = 16 * 1024 * 1024) -> tuple[bytes, str]:
        try:
            with open(self._path(key), "rb") as f:
                data = f.read(max_length + 1)
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{self.url}: no object {key}", key=key) from None
        except OSError as exc:
            raise _os_error(exc, key) from None
        if len(data) > max_length:
            raise StoreError(f"{key} is larger than {max_length} bytes", key=key)
        return data, hashlib.sha256(data).hexdigest()

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # walk only below the deepest directory the prefix names
        base_parts = prefix.split("/")[:-1]
        base = self.root.joinpath(*base_parts) if base_parts else self.root
        if not base.is_dir():
            return
        found: list[str] = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                if name.startswith("."):
                    continue
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    found.append(key)
        for key in sorted(found):
            info = self.stat(key)
            if info is not None:
                yield info

    # -- writes ------------------------------------------------------------------------
    def put_bytes(
        self,
        key: str,
        data: bytes,
        *,
        if_absent: bool = False,
        if_match: str | None = None,
        content_type: str = "application/octet-stream",
    ) -> str:
        if if_absent and if_match is not None:
            raise ValueError("if_absent and if_match are exclusive")
        path = self._path(key)
        tmp = self._write_temp(path, [data])
        try:
            with self._lock():
                if if_absent:
                    try:
                        os.link(tmp, path)
                    except FileExistsError:
                        raise ConcurrentUpdateError(
                            f"{self.url}: {key} already exists", key=key
                        ) from None
                else:
                    if if_match is not None:
                        current = _content_etag(path)
                        if current != if_match:
                            raise ConcurrentUpdateError(
                                f"{self.url}: {key} changed since it was read", key=key
                            )
                    os.replace(tmp, path)
                _fsync_dir(path.parent)
        except OSError as exc:
            raise _os_error(exc, key) from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return hashlib.sha256(data).hexdigest()

    def _put_object_file(self, path: Path, key: str, sha256_hex: str, size: int) -> None:
        dest = self._path(key)
        digest = hashlib.sha256()
        chunks = _hashing_reader(path, digest)
        tmp = self._write_temp(dest, chunks)
        try:
            if digest.hexdigest() != sha256_hex:
                raise StoreError(f"{path} changed while it was being stored", key=key)
            os.chmod(tmp, 0o444)
            os.replace(tmp, dest)  # same hash, same bytes: replacing a twin is harmless
            _fsync_dir(dest.parent)
        except OSError as exc:
            raise _os_error(exc, key) from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            raise _os_error(exc, key) from None

    def touch(self, key: str) -> None:
        try:
            os.utime(self._path(key))
        except OSError as exc:
            raise _os_error(exc, key) from None

    def remove_stale_temporaries(self, older_than: float = 3600.0) -> int:
        """Delete the temporaries killed writers left; return how many. A ``.tmp-`` file
        is stale when the writer pid in its name is not running on this machine, or
        when it is older than ``older_than`` seconds (a writer on another machine, a
        reused pid; no write takes that long). Publish runs this first."""
        now, removed = time.time(), 0
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if name.startswith(".tmp"):
                    p = Path(dirpath, name)
                    with contextlib.suppress(OSError):
                        if _temporary_is_stale(name, p, now, older_than):
                            p.unlink()
                            removed += 1
        return removed

    # -- helpers --------------------------------------------------------------------------
    def _write_temp(self, dest: Path, chunks) -> Path:
        """Write ``chunks`` to a fresh fsynced temporary file next to ``dest``."""
        tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}-{os.urandom(6).hex()}"
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            raise _os_error(exc, str(dest)) from None
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise _os_error(exc, str(dest)) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        fd = os.open(self.root / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"


def _read_chunks(f, start: int, length: int | None, chunk_size: int) -> Iterator[bytes]:
    with f:
        f.seek(start)
        remaining = length
        while remaining is None or remaining > 0:
            n = chunk_size if remaining is None else min(chunk_size, remaining)
            chunk = f.read(n)
            if not chunk:
                break
            if remaining is not None:
                remaining -= len(chunk)
            yield chunk


def _hashing_reader(path: Path, digest) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_SIZE):
            digest.update(chunk)
            yield chunk


def _content_etag(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _os_error(exc: OSError, key: str) -> StoreError:
    retriable = exc.errno in (errno.EAGAIN, errno.EINTR, errno.EBUSY)
    return StoreError(f"{key}: {exc.strerror or exc}", retriable=retriable, key=key)


def _temporary_is_stale(name: str, path: Path, now: float, older_than: float) -> bool:
    """``name`` is ``.tmp-<key name>-<pid>-<hex>`` (see :meth:`LocalStore._write_temp`)."""
    parts = name.rsplit("-", 2)
    if len(parts) == 3 and parts[1].isdigit() and not pid_is_running(int(parts[1])):
        return True
    return now - path.stat().st_mtime > older_than

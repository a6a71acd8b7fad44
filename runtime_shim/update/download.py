"""One target to one file: resumed by Range, verified chunk by chunk, then whole.

A partial download lives in ``<dest>.part`` with its strong ETag in ``<dest>.etag``.
On resume, the chunks already on disk are re-hashed against the signed chunk hashes
and only the verified prefix is kept (so a resumed download never trusts bytes it
cannot verify, and re-fetches at most the chunk that was being written); a chunk that
arrives wrong is fetched again, not the whole file. Without signed chunk hashes the
prefix is kept and the whole-file hash decides; a mismatch starts over once.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .config import UpdateConfig
from .crashpoints import crash_point
from .durable import fsync_dir, replace_durably
from .errors import DownloadError, DownloadLengthError, TargetVerificationError

if TYPE_CHECKING:
    from .fetcher import RangeFetcher

__all__ = ["Chunks", "DownloadTarget", "download_target", "file_sha256"]

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Chunks:
    """Signed chunk hashes: ``sha256[i]`` covers bytes ``[i*size, (i+1)*size)``."""

    size: int
    sha256: tuple[str, ...]


@dataclass(frozen=True)
class DownloadTarget:
    url: str
    length: int
    sha256: str | None  # None: the caller verifies the file (other TUF hash algorithms)
    chunks: Chunks | None = None


class _BadChunk(DownloadError):
    """A chunk arrived wrong: fetched again (it may be the network), then refused."""


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def download_target(
    fetcher: RangeFetcher,
    target: DownloadTarget,
    dest: Path,
    config: UpdateConfig,
    progress: Progress | None = None,
) -> int:
    """Make ``dest`` hold the target's verified bytes; returns the bytes fetched."""
    if target.sha256 and dest.exists() and dest.stat().st_size == target.length:
        if file_sha256(dest) == target.sha256:
            return 0
    part = dest.with_name(dest.name + ".part")
    etag_file = dest.with_name(dest.name + ".etag")
    fetched = 0
    attempts = 0
    restarted = False
    while True:
        attempts += 1
        kept = _verified_prefix(part, target)
        etag = _saved_etag(etag_file) if kept else None
        try:
            fetched += _fetch_into(
                fetcher, target, part, etag_file, kept, etag, progress, config.read_bytes
            )
        except DownloadError as e:
            if isinstance(e, _BadChunk) and attempts >= config.max_attempts:
                raise TargetVerificationError(f"{e} ({attempts} times)") from None
            if not e.retriable or attempts >= config.max_attempts:
                raise
            time.sleep(config.retry_backoff * attempts)
            continue
        if part.stat().st_size == target.length and (
            target.sha256 is None or file_sha256(part) == target.sha256
        ):
            break
        # the prefix kept without chunk hashes was wrong: start over, once
        _truncate(part, 0)
        if restarted or attempts >= config.max_attempts:
            raise TargetVerificationError(
                f"{target.url}: the download does not match its signed SHA-256"
            )
        restarted = True
    replace_durably(part, dest)
    etag_file.unlink(missing_ok=True)
    fsync_dir(dest.parent)
    return fetched


def _verified_prefix(part: Path, target: DownloadTarget) -> int:
    """Bytes of ``part`` to keep: whole verified chunks, or everything (no chunks)."""
    if not part.exists():
        return 0
    size = min(part.stat().st_size, target.length)
    chunks = target.chunks
    if chunks is None:
        kept = size
    else:
        kept = 0
        with open(part, "rb") as f:
            for expected in chunks.sha256:
                want = min(chunks.size, target.length - kept)
                data = f.read(want)
                if len(data) < want or hashlib.sha256(data).hexdigest() != expected:
                    break
                kept += want
    _truncate(part, kept)
    return kept


def _saved_etag(etag_file: Path) -> str | None:
    """The ETag saved with the partial file; one torn by a power cut only costs a
    full re-fetch (If-Range no longer matches), never an error."""
    try:
        return etag_file.read_bytes().decode("ascii").strip() or None
    except (FileNotFoundError, UnicodeDecodeError):
        return None


def _truncate(part: Path, size: int) -> None:
    if part.exists() and part.stat().st_size != size:
        with open(part, "r+b") as f:
            f.truncate(size)


def _fetch_into(
    fetcher: RangeFetcher,
    target: DownloadTarget,
    part: Path,
    etag_file: Path,
    start: int,
    etag: str | None,
    progress: Progress | None,
    grain: int,
) -> int:
    if start >= target.length:
        return 0
    resp = fetcher.open(target.url, start, etag)
    if resp.start != start:
        start = 0  # the object changed or ranges are not served: the whole body follows
    if resp.etag is None:
        etag_file.unlink(missing_ok=True)
    elif resp.etag != etag:
        etag_file.write_text(resp.etag)
    chunks = target.chunks
    fetched = 0
    pos = start
    marks = start // grain
    chunk_start = start
    hasher = hashlib.sha256()
    with open(part, "r+b" if part.exists() else "wb") as f:
        f.seek(start)
        f.truncate(start)
        for data in resp.chunks:
            if pos + len(data) > target.length:
                raise DownloadLengthError(
                    f"{target.url}: the server sent more than the signed {target.length} bytes",
                    retriable=False,
                )
            view = memoryview(data)
            while view:
                take = len(view)
                if chunks is not None:
                    end = min(chunk_start + chunks.size, target.length)
                    take = min(take, end - pos)
                f.write(view[:take])
                hasher.update(view[:take])
                pos += take
                fetched += take
                view = view[take:]
                if chunks is not None and pos == min(chunk_start + chunks.size, target.length):
                    index = chunk_start // chunks.size
                    if index >= len(chunks.sha256) or hasher.hexdigest() != chunks.sha256[index]:
                        f.truncate(chunk_start)
                        raise _BadChunk(f"{target.url}: chunk {index} does not match its hash")
                    chunk_start = pos
                    hasher = hashlib.sha256()
            if progress is not None:
                progress(pos, target.length)
            while pos // grain > marks:  # one point per grain: as many whatever the reads
                marks += 1
                crash_point("download")
        f.flush()
        os.fsync(f.fileno())
    if pos < target.length:
        raise DownloadError(f"{target.url}: the connection ended at byte {pos}")
    return fetched

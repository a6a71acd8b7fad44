"""The TUF layer: python-tuf's ngclient ``Updater`` over our fetcher.

python-tuf's trusted metadata state verifies every file; this module only sets it up
(trust anchor on first use, the slot directory's metadata after) and maps its errors.
Payload downloads do not go through ngclient (it has no resume): the planned targets'
infos come from here, the bytes from :mod:`.download`.
"""

from __future__ import annotations

import os
from pathlib import Path

from tuf.api import exceptions as tuf_exc
from tuf.ngclient import Updater as TufUpdater

from .config import UpdateConfig
from .errors import MixAndMatchError, SlotError
from .fetcher import RangeFetcher
from .tuf_errors import map_tuf_error

__all__ = ["refresh", "target_url", "targetinfo"]


def refresh(
    metadata_dir: Path,
    metadata_url: str,
    targets_url: str,
    fetcher: RangeFetcher,
    config: UpdateConfig,
    trusted_root: bytes | str | os.PathLike[str] | None,
    target_dir: Path | None = None,
) -> TufUpdater:
    """A refreshed ngclient updater (top-level metadata verified and persisted)."""
    metadata_dir.mkdir(parents=True, exist_ok=True)
    bootstrap = None
    if not (metadata_dir / "root.json").exists():
        if trusted_root is None:
            raise SlotError(f"no trusted TUF root in {metadata_dir}: give the trusted root")
        bootstrap = (
            trusted_root if isinstance(trusted_root, bytes) else Path(trusted_root).read_bytes()
        )
    tuf = None
    try:
        tuf = TufUpdater(
            str(metadata_dir),
            metadata_url,
            str(target_dir) if target_dir is not None else None,
            targets_url,
            fetcher=fetcher,
            config=config.tuf_config(),
            bootstrap=bootstrap,
        )
        tuf.refresh()
    except (tuf_exc.RepositoryError, tuf_exc.DownloadError, ValueError, OSError) as e:
        raise _refresh_error(tuf, e) from e
    return tuf


def targetinfo(tuf: TufUpdater, path: str):  # -> tuf TargetFile | None
    try:
        return tuf.get_targetinfo(path)
    except (tuf_exc.RepositoryError, tuf_exc.DownloadError) as e:
        raise _refresh_error(tuf, e) from e


def _refresh_error(tuf: TufUpdater | None, exc: BaseException) -> Exception:
    """``map_tuf_error``, except that a targets role whose version or hash is not what
    the trusted snapshot names is a mix-and-match: python-tuf raises the same
    exceptions for it as for a rollback, so the phase tells them apart (the snapshot
    the timestamp names is already trusted, so only a targets role can have failed)."""
    mismatch = (tuf_exc.BadVersionNumberError, tuf_exc.LengthOrHashMismatchError)
    if isinstance(exc, mismatch) and tuf is not None and _snapshot_is_current(tuf):
        return MixAndMatchError(
            f"targets metadata not from the trusted snapshot (mix-and-match): {exc}"
        )
    return map_tuf_error(exc)


def _snapshot_is_current(tuf: TufUpdater) -> bool:
    trusted = tuf._trusted_set
    try:
        return trusted.snapshot.version == trusted.timestamp.snapshot_meta.version
    except KeyError:
        return False


def target_url(tuf: TufUpdater, info, base_url: str) -> str:
    """Where ngclient would fetch ``info`` from: hash-prefixed under consistent snapshots
    (what a CDN can serve without the metadata)."""
    path = info.path
    if tuf._trusted_set.root.consistent_snapshot:
        dirname, sep, basename = path.rpartition("/")
        path = f"{dirname}{sep}{next(iter(info.hashes.values()))}.{basename}"
    return base_url.rstrip("/") + "/" + path

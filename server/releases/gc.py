"""`edgepack repo gc`: objects of a store that no release metadata references.

A publish uploads its package (and deltas) before it commits the metadata naming them,
so a publish that lost a race, or was killed, leaves objects nothing points at. This
lists them and, only when asked, deletes them. Two rules keep it safe:

* an object is *referenced* when any targets metadata version still in the store lists
  it, not only the current one: a device that read an older snapshot may still fetch
  what that snapshot lists;
* an object written less than ``grace_seconds`` ago is kept even when unreferenced: it
  may belong to a publish still running. :meth:`Store.put_object` refreshes the time of
  an object it finds already stored, and each object's time is read again just before
  it is deleted, so a concurrent publish never loses its payload.

Uploads a killed publish began and never completed (S3 multipart: invisible, but billed
as storage) are listed too, and aborted with ``delete``, once idle for the same grace
period (:meth:`Store.pending_uploads`).

A store whose metadata cannot be read is refused: a reference gc cannot see would be a
live object deleted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import RepositoryError
from ..store import OBJECTS_PREFIX, ObjectInfo, Store, object_key
from ..store.base import PendingUpload
from .metadata import METADATA_PREFIX
from .repository import ReleaseRepository

__all__ = ["DEFAULT_GRACE_SECONDS", "GarbageReport", "collect_garbage"]

DEFAULT_GRACE_SECONDS = 24 * 3600.0  # longer than any publish takes
_TARGETS_SUFFIX = ".targets.json"
_METADATA_MAX = 64 * 1024 * 1024


@dataclass(frozen=True)
class GarbageReport:
    """``unreferenced``: objects no metadata version lists and older than the grace
    period (deleted when ``deleted``); ``young``: unreferenced but within it, kept;
    ``stale_uploads``: incomplete uploads idle for the grace period (aborted when
    ``deleted``); ``young_uploads``: how many incomplete uploads were kept."""

    unreferenced: tuple[ObjectInfo, ...]
    young: tuple[ObjectInfo, ...]
    referenced: int
    metadata_versions: int
    deleted: bool
    stale_uploads: tuple[PendingUpload, ...] = ()
    young_uploads: int = 0

    @property
    def reclaimable_bytes(self) -> int:
        return sum(info.size for info in self.unreferenced)


def collect_garbage(
    store: Store,
    *,
    delete: bool = False,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    now: float | None = None,
) -> GarbageReport:
    """List (``delete``: and remove) the unreferenced objects of ``store``'s repository."""
    if grace_seconds < 0:
        raise ValueError("grace_seconds must be >= 0")
    ReleaseRepository(store).load()  # a valid repository, or a typed error
    referenced, versions = _referenced_keys(store)
    clock = now if now is not None else time.time()
    old: list[ObjectInfo] = []
    young: list[ObjectInfo] = []
    count = 0
    for info in store.list(OBJECTS_PREFIX):
        if info.key in referenced:
            count += 1
        elif _is_young(info, clock, grace_seconds):
            young.append(info)
        else:
            old.append(info)
    pending = store.pending_uploads()
    stale = [u for u in pending if u.idle(clock) >= grace_seconds]
    if delete:
        for info in old:
            again = store.stat(info.key)  # a publish may have reused it since the listing
            if again is not None and not _is_young(again, time.time(), grace_seconds):
                store.delete(info.key)
        stale = store.abort_idle_uploads(grace_seconds)  # listed again: one may have moved
    young_uploads = len(pending) - len(stale)
    return GarbageReport(
        tuple(old), tuple(young), count, versions, delete, tuple(stale), max(young_uploads, 0)
    )


def _is_young(info: ObjectInfo, now: float, grace_seconds: float) -> bool:
    """Unknown time counts as young: nothing is deleted on a guess."""
    return info.modified is None or now - info.modified < grace_seconds


def _referenced_keys(store: Store) -> tuple[set[str], int]:
    """Object keys listed by every targets metadata version in the store."""
    keys: set[str] = set()
    versions = 0
    for key, targets in _targets_versions(store):
        versions += 1
        for path, target in targets.items():
            sha = target.get("hashes", {}).get("sha256") if isinstance(target, dict) else None
            try:
                keys.add(object_key(sha if isinstance(sha, str) else ""))
            except ValueError:
                raise RepositoryError(
                    f"{store.url}: {key} lists {path} without a usable sha256: gc refuses to "
                    "guess what it references"
                ) from None
    return keys, versions


def _targets_versions(store: Store) -> Iterator[tuple[str, dict]]:
    for info in store.list(METADATA_PREFIX):
        if not info.key.endswith(_TARGETS_SUFFIX):
            continue
        data, _etag = store.get_bytes(info.key, max_length=_METADATA_MAX)
        try:
            targets = json.loads(data)["signed"]["targets"]
            if not isinstance(targets, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise RepositoryError(
                f"{store.url}: {info.key} is not targets metadata: gc refuses to run while a "
                "metadata version cannot be read"
            ) from None
        yield info.key, targets

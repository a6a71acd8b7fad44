"""The server's read-only view of the release repository, re-read when it changes.

Stateless over the store: the only thing a replica keeps is a verified copy of the
committed metadata. At most every ``refresh_seconds`` the next request re-reads
``timestamp.json`` (one small GET); when its bytes differ, the whole chain
(timestamp -> snapshot -> targets, root chain) is loaded and verified again. A publish
is therefore visible to every replica at most ``refresh_seconds`` plus one load after
its commit, and replicas never disagree for longer than that.

When a re-read fails (the store is unreachable, or what it holds now does not verify)
the last verified state keeps being served and the failure is logged; the next try is
``refresh_seconds`` later. Only a replica that never loaded anything answers 503.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from edgepack.format.errors import EdgepackError

from ..releases.metadata import TIMESTAMP_KEY, VerifiedRepository
from ..releases.model import ReleaseIndex
from ..releases.repository import ReleaseRepository
from ..store import Store

__all__ = ["ReleaseView", "RepoSnapshot"]

_TIMESTAMP_MAX = 1024 * 1024
log = logging.getLogger("edgepack.server.http")


@dataclass(frozen=True)
class RepoSnapshot:
    """One verified committed state: the index for planning, the target table for
    serving payloads by their plain target path."""

    repo: VerifiedRepository
    index: ReleaseIndex
    timestamp_bytes: bytes

    @property
    def timestamp_version(self) -> int:
        return self.repo.timestamp.version

    def target(self, path: str) -> tuple[str, int] | None:
        """(sha256, length) of a TUF target, or None."""
        tf = self.repo.targets.targets.get(path)
        if tf is None or "sha256" not in tf.hashes:
            return None
        return tf.hashes["sha256"], tf.length


class ReleaseView:
    def __init__(
        self,
        store: Store,
        refresh_seconds: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.refresh_seconds = refresh_seconds
        self._clock = clock
        self._repository = ReleaseRepository(store, None)
        self._lock = threading.Lock()
        self._snapshot: RepoSnapshot | None = None
        self._checked = float("-inf")

    def current(self) -> RepoSnapshot:
        """The committed state, at most ``refresh_seconds`` old (raises the repository's
        errors when the store holds none or it does not verify)."""
        now = self._clock()
        snap = self._snapshot
        if snap is not None and now - self._checked < self.refresh_seconds:
            return snap
        with self._lock:
            if self._snapshot is not None and self._clock() - self._checked < self.refresh_seconds:
                return self._snapshot
            try:
                ts_bytes = self._read_timestamp()
                if self._snapshot is None or ts_bytes != self._snapshot.timestamp_bytes:
                    repo = self._repository.load()
                    self._snapshot = RepoSnapshot(
                        repo, ReleaseIndex.from_targets(repo.targets), repo.timestamp_bytes
                    )
            except EdgepackError as exc:
                if self._snapshot is None:
                    raise
                log.warning(
                    "keeping timestamp v%d: re-reading the store failed: %s",
                    self._snapshot.timestamp_version,
                    exc,
                )
            self._checked = self._clock()
            return self._snapshot

    def _read_timestamp(self) -> bytes | None:
        if self._snapshot is None:
            return None  # the first load reads it itself
        return self.store.get_bytes(TIMESTAMP_KEY, max_length=_TIMESTAMP_MAX)[0]

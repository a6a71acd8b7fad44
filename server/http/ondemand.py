"""On-demand deltas: a pair that publish did not precompute is computed once, stored,
and reused by every replica.

Where things live in the store (keys under ``deltas/``, beside the metadata, never
in it: the server holds no signing keys):

* ``objects/sha256/<hex>`` - the delta bytes, content addressed like every payload;
* ``deltas/ondemand/<from>-<to>.json`` - the record naming that object (create-only);
* ``deltas/leases/<from>-<to>.json`` - who is computing the pair and until when.

One computation per pair: inside a process a pair has at most one worker thread
(guarded by a lock); across processes and replicas the worker first takes the lease
with a conditional create (``if_absent``), and an expired lease (a crashed replica) is
taken over with compare-and-swap (``if_match``). A replica that finds a live lease of
another waits for its record instead.

An on-demand delta is not TUF-signed, so it is trusted for nothing: its header must
name exactly the installed hash as base and the release's TUF-signed hash as target
(checked here before it is recorded), and the device verifies the patched file
against that signed hash. A wrong delta can cost bandwidth, never an install.

While a pair is being computed the update check waits up to ``delta_wait_seconds``
for it (at most ``delta_waiters`` checks at a time, so waiting never takes every
server thread), then answers ``full`` (which always works and never strands a device; the
next check, once the record exists, gets the delta).
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
import time
import uuid
from pathlib import Path

from ..errors import ConcurrentUpdateError, ObjectNotFoundError
from ..releases.deltas import make_delta
from ..releases.model import ReleaseInfo, delta_target_path
from ..store import Store
from .config import ServeConfig
from .schemas import TargetRef

__all__ = ["OnDemandDeltas"]

log = logging.getLogger("edgepack.server.http")
_PAIR_PATH = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/deltas/([0-9a-f]{64})-([0-9a-f]{64})\.epkd$")


def record_key(from_sha: str, to_sha: str) -> str:
    return f"deltas/ondemand/{from_sha}-{to_sha}.json"


def lease_key(from_sha: str, to_sha: str) -> str:
    return f"deltas/leases/{from_sha}-{to_sha}.json"


class OnDemandDeltas:
    def __init__(self, store: Store, config: ServeConfig) -> None:
        self.store = store
        self.config = config
        self.owner = f"{os.uname().nodename}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
        self._lock = threading.Lock()
        self._running: dict[tuple[str, str], threading.Event] = {}
        self._known: dict[tuple[str, str], TargetRef] = {}
        self._failed: set[tuple[str, str]] = set()  # no delta possible: not retried
        self._cpu = threading.Semaphore(1)  # one delta at a time per process: bounded CPU
        # checks blocked waiting for a delta hold server threads: at most this many
        self._waiters = threading.Semaphore(config.delta_waiters)
        self.computed = 0  # pairs this process computed (tests and logs count them)

    # -- the planner's callback ----------------------------------------------------------
    def lookup(self, base: ReleaseInfo, target: ReleaseInfo) -> TargetRef | None:
        """The stored delta base -> target, or None after starting (or waiting a while
        for) its computation."""
        pair = (base.sha256, target.sha256)
        deadline = time.monotonic() + self.config.delta_wait_seconds
        ref = self._stored(pair, target.model)
        if ref is not None or pair in self._failed:
            return ref
        done = self._start(base, target)
        if not self._waiters.acquire(blocking=False):
            return None  # enough checks already wait: this one gets `full` at once
        try:
            return self._wait(pair, target.model, done, deadline)
        finally:
            self._waiters.release()

    def _wait(
        self,
        pair: tuple[str, str],
        model: str,
        done: threading.Event | None,
        deadline: float,
    ) -> TargetRef | None:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if done is not None:
                done.wait(left)
                return self._stored(pair, model)
            time.sleep(min(0.25, left))  # another replica holds the lease
            ref = self._stored(pair, model)
            if ref is not None:
                return ref

    def target(self, path: str) -> tuple[str, int] | None:
        """(sha256, length) of an on-demand delta by its target-style path."""
        m = _PAIR_PATH.fullmatch(path)
        if m is None:
            return None
        ref = self._stored((m[1], m[2]), path.split("/", 1)[0])
        return (ref.sha256, ref.length) if ref is not None else None

    # -- records -------------------------------------------------------------------------
    def _stored(self, pair: tuple[str, str], model: str) -> TargetRef | None:
        ref = self._known.get(pair)
        if ref is not None:
            return ref
        try:
            raw, _ = self.store.get_bytes(record_key(*pair), max_length=64 * 1024)
        except ObjectNotFoundError:
            return None
        try:
            rec = json.loads(raw)
            ref = TargetRef(
                path=delta_target_path(model, *pair),
                length=int(rec["length"]),
                sha256=str(rec["sha256"]),
                kind="delta",
                signed=False,
            )
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring the malformed record %s", record_key(*pair))
            return None
        self._known[pair] = ref
        return ref

    # -- computing -----------------------------------------------------------------------
    def _start(self, base: ReleaseInfo, target: ReleaseInfo) -> threading.Event | None:
        """The event set when this process's computation of the pair ends; None when
        another process holds the lease."""
        pair = (base.sha256, target.sha256)
        with self._lock:
            running = self._running.get(pair)
            if running is not None:
                return running
            if not self._take_lease(pair):
                return None
            if self._stored(pair, target.model) is not None:
                # another replica stored the record and released its lease between our
                # look-up and our lease: computing again would waste a pair's work
                self._release_lease(pair)
                finished = threading.Event()
                finished.set()
                return finished
            done = self._running[pair] = threading.Event()
        threading.Thread(
            target=self._compute, args=(base, target, done), name="edgepack-delta", daemon=True
        ).start()
        return done

    def _take_lease(self, pair: tuple[str, str]) -> bool:
        key = lease_key(*pair)
        lease = json.dumps(
            {"owner": self.owner, "expires": time.time() + self.config.delta_lease_seconds}
        ).encode()
        try:
            self.store.put_bytes(key, lease, if_absent=True, content_type="application/json")
            return True
        except ConcurrentUpdateError:
            pass
        try:
            raw, etag = self.store.get_bytes(key, max_length=64 * 1024)
        except ObjectNotFoundError:
            return False  # released meanwhile: the record should be there
        try:
            expired = float(json.loads(raw)["expires"]) < time.time()
        except (ValueError, KeyError, TypeError):
            expired = True
        if not expired:
            return False
        try:
            self.store.put_bytes(key, lease, if_match=etag, content_type="application/json")
            return True
        except ConcurrentUpdateError:
            return False

    def _release_lease(self, pair: tuple[str, str]) -> None:
        try:
            self.store.delete(lease_key(*pair))
        except Exception:
            log.warning("could not release the lease of %s", lease_key(*pair))

    def _compute(self, base: ReleaseInfo, target: ReleaseInfo, done: threading.Event) -> None:
        pair = (base.sha256, target.sha256)
        started = time.monotonic()
        try:
            with self._cpu, tempfile.TemporaryDirectory(prefix="edgepack-ondemand-") as tmp:
                old = self._local(base, tmp)
                new = self._local(target, tmp)
                out = make_delta(old, new, Path(tmp) / "pair.epkd")
                if out is None or not _leads_from_to(out, base.sha256, target.sha256):
                    log.warning("on-demand delta %s -> %s: none made", base.version, target.version)
                    self._failed.add(pair)
                    return
                obj = self.store.put_object(out)
                record = {"sha256": obj.sha256, "length": obj.size, "by": self.owner}
                try:
                    self.store.put_bytes(
                        record_key(*pair),
                        json.dumps(record, sort_keys=True).encode(),
                        if_absent=True,
                        content_type="application/json",
                    )
                except ConcurrentUpdateError:
                    pass  # a stale-lease takeover raced us: the first record stands
            self.computed += 1
            log.warning(
                "on-demand delta computed: %s %s -> %s, %d bytes in %.2fs",
                target.model,
                base.version,
                target.version,
                obj.size,
                time.monotonic() - started,
            )
        except Exception:
            log.exception("on-demand delta %s -> %s failed", base.version, target.version)
        finally:
            self._release_lease(pair)
            with self._lock:
                self._running.pop(pair, None)
            done.set()

    def _local(self, release: ReleaseInfo, tmp: str) -> Path:
        path = self.store.local_path(release.object_key)
        if path is not None:
            return path
        return self.store.download(
            release.object_key,
            Path(tmp) / f"{release.sha256}.epk",
            expected_sha256=release.sha256,
            expected_size=release.length,
        )


def _leads_from_to(delta: Path, from_sha: str, to_sha: str) -> bool:
    """The delta's header names exactly this base and the signed target hash."""
    from edgepack.format.delta import DeltaFile

    with DeltaFile.open(delta) as d:
        h = d.header
        return h.base_file_sha256.hex() == from_sha and h.target_file_sha256.hex() == to_sha

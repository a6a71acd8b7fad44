"""The release repository: policy and I/O on top of a store, a keys directory and TUF.

Every write operation follows one commit protocol, so a crash or a concurrent writer
never exposes a half-published release:

1. read and verify the committed state (``timestamp.json`` -> snapshot -> targets,
   root chain), remembering the ETag of ``timestamp.json``;
2. upload payloads (package, deltas) content addressed: invisible until referenced;
3. write the new ``<n>.targets.json`` and ``<n>.snapshot.json`` *create-only*; a name
   already taken (left by an interrupted or concurrent publish, referenced by nobody)
   is skipped for the next version number;
4. replace ``timestamp.json`` *compare-and-swap* against the ETag from step 1. This is
   the commit point: before it clients see the old release set, after it the new
   one, and every file either set references was written before it. A lost swap
   means another writer committed first; the operation re-reads and tries again.

The keys directory (never the store) holds the signing keys and, per repository, the
pinned root and the highest metadata versions seen (rollback detection on the publisher
side). That state is keyed by the repository's id (:func:`~.metadata.repository_id`, the
digest of its first root), never by the store's URL, so no path spelling (symlink, ``..``,
trailing slash) or URL form escapes it. A store whose first root is unknown to the keys
directory but shares keys with a repository it knows is refused: that is a replaced
``1.root.json`` presenting a "new" repository to escape the recorded state.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from securesystemslib.signer import Signer
from tuf.api.metadata import Metadata, Root, Snapshot, TargetFile, Targets, Timestamp

from edgepack.format import Package, parse_semver
from edgepack.format.model_card import read_model_card
from edgepack.format.output_file import (
    pid_temporary_directory,
    remove_stale_temporary_directories,
)

from ..errors import (
    ConcurrentUpdateError,
    MetadataSignatureError,
    ObjectNotFoundError,
    ReleasePolicyError,
    RepositoryError,
    RepositoryExistsError,
    RepositoryNotInitializedError,
    RollbackError,
    UnknownReleaseError,
    VersionConflictError,
    VersionNotIncreasingError,
)
from ..store import Store, object_key, sha256_file
from .deltas import delta_codec_available, make_delta
from .keys import KeyRing
from .metadata import (
    ROLES,
    SPEC_VERSION,
    TIMESTAMP_KEY,
    RepoPolicy,
    VerifiedRepository,
    expired_roles,
    format_time,
    metafile_for,
    new_root,
    parse,
    renewal_advice,
    repository_id,
    root_key,
    serialize,
    sign,
    utcnow,
    verify_first_root,
    verify_repository,
    verify_root_update,
    versioned_key,
)
from .model import (
    CUSTOM_KEY,
    DeltaInfo,
    ReleaseIndex,
    ReleaseInfo,
    Requirements,
    check_name,
    chunk_hashes,
    delta_target_path,
    percent_to_bp,
    release_target_path,
    semver_precedence,
)

__all__ = ["PackageFacts", "PublishResult", "ReleaseRepository", "inspect_package"]

log = logging.getLogger("edgepack.server.releases")
_METADATA_MAX = 16 * 1024 * 1024
_JSON = "application/json"
_PUBLISH_SCRATCH = "edgepack-publish-"  # deltas and base copies; a killed publish's goes


@dataclass(frozen=True)
class PackageFacts:
    """What publishing needs to know about a verified package file."""

    path: Path
    model: str
    version: str
    sha256: str
    length: int
    requirements: Requirements
    signers: tuple[str, ...]
    model_card: Mapping[str, Any] | None = None
    weights_digest: str = ""  # hex, of the package's tensors
    adapter_for: tuple[str, ...] = ()  # adapter-only package: the bases its adapters bind


# What ``publish`` reports to its ``progress``, in order ("deltas" counts the bases).
PUBLISH_PHASES = ("verify", "store package", "deltas", "sign metadata")


class _NoProgress:
    def phase(self, name: str, total: int) -> None: ...

    def advance(self, amount: int = 1, detail: str | None = None) -> None: ...


@dataclass(frozen=True)
class PublishResult:
    release: ReleaseInfo
    uploaded: bool
    versions: Mapping[str, int]
    changed: bool = True


def inspect_package(
    path: str | os.PathLike[str],
    *,
    policy: RepoPolicy | None = None,
    trusted_keys: Sequence[Any] = (),
    model: str | None = None,
) -> PackageFacts:
    """Open and fully verify a package (every hash; signatures when the repository's
    policy or ``trusted_keys`` ask for them) and collect its release facts."""
    path = Path(path)
    keys = list(trusted_keys)
    threshold = 1
    if policy is not None and policy.requires_signed_packages:
        keys += policy.package_public_keys()
        threshold = max(1, policy.package_threshold)
    with Package.open(path) as pkg:
        report = pkg.verify(keys or None, threshold=threshold)
        header = pkg.header
        card = read_model_card(pkg)
        digest = pkg.weights_digest.hex() if header.tensors else ""
        adapter_for = () if header.tensors else _adapter_bases(pkg)
    name = model or header.identity.name
    try:
        check_name("model", name)
        parse_semver(header.identity.version)
    except ValueError as exc:
        raise ReleasePolicyError(f"{path}: {exc} (use --model to name it)") from None
    sha, size = sha256_file(path)
    return PackageFacts(
        path=path,
        model=name,
        version=header.identity.version,
        sha256=sha,
        length=size,
        requirements=Requirements.from_header(header),
        signers=report.trusted_signers,
        model_card=card,
        weights_digest=digest,
        adapter_for=adapter_for,
    )


def _adapter_bases(pkg: Package) -> tuple[str, ...]:
    """The base weights digests of an adapter-only package's LORA_ADAPTER sections."""
    from edgepack.format import SectionKind
    from edgepack.format.adapter import decode_adapter

    bases = {
        decode_adapter(pkg.section(SectionKind.LORA_ADAPTER, s.name) or b"").base_digest.hex()
        for s in pkg.sections(SectionKind.LORA_ADAPTER)
    }
    return tuple(sorted(bases))


class ReleaseRepository:
    """Release metadata in ``store``, signed with keys from ``keys`` (None: read-only)."""

    def __init__(
        self,
        store: Store,
        keys: KeyRing | None = None,
        *,
        clock: Callable[[], dt.datetime] = utcnow,
        commit_attempts: int = 4,
    ) -> None:
        self.store = store
        self.keys = keys
        self.clock = clock
        self.commit_attempts = commit_attempts
        self._repository_id: str | None = None

    # ================================================================ reading
    def initialized(self) -> bool:
        return self.store.exists(TIMESTAMP_KEY)

    def load(self) -> VerifiedRepository:
        """The committed state, verified (expiry is not enforced: see :meth:`expired`)."""
        try:
            ts_bytes, etag = self.store.get_bytes(TIMESTAMP_KEY, max_length=_METADATA_MAX)
        except ObjectNotFoundError:
            raise RepositoryNotInitializedError(
                f"{self.store.url} holds no release metadata: run "
                f"`edgepack repo init --store {self.store.url}` first"
            ) from None
        root_md, root_bytes = self._load_root()
        repo = verify_repository(root_md, root_bytes, ts_bytes, etag, self._fetch)
        self._check_recorded(repo)
        return repo

    def index(self, repo: VerifiedRepository | None = None) -> ReleaseIndex:
        return ReleaseIndex.from_targets((repo or self.load()).targets)

    def expired(self, repo: VerifiedRepository) -> list[tuple[str, dt.datetime]]:
        return expired_roles(repo, self.clock())

    def _fetch(self, key: str) -> bytes:
        try:
            return self.store.get_bytes(key, max_length=_METADATA_MAX)[0]
        except ObjectNotFoundError:
            raise RepositoryError(f"{self.store.url}: {key} is missing") from None

    def _load_root(self) -> tuple[Metadata, bytes]:
        """Walk the root chain from the pinned version (or version 1, trust on first use)."""
        state = self._state()
        start = int(state.get("root_version", 1))
        try:
            data = self.store.get_bytes(root_key(start), max_length=_METADATA_MAX)[0]
        except ObjectNotFoundError:
            if start == 1:
                raise RepositoryError(f"{self.store.url}: {root_key(1)} is missing") from None
            raise RollbackError(
                f"{self.store.url}: root version {start}, pinned in "
                f"{self.keys and self.keys.directory}, is missing (was the store restored "
                "from an old backup?)",
                role="root",
                trusted_version=start,
            ) from None
        md = parse(data, Root.type, root_key(start))
        pinned = state.get("root_sha256")
        if pinned is not None:
            if hashlib.sha256(data).hexdigest() != pinned:
                raise MetadataSignatureError(
                    f"{root_key(start)} differs from the root pinned in "
                    f"{self.keys and self.keys.directory}: the store's root was replaced"
                )
            trusted = md.signed
        else:
            trusted = verify_first_root(md, root_key(start))
            self._check_not_impostor(trusted)
        version = start
        while True:
            try:
                nxt, _ = self.store.get_bytes(root_key(version + 1), max_length=_METADATA_MAX)
            except ObjectNotFoundError:
                break
            md = parse(nxt, Root.type, root_key(version + 1))
            trusted = verify_root_update(trusted, md, root_key(version + 1))
            data, version = nxt, version + 1
        return md, data

    # -- per-repository state in the keys directory ------------------------------------
    def repository_id(self) -> str:
        """This store's repository id (read once from ``1.root.json``)."""
        if self._repository_id is None:
            try:
                data = self.store.get_bytes(root_key(1), max_length=_METADATA_MAX)[0]
            except ObjectNotFoundError:
                raise RepositoryError(f"{self.store.url}: {root_key(1)} is missing") from None
            self._repository_id = repository_id(data)
        return self._repository_id

    def _state(self) -> dict[str, Any]:
        if self.keys is None:
            return {}
        return self.keys.load_state(self.repository_id(), legacy_url=self.store.url)

    def has_trusted_state(self) -> bool:
        """Whether rollbacks are checked against versions recorded earlier."""
        return bool(self._state())

    def _check_not_impostor(self, root: Root) -> None:
        """On first use of a repository id, refuse a root sharing keys with a known one."""
        if self.keys is None:
            return
        mine = set(root.keys)
        for other_id, state in self.keys.states().items():
            if other_id != self.repository_id() and mine & set(state.get("keyids", ())):
                raise RollbackError(
                    f"{self.store.url}: its first root ({root_key(1)}) is not the one recorded "
                    f"for the repository its keys belong to ({other_id[:16]} in "
                    f"{self.keys.directory}): the store's root was replaced",
                    role="root",
                )

    def _check_recorded(self, repo: VerifiedRepository) -> None:
        state = self._state()
        for role, version in repo.versions().items():
            seen = int(state.get(f"{role}_version", 0))
            if version < seen:
                raise RollbackError(
                    f"{self.store.url}: {role} metadata is at version {version}, but version "
                    f"{seen} was seen before (was the store restored from an old backup?); "
                    "clients that saw the newer one will refuse it",
                    role=role,
                    trusted_version=seen,
                    new_version=version,
                )

    def _record(self, versions: Mapping[str, int], root_bytes: bytes) -> None:
        if self.keys is None:
            return
        state = self._state()
        for role, version in versions.items():
            state[f"{role}_version"] = max(int(state.get(f"{role}_version", 0)), version)
        state["root_version"] = versions["root"]
        state["root_sha256"] = hashlib.sha256(root_bytes).hexdigest()
        root = parse(root_bytes, Root.type, root_key(versions["root"])).signed
        state["keyids"] = sorted(set(state.get("keyids", ())) | set(root.keys))
        self.keys.save_state(self.repository_id(), state)

    def _keys(self) -> KeyRing:
        if self.keys is None:
            raise ValueError("this operation needs a keys directory")
        return self.keys

    # ================================================================ init
    def init(
        self,
        *,
        root_keys: int = 1,
        root_threshold: int = 1,
        policy: RepoPolicy | None = None,
    ) -> VerifiedRepository:
        """Create keys for the four roles and version 1 of every metadata file."""
        keys = self._keys()
        policy = policy or RepoPolicy()
        if not 1 <= root_threshold <= root_keys:
            raise ReleasePolicyError("need 1 <= --root-threshold <= --root-keys")
        if self.store.exists(TIMESTAMP_KEY):
            raise RepositoryExistsError(f"{self.store.url} already holds a release repository")
        if self.store.exists(root_key(1)):
            raise RepositoryExistsError(
                f"{self.store.url} holds a partial repository (root without timestamp, from "
                "an interrupted init): delete its metadata/ to start over"
            )
        now = self.clock()
        role_keys = {
            role: [keys.generate(role) for _ in range(root_keys if role == Root.type else 1)]
            for role in ROLES
        }
        root = new_root(role_keys, {Root.type: root_threshold}, policy, now)
        root_bytes = serialize(sign(root, keys.require(root, Root.type)))
        targets = Targets(1, SPEC_VERSION, now + policy.lifetime("targets"), {}, None)
        targets_bytes = serialize(sign(targets, keys.require(root, Targets.type)))
        snapshot = Snapshot(
            1,
            SPEC_VERSION,
            now + policy.lifetime("snapshot"),
            {"targets.json": metafile_for(targets_bytes, 1)},
        )
        snapshot_bytes = serialize(sign(snapshot, keys.require(root, Snapshot.type)))
        timestamp = Timestamp(
            1, SPEC_VERSION, now + policy.lifetime("timestamp"), metafile_for(snapshot_bytes, 1)
        )
        ts_bytes = serialize(sign(timestamp, keys.require(root, Timestamp.type)))
        try:
            self.store.put_bytes(root_key(1), root_bytes, if_absent=True, content_type=_JSON)
        except ConcurrentUpdateError:
            raise RepositoryExistsError(f"{self.store.url} was initialised concurrently") from None
        self.store.put_bytes(root_key(), root_bytes, content_type=_JSON)
        self.store.put_bytes(
            versioned_key(Targets.type, 1), targets_bytes, if_absent=True, content_type=_JSON
        )
        self.store.put_bytes(
            versioned_key(Snapshot.type, 1), snapshot_bytes, if_absent=True, content_type=_JSON
        )
        self.store.put_bytes(TIMESTAMP_KEY, ts_bytes, if_absent=True, content_type=_JSON)
        self._repository_id = repository_id(root_bytes)
        self._record({r: 1 for r in ROLES}, root_bytes)
        return self.load()

    # ================================================================ commit protocol
    def _commit(
        self,
        repo: VerifiedRepository,
        *,
        targets: Targets | None,
        new_snapshot: bool = True,
        extra_signers: Mapping[str, Sequence[Signer]] | None = None,
    ) -> dict[str, int]:
        """Steps 3 and 4 of the protocol (see the module docstring)."""
        keys = self._keys()
        now = self.clock()
        policy = repo.policy
        extra = extra_signers or {}

        def signers(role: str) -> list[Signer]:
            return [*keys.require(repo.root, role), *extra.get(role, ())]

        if targets is not None:
            targets.expires = now + policy.lifetime("targets")
            data, version = self._write_versioned(
                Targets.type, targets, repo.targets.version + 1, signers(Targets.type)
            )
            targets_meta = metafile_for(data, version)
            new_snapshot = True
        else:
            targets_meta = repo.snapshot.meta["targets.json"]
        if new_snapshot:
            snapshot = Snapshot(
                repo.snapshot.version + 1,
                SPEC_VERSION,
                now + policy.lifetime("snapshot"),
                {"targets.json": targets_meta},
            )
            data, version = self._write_versioned(
                Snapshot.type, snapshot, repo.snapshot.version + 1, signers(Snapshot.type)
            )
            snapshot_meta = metafile_for(data, version)
        else:
            snapshot_meta = repo.timestamp.snapshot_meta
        timestamp = Timestamp(
            repo.timestamp.version + 1,
            SPEC_VERSION,
            now + policy.lifetime("timestamp"),
            snapshot_meta,
        )
        ts_bytes = serialize(sign(timestamp, signers(Timestamp.type)))
        try:
            self.store.put_bytes(
                TIMESTAMP_KEY, ts_bytes, if_match=repo.timestamp_etag, content_type=_JSON
            )
        except ConcurrentUpdateError:
            raise ConcurrentUpdateError(
                f"{self.store.url}: another writer committed first; nothing was committed",
                key=TIMESTAMP_KEY,
            ) from None
        log.info("committed timestamp.json v%d", timestamp.version)
        versions = {
            "root": repo.root.version,
            "targets": targets_meta.version,
            "snapshot": snapshot_meta.version,
            "timestamp": timestamp.version,
        }
        self._record(versions, repo.root_bytes)
        return versions

    def _write_versioned(
        self, role: str, signed: Any, version: int, signers: Iterable[Signer]
    ) -> tuple[bytes, int]:
        signers = list(signers)
        for _ in range(256):
            signed.version = version
            data = serialize(sign(signed, signers))
            key = versioned_key(role, version)
            try:
                self.store.put_bytes(key, data, if_absent=True, content_type=_JSON)
            except ConcurrentUpdateError:
                log.info("%s is taken (interrupted or concurrent writer): trying the next", key)
                version += 1
                continue
            log.info("wrote %s", key)
            return data, version
        raise RepositoryError(f"{self.store.url}: no free {role} version after {version}")

    def _with_retries(self, attempt: Callable[[VerifiedRepository], Any]) -> Any:
        repo = self.load()
        for n in range(self.commit_attempts):
            try:
                return attempt(repo)
            except ConcurrentUpdateError:
                if n + 1 >= self.commit_attempts:
                    raise
                log.warning("another writer committed first: re-reading and retrying")
                repo = self.load()
        raise AssertionError("unreachable")

    # ================================================================ publish / promote
    def publish(
        self,
        package: str | os.PathLike[str],
        channel: str,
        *,
        rollout: float = 100.0,
        delta_count: int | None = None,
        trusted_keys: Sequence[Any] = (),
        model: str | None = None,
        progress: Any = None,
    ) -> PublishResult:
        """Verify ``package`` and publish it on ``channel`` at ``rollout`` percent.
        ``progress``: an object with ``phase(name, total)`` and ``advance(n)`` (the CLI's
        bars; the phases are :data:`PUBLISH_PHASES`)."""
        progress = progress or _NoProgress()
        keys = self._keys()
        self.store.remove_stale_temporaries()  # what a killed publish left
        remove_stale_temporary_directories(_PUBLISH_SCRATCH)
        _check_name("channel", channel)
        rollout_bp = _rollout_bp(rollout)
        repo = self.load()
        for role in (Targets.type, Snapshot.type, Timestamp.type):
            keys.require(repo.root, role)  # fail before uploading anything
        progress.phase("verify", 1)
        facts = inspect_package(package, policy=repo.policy, trusted_keys=trusted_keys, model=model)
        progress.advance(1)
        _check_new_on_channel(self.index(repo), facts.model, channel, facts.version, facts.sha256)
        log.info(
            "verified %s: %s %s, sha256 %s",
            facts.path,
            facts.model,
            facts.version,
            facts.sha256[:16],
        )
        # payload first
        progress.phase("store package", 1)
        existed = self.store.exists(object_key(facts.sha256))
        self.store.put_object(facts.path, expected_sha256=facts.sha256)
        progress.advance(1)
        log.info("stored package object %s", object_key(facts.sha256))
        count = repo.policy.delta_count if delta_count is None else delta_count
        now = format_time(self.clock())

        def attempt(repo: VerifiedRepository) -> PublishResult:
            index = self.index(repo)
            _check_new_on_channel(index, facts.model, channel, facts.version, facts.sha256)
            targets = repo.editable_targets()
            with pid_temporary_directory(_PUBLISH_SCRATCH) as tmp:
                deltas = self._ensure_deltas(
                    index, targets, facts.model, channel, facts.sha256, facts.path, count, tmp,
                    progress,
                )
            release = ReleaseInfo(
                path=release_target_path(facts.model, channel, facts.version),
                model=facts.model,
                version=facts.version,
                channel=channel,
                rollout_bp=rollout_bp,
                sha256=facts.sha256,
                length=facts.length,
                requirements=facts.requirements,
                published=now,
                signers=facts.signers,
                deltas=deltas,
                chunks=chunk_hashes(facts.path),
                model_card=facts.model_card,
                weights_digest=facts.weights_digest,
                adapter_for=facts.adapter_for,
            )
            _put_release(targets, release)
            progress.phase("sign metadata", 1)
            versions = self._commit(repo, targets=targets)
            progress.advance(1)
            return PublishResult(release, not existed, versions)

        return self._with_retries(attempt)

    def promote(
        self,
        version: str,
        channel: str,
        *,
        rollout: float | None = None,
        model: str | None = None,
        delta_count: int | None = None,
    ) -> PublishResult:
        """Put an already published version on ``channel`` (no re-upload), or change
        its rollout there."""
        self._keys()
        _check_name("channel", channel)
        rollout_bp = None if rollout is None else _rollout_bp(rollout)
        try:
            parse_semver(version)
        except ValueError as exc:
            raise ReleasePolicyError(str(exc)) from None

        def attempt(repo: VerifiedRepository) -> PublishResult:
            index = self.index(repo)
            name = _pick_model(index, model)
            found = index.find(name, version)
            if not found:
                raise UnknownReleaseError(f"{name} {version} has not been published")
            targets = repo.editable_targets()
            on_channel = [r for r in found if r.channel == channel]
            if on_channel:
                current = on_channel[0]
                if rollout_bp is None or rollout_bp == current.rollout_bp:
                    return PublishResult(current, False, repo.versions(), changed=False)
                release = dataclasses.replace(current, rollout_bp=rollout_bp)
            else:
                source = found[-1]
                _check_new_on_channel(index, name, channel, version, source.sha256)
                self.store.require(source.object_key)
                count = repo.policy.delta_count if delta_count is None else delta_count
                with tempfile.TemporaryDirectory(prefix="edgepack-promote-") as tmp:
                    deltas = self._ensure_deltas(
                        index,
                        targets,
                        name,
                        channel,
                        source.sha256,
                        lambda: self._local_copy(source, tmp),
                        count,
                        tmp,
                    )
                release = dataclasses.replace(
                    source,
                    path=release_target_path(name, channel, version),
                    channel=channel,
                    rollout_bp=10_000 if rollout_bp is None else rollout_bp,
                    published=format_time(self.clock()),
                    deltas=deltas,
                )
            _put_release(targets, release)
            versions = self._commit(repo, targets=targets)
            return PublishResult(release, False, versions)

        return self._with_retries(attempt)

    # -- deltas --------------------------------------------------------------------------
    def _ensure_deltas(
        self,
        index: ReleaseIndex,
        targets: Targets,
        model: str,
        channel: str,
        new_sha: str,
        new_path: Path | Callable[[], Path],
        count: int,
        tmp: str,
        progress: Any = None,
    ) -> tuple[DeltaInfo, ...]:
        """Deltas from the last ``count`` distinct releases of the channel to ``new_sha``:
        reused when the pair already has one, else built, stored, and added as targets."""
        if count <= 0:
            return ()
        bases: list[ReleaseInfo] = []
        for release in reversed(index.releases(model, channel)):
            if release.sha256 != new_sha and all(b.sha256 != release.sha256 for b in bases):
                bases.append(release)
            if len(bases) >= count:
                break
        out: list[DeltaInfo] = []
        progress = progress or _NoProgress()
        progress.phase("deltas", len(bases))
        for i, base in enumerate(bases):
            progress.advance(1 if i else 0, f"from {base.version}")  # the previous one is done
            path = delta_target_path(model, base.sha256, new_sha)
            known = targets.targets.get(path)
            if known is not None and self.store.exists(object_key(known.hashes["sha256"])):
                out.append(
                    DeltaInfo(base.version, base.sha256, path, known.hashes["sha256"], known.length)
                )
                continue
            if not delta_codec_available():
                break
            if callable(new_path):
                new_path = new_path()
            old_path = self._local_copy(base, tmp)
            made = make_delta(old_path, new_path, Path(tmp) / f"{base.sha256[:16]}.epkd")
            if made is None:
                continue
            obj = self.store.put_object(made)
            log.info("stored delta %s -> %s as %s", base.version, new_sha[:16], obj.key)
            targets.targets[path] = TargetFile(
                obj.size,
                {"sha256": obj.sha256 or ""},
                path,
                {
                    "custom": {
                        CUSTOM_KEY: {
                            "schema": 1,
                            "kind": "delta",
                            "model": model,
                            "from_sha256": base.sha256,
                            "from_version": base.version,
                            "to_sha256": new_sha,
                        }
                    }
                },
            )
            out.append(DeltaInfo(base.version, base.sha256, path, obj.sha256 or "", obj.size))
        return tuple(out)

    def _local_copy(self, release: ReleaseInfo, tmp: str) -> Path:
        path = self.store.local_path(release.object_key)
        if path is not None:
            return path
        dest = Path(tmp) / f"{release.sha256}.epk"
        if not dest.exists():
            self.store.download(
                release.object_key,
                dest,
                expected_sha256=release.sha256,
                expected_size=release.length,
            )
        return dest

    # ================================================================ keys and expiry
    def rotate_key(self, role: str) -> Root:
        """Replace every key of ``role`` by a fresh one; return the new root.

        The new root (version n+1) is signed by a threshold of the old root keys and of
        the new ones. For targets/snapshot/timestamp, the role's metadata is first
        re-issued signed by old *and* new keys, so clients on either root accept it;
        only then is the new root written.
        """
        keys = self._keys()
        if role not in ROLES:
            raise ReleasePolicyError(f"unknown role {role!r} (one of {', '.join(ROLES)})")
        repo = self.load()
        old_root = repo.root
        old_root_signers = keys.require(old_root, Root.type)
        new = copy.deepcopy(old_root)
        old_ids = list(new.roles[role].keyids)
        fresh = [keys.generate(role) for _ in old_ids]
        for key in fresh:
            new.add_key(key, role)
        for keyid in old_ids:
            new.revoke_key(keyid, role)
        new.version += 1
        new.expires = self.clock() + repo.policy.lifetime(Root.type)
        fresh_signers = [keys.signers()[k.keyid] for k in fresh]
        new_root_signers = keys.require(new, Root.type)
        root_md = sign(new, [*old_root_signers, *new_root_signers])
        verify_root_update(old_root, root_md, "the new root")
        root_bytes = serialize(root_md)
        if role != Root.type:
            self._commit(
                repo,
                targets=repo.editable_targets() if role == Targets.type else None,
                new_snapshot=role in (Targets.type, Snapshot.type),
                extra_signers={role: fresh_signers},
            )
        self._write_root(repo, new, root_bytes)
        keys.retire(old_ids)
        log.info("root v%d: %s keys rotated", new.version, role)
        return new

    def renew_root(self) -> Root:
        """Re-issue the root with the same keys and a new expiry (version n+1, signed by
        a threshold of the root keys): what renews an expiring or expired root.
        ``refresh`` never does, as it runs unattended with the online keys only."""
        keys = self._keys()
        repo = self.load()
        new = copy.deepcopy(repo.root)
        new.version += 1
        new.expires = self.clock() + repo.policy.lifetime(Root.type)
        root_md = sign(new, keys.require(repo.root, Root.type))
        verify_root_update(repo.root, root_md, "the renewed root")
        self._write_root(repo, new, serialize(root_md))
        log.info("root v%d: renewed until %s", new.version, format_time(new.expires))
        return new

    def _write_root(self, repo: VerifiedRepository, new: Root, root_bytes: bytes) -> None:
        try:
            self.store.put_bytes(
                root_key(new.version), root_bytes, if_absent=True, content_type=_JSON
            )
        except ConcurrentUpdateError:
            raise RepositoryError(
                f"{self.store.url}: root version {new.version} appeared meanwhile (a concurrent "
                "rotation?); nothing was changed"
            ) from None
        self.store.put_bytes(root_key(), root_bytes, content_type=_JSON)
        self._record({**repo.versions(), "root": new.version}, root_bytes)

    def refresh(self, *, force: bool = False) -> dict[str, int]:
        """Re-sign what expires within half its lifetime (timestamp always). The root is
        left alone (its keys may be offline): a warning says when it needs
        :meth:`renew_root`."""
        now = self.clock()

        def attempt(repo: VerifiedRepository) -> dict[str, int]:
            policy = repo.policy

            def due(role: str, md: Metadata) -> bool:
                return force or md.signed.expires - now < policy.lifetime(role) / 2

            targets_due = due(Targets.type, repo.targets_md)
            if repo.root.expires - now < policy.lifetime(Root.type) / 2:
                log.warning(
                    "root metadata expires at %s: %s",
                    format_time(repo.root.expires),
                    renewal_advice(Root.type),
                )
            return self._commit(
                repo,
                targets=repo.editable_targets() if targets_due else None,
                new_snapshot=targets_due or due(Snapshot.type, repo.snapshot_md),
            )

        return self._with_retries(attempt)

    # ================================================================ checking
    def verify(self, *, deep: bool = False) -> list[str]:
        """Problems found: expired metadata, targets whose bytes are missing, of the
        wrong size or (``deep``) the wrong hash, releases listing unknown deltas, a
        ``root.json`` that is not the newest root. With a keys directory, versions below
        those recorded there are a :class:`RollbackError` and what verified is recorded;
        without one a rollback to older, validly signed metadata cannot be seen."""
        repo = self.load()
        problems = [
            f"{role} metadata expired at {format_time(when)} ({renewal_advice(role)})"
            for role, when in self.expired(repo)
        ]
        try:
            latest_copy = self.store.get_bytes(root_key(), max_length=_METADATA_MAX)[0]
        except ObjectNotFoundError:
            latest_copy = None
        if latest_copy != repo.root_bytes:
            problems.append(
                f"{root_key()} is {'missing' if latest_copy is None else 'not a copy of'} the "
                f"newest root ({root_key(repo.root.version)})"
            )
        for path, target in sorted(repo.targets.targets.items()):
            sha = target.hashes.get("sha256", "")
            try:
                info = self.store.stat(object_key(sha))
            except ValueError:
                problems.append(f"{path}: no usable sha256")
                continue
            if info is None:
                problems.append(f"{path}: object {object_key(sha)} is missing")
                continue
            if info.size != target.length:
                problems.append(f"{path}: object has {info.size} bytes, expected {target.length}")
                continue
            if deep:
                digest = hashlib.sha256()
                for chunk in self.store.iter_bytes(object_key(sha)):
                    digest.update(chunk)
                if digest.hexdigest() != sha:
                    problems.append(f"{path}: object content does not match its sha256")
        for release in self.index(repo):
            for delta in release.deltas:
                if delta.path not in repo.targets.targets:
                    problems.append(f"{release.path}: delta {delta.path} is not a target")
        if not problems:
            self._record(repo.versions(), repo.root_bytes)
        return problems


# ---------------------------------------------------------------------- helpers


def _check_name(kind: str, name: str) -> None:
    try:
        check_name(kind, name)
    except ValueError as exc:
        raise ReleasePolicyError(str(exc)) from None


def _rollout_bp(percent: float) -> int:
    try:
        return percent_to_bp(float(percent))
    except ValueError as exc:
        raise ReleasePolicyError(str(exc)) from None


def _pick_model(index: ReleaseIndex, model: str | None) -> str:
    if model is not None:
        return model
    models = index.models()
    if len(models) == 1:
        return models[0]
    if not models:
        raise UnknownReleaseError("the repository holds no releases")
    raise ReleasePolicyError(
        f"the repository holds several models ({', '.join(models)}): pass --model"
    )


def _check_new_on_channel(
    index: ReleaseIndex, model: str, channel: str, version: str, sha256: str
) -> None:
    for other in index.find(model, version):
        if other.sha256 != sha256:
            raise VersionConflictError(
                f"{model} {version} is already published (channel {other.channel}) with "
                "different content: give the new package a new version"
            )
    latest = index.latest(model, channel)
    if latest is not None and semver_precedence(version) <= semver_precedence(latest.version):
        raise VersionNotIncreasingError(
            f"{model} {version} is not above {latest.version}, the newest release on channel "
            f"{channel!r}: versions on a channel only go up (to roll back, publish the old "
            f"content under a version above {latest.version})",
            channel=channel,
            version=version,
            latest=latest.version,
        )


def _put_release(targets: Targets, release: ReleaseInfo) -> None:
    targets.targets[release.path] = TargetFile(
        release.length,
        {"sha256": release.sha256},
        release.path,
        {"custom": release.custom()},
    )

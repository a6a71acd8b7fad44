"""TUF metadata for a release repository: build, sign and verify, with no I/O.

Top-level roles only (root, targets, snapshot, timestamp), Ed25519 keys, consistent
snapshots. File names in the store (under ``metadata/``):

* ``<n>.root.json`` for every root version (clients walk them one by one) and
  ``root.json``, a copy of the newest;
* ``<n>.targets.json`` and ``<n>.snapshot.json`` (consistent snapshots: never
  overwritten once referenced);
* ``timestamp.json``, the one mutable file: replacing it commits a publish.

Repository policy (``x-edgepack`` in root, so only root keys change it): package keys
and threshold required to publish, how many deltas to precompute, metadata lifetimes.

:func:`verify_repository` checks a set of files the way a client would (signatures
by threshold, root chain, lengths and hashes along timestamp -> snapshot -> targets)
but does not enforce expiry: the publisher must be able to repair an expired
repository. :func:`expired_roles` reports expiry separately.
"""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from securesystemslib.signer import Signer
from tuf.api import exceptions as tuf_exc
from tuf.api.metadata import (
    SPECIFICATION_VERSION,
    Key,
    Metadata,
    MetaFile,
    Role,
    Root,
    Snapshot,
    Targets,
    Timestamp,
)
from tuf.api.serialization import DeserializationError
from tuf.api.serialization.json import JSONSerializer

from ..errors import MetadataSignatureError, RepositoryError

__all__ = [
    "METADATA_PREFIX",
    "ROLES",
    "RepoPolicy",
    "VerifiedRepository",
    "expired_roles",
    "format_time",
    "metafile_for",
    "new_root",
    "parse",
    "renewal_advice",
    "repository_id",
    "root_key",
    "serialize",
    "sign",
    "utcnow",
    "verify_repository",
    "verify_root_update",
    "versioned_key",
]

METADATA_PREFIX = "metadata/"
ROLES = (Root.type, Targets.type, Snapshot.type, Timestamp.type)
SPEC_VERSION = ".".join(SPECIFICATION_VERSION)
POLICY_FIELD = "x-edgepack"
_SERIALIZER = JSONSerializer(compact=False)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


def format_time(t: dt.datetime) -> str:
    """ISO 8601 UTC with a Z, to the second (the form TUF uses for ``expires``)."""
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def versioned_key(role: str, version: int) -> str:
    return f"{METADATA_PREFIX}{version}.{role}.json"


def root_key(version: int | None = None) -> str:
    return versioned_key(Root.type, version) if version else f"{METADATA_PREFIX}root.json"


TIMESTAMP_KEY = f"{METADATA_PREFIX}timestamp.json"


def repository_id(first_root_bytes: bytes) -> str:
    """A repository's identity: the SHA-256 (hex) of its first root, ``1.root.json``.

    Written create-only by ``repo init`` and never changed (later roots are new files),
    so every path, symlink or URL spelling of a store, and every copy of it, has the
    same id; repositories made before ids existed have one too, with nothing to
    migrate in the store. The keys directory keys its trusted state by it."""
    return hashlib.sha256(first_root_bytes).hexdigest()


def renewal_advice(role: str) -> str:
    """The command that re-signs ``role``'s metadata with a new expiry."""
    if role == Root.type:
        return "run `edgepack repo renew-root` (needs the root keys)"
    return "run `edgepack repo refresh`"


# ----------------------------------------------------------------------- policy


@dataclass(frozen=True)
class RepoPolicy:
    """Repository rules carried in signed root metadata."""

    package_keys: Mapping[str, str] = field(default_factory=dict)  # key id hex -> PEM
    package_threshold: int = 1
    delta_count: int = 3
    expiry_days: Mapping[str, int] = field(
        default_factory=lambda: {"root": 365, "targets": 90, "snapshot": 30, "timestamp": 7}
    )

    @property
    def requires_signed_packages(self) -> bool:
        return bool(self.package_keys)

    def lifetime(self, role: str) -> dt.timedelta:
        return dt.timedelta(days=int(self.expiry_days[role]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "package_keys": dict(self.package_keys),
            "package_threshold": self.package_threshold,
            "delta_count": self.delta_count,
            "expiry_days": dict(self.expiry_days),
        }

    @classmethod
    def from_root(cls, root: Root) -> RepoPolicy:
        raw = root.unrecognized_fields.get(POLICY_FIELD) or {}
        default = cls()
        try:
            return cls(
                package_keys={str(k): str(v) for k, v in raw.get("package_keys", {}).items()},
                package_threshold=int(raw.get("package_threshold", 1)),
                delta_count=int(raw.get("delta_count", default.delta_count)),
                expiry_days={**default.expiry_days, **raw.get("expiry_days", {})},
            )
        except (TypeError, ValueError, AttributeError) as exc:
            raise RepositoryError(f"root metadata has a malformed {POLICY_FIELD}: {exc}") from None

    def package_public_keys(self) -> list[Any]:
        from cryptography.hazmat.primitives import serialization

        return [
            serialization.load_pem_public_key(pem.encode()) for pem in self.package_keys.values()
        ]


# ------------------------------------------------------------------------ building


def new_root(
    keys: Mapping[str, Iterable[Key]],
    thresholds: Mapping[str, int],
    policy: RepoPolicy,
    now: dt.datetime,
) -> Root:
    root = Root(
        version=1,
        spec_version=SPEC_VERSION,
        expires=now + policy.lifetime(Root.type),
        keys={},
        roles={role: Role([], thresholds.get(role, 1)) for role in ROLES},
        consistent_snapshot=True,
        unrecognized_fields={POLICY_FIELD: policy.to_dict()},
    )
    for role, role_keys in keys.items():
        for key in role_keys:
            root.add_key(key, role)
    for role in ROLES:
        if len(root.roles[role].keyids) < root.roles[role].threshold:
            raise ValueError(f"{role}: fewer keys than its threshold")
    return root


def sign(signed: Any, signers: Iterable[Signer]) -> Metadata:
    """Wrap ``signed`` in Metadata signed by every signer (duplicates collapse)."""
    md = Metadata(signed)
    for signer in signers:
        md.sign(signer, append=True)
    return md


def serialize(md: Metadata) -> bytes:
    return md.to_bytes(_SERIALIZER)


def parse(data: bytes, role: str, where: str) -> Metadata:
    try:
        md = Metadata.from_bytes(data)
    except DeserializationError as exc:
        raise RepositoryError(f"{where} is not valid TUF metadata: {exc}") from None
    if md.signed.type != role:
        raise RepositoryError(f"{where} holds {md.signed.type} metadata, expected {role}")
    return md


def metafile_for(data: bytes, version: int) -> MetaFile:
    return MetaFile(version=version, length=len(data), hashes={"sha256": _sha256(data)})


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------- verifying


def verify_root_update(trusted: Root, new_md: Metadata, where: str) -> Root:
    """Accept ``new_md`` as the next root after ``trusted`` (TUF 5.3.4-5.3.5)."""
    new = new_md.signed
    if not isinstance(new, Root):
        raise RepositoryError(f"{where} is not root metadata")
    if new.version != trusted.version + 1:
        raise RepositoryError(
            f"{where}: root version {new.version} does not follow {trusted.version}"
        )
    payload = new_md.signed_bytes
    try:
        trusted.verify_delegate(Root.type, payload, new_md.signatures)
        new.verify_delegate(Root.type, payload, new_md.signatures)
    except tuf_exc.UnsignedMetadataError as exc:
        raise MetadataSignatureError(f"{where}: {exc}") from None
    return new


def verify_first_root(md: Metadata, where: str) -> Root:
    root = md.signed
    if not isinstance(root, Root):
        raise RepositoryError(f"{where} is not root metadata")
    try:
        root.verify_delegate(Root.type, md.signed_bytes, md.signatures)
    except tuf_exc.UnsignedMetadataError as exc:
        raise MetadataSignatureError(f"{where}: {exc}") from None
    return root


@dataclass
class VerifiedRepository:
    """The committed state of a repository, every piece verified.

    ``*_bytes`` are the exact stored files; ``timestamp_etag`` is the store's ETag of
    ``timestamp.json``, the compare-and-swap token for the next commit.
    """

    root_md: Metadata
    root_bytes: bytes
    timestamp_md: Metadata
    timestamp_bytes: bytes
    timestamp_etag: str
    snapshot_md: Metadata
    snapshot_bytes: bytes
    targets_md: Metadata
    targets_bytes: bytes

    @property
    def root(self) -> Root:
        return self.root_md.signed

    @property
    def timestamp(self) -> Timestamp:
        return self.timestamp_md.signed

    @property
    def snapshot(self) -> Snapshot:
        return self.snapshot_md.signed

    @property
    def targets(self) -> Targets:
        return self.targets_md.signed

    @property
    def policy(self) -> RepoPolicy:
        return RepoPolicy.from_root(self.root)

    def versions(self) -> dict[str, int]:
        return {
            "root": self.root.version,
            "timestamp": self.timestamp.version,
            "snapshot": self.snapshot.version,
            "targets": self.targets.version,
        }

    def editable_targets(self) -> Targets:
        return copy.deepcopy(self.targets)


def verify_delegated(root: Root, role: str, md: Metadata, where: str) -> None:
    try:
        root.verify_delegate(role, md.signed_bytes, md.signatures)
    except tuf_exc.UnsignedMetadataError as exc:
        raise MetadataSignatureError(f"{where}: {exc}") from None


def check_meta(meta: MetaFile, data: bytes, where: str) -> None:
    try:
        meta.verify_length_and_hashes(data)
    except tuf_exc.LengthOrHashMismatchError as exc:
        raise RepositoryError(f"{where}: does not match the metadata above it ({exc})") from None


def verify_repository(
    root_md: Metadata,
    root_bytes: bytes,
    timestamp_bytes: bytes,
    timestamp_etag: str,
    fetch: Any,
) -> VerifiedRepository:
    """Verify timestamp -> snapshot -> targets against an already trusted root.

    ``fetch(key) -> bytes`` reads a metadata file from the store.
    """
    root = root_md.signed
    ts_md = parse(timestamp_bytes, Timestamp.type, "timestamp.json")
    verify_delegated(root, Timestamp.type, ts_md, "timestamp.json")
    snap_meta = ts_md.signed.snapshot_meta
    snap_key = versioned_key(Snapshot.type, snap_meta.version)
    snap_bytes = fetch(snap_key)
    check_meta(snap_meta, snap_bytes, snap_key)
    snap_md = parse(snap_bytes, Snapshot.type, snap_key)
    verify_delegated(root, Snapshot.type, snap_md, snap_key)
    if snap_md.signed.version != snap_meta.version:
        raise RepositoryError(f"{snap_key} holds version {snap_md.signed.version}")
    targets_meta = snap_md.signed.meta.get("targets.json")
    if targets_meta is None:
        raise RepositoryError(f"{snap_key} does not list targets.json")
    targets_key = versioned_key(Targets.type, targets_meta.version)
    targets_bytes = fetch(targets_key)
    check_meta(targets_meta, targets_bytes, targets_key)
    targets_md = parse(targets_bytes, Targets.type, targets_key)
    verify_delegated(root, Targets.type, targets_md, targets_key)
    if targets_md.signed.version != targets_meta.version:
        raise RepositoryError(f"{targets_key} holds version {targets_md.signed.version}")
    return VerifiedRepository(
        root_md,
        root_bytes,
        ts_md,
        timestamp_bytes,
        timestamp_etag,
        snap_md,
        snap_bytes,
        targets_md,
        targets_bytes,
    )


def expired_roles(repo: VerifiedRepository, now: dt.datetime) -> list[tuple[str, dt.datetime]]:
    out = []
    for role, md in (
        ("root", repo.root_md),
        ("timestamp", repo.timestamp_md),
        ("snapshot", repo.snapshot_md),
        ("targets", repo.targets_md),
    ):
        if md.signed.is_expired(now):
            out.append((role, md.signed.expires))
    return out

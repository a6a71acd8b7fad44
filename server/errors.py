"""Errors of the release store and the release repository, typed by what the caller can do.

Everything here derives from :class:`edgepack.format.errors.EdgepackError`, so the CLI
maps every failure to an exit code in its one table (:mod:`edgepack.cli.exit_codes`)
and callers catch one root:

* :class:`StoreError` - the store (local directory or S3) failed. ``retriable`` says
  whether trying the same operation again may succeed (throttling, a dropped
  connection, a lost race), as opposed to a missing object or refused credentials.
* :class:`RepositoryError` - the signed release metadata is missing, malformed, fails to
  verify, has expired or went backwards.
* :class:`ReleasePolicyError` - the request contradicts the repository's rules: a version
  that does not go up on its channel, an unknown release, missing signing keys.
"""

from __future__ import annotations

from edgepack.format.errors import EdgepackError, SignatureError

__all__ = [
    "ConcurrentUpdateError",
    "ExpiredMetadataError",
    "InvalidStoreURLError",
    "MetadataSignatureError",
    "MissingKeyError",
    "ObjectNotFoundError",
    "ReleasePolicyError",
    "RepositoryError",
    "RepositoryExistsError",
    "RepositoryNotInitializedError",
    "RollbackError",
    "StoreError",
    "UnknownReleaseError",
    "VersionConflictError",
    "VersionNotIncreasingError",
]


# ----------------------------------------------------------------------- store


class StoreError(EdgepackError):
    """A store operation failed. ``retriable``: the same call may succeed later."""

    def __init__(self, message: str, *, retriable: bool = False, key: str | None = None) -> None:
        super().__init__(message)
        self.retriable = retriable
        self.key = key


class InvalidStoreURLError(StoreError):
    """The store URL is not ``/path``, ``file:///path`` or ``s3://bucket[/prefix]``."""


class ObjectNotFoundError(StoreError):
    """The object does not exist in the store."""


class ConcurrentUpdateError(StoreError):
    """A conditional write lost a race (another publisher committed first, or the object
    already exists). Retrying the whole operation from a fresh read is safe."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message, retriable=True, key=key)


# ------------------------------------------------------------------ repository


class RepositoryError(EdgepackError):
    """The release metadata in the store is missing, malformed or does not verify."""


class RepositoryNotInitializedError(RepositoryError):
    """The store holds no release metadata: run ``edgepack repo init`` first."""


class RepositoryExistsError(RepositoryError):
    """``repo init`` on a store that already holds release metadata."""


class MetadataSignatureError(RepositoryError, SignatureError):
    """Metadata is not signed by a threshold of the keys its delegating role trusts."""


class ExpiredMetadataError(RepositoryError):
    """Metadata is past its expiry date (a freeze attack, or nobody re-signed it:
    ``edgepack repo refresh``)."""

    def __init__(self, message: str, *, role: str | None = None) -> None:
        super().__init__(message)
        self.role = role


class RollbackError(RepositoryError):
    """Metadata went backwards: a version lower than one already trusted or recorded
    (a rollback attack, or a store restored from an old backup)."""

    def __init__(
        self,
        message: str,
        *,
        role: str | None = None,
        trusted_version: int | None = None,
        new_version: int | None = None,
    ) -> None:
        super().__init__(message)
        self.role = role
        self.trusted_version = trusted_version
        self.new_version = new_version


# ---------------------------------------------------------------------- policy


class ReleasePolicyError(EdgepackError):
    """The request breaks a rule of the release repository."""


class VersionNotIncreasingError(ReleasePolicyError):
    """A release's version is not above the newest one on its channel.

    Versions on a channel only go up; to roll back, publish the old content again under
    a higher version.
    """

    def __init__(
        self, message: str, *, channel: str = "", version: str = "", latest: str = ""
    ) -> None:
        super().__init__(message)
        self.channel = channel
        self.version = version
        self.latest = latest


class VersionConflictError(ReleasePolicyError):
    """The model version is already published with different content."""


class UnknownReleaseError(ReleasePolicyError):
    """No release with that model/version exists in the repository."""


class MissingKeyError(ReleasePolicyError):
    """The keys directory does not hold enough keys to sign for a role."""

"""Errors of the update client, typed by what the caller can do about them.

All sit under :class:`UpdateError` (an :class:`~edgepack.format.errors.EdgepackError`);
refusals of trust are also :class:`~edgepack.format.errors.SignatureError`, so the CLI's
one exit-code table maps them without rows of their own. python-tuf's exceptions never
escape: :func:`edgepack.runtime_shim.update.tuf_errors.map_tuf_error` translates them.
"""

from __future__ import annotations

from edgepack.format.errors import CorruptPackageError, EdgepackError, SignatureError

__all__ = [
    "DownloadError",
    "DownloadHTTPError",
    "DownloadLengthError",
    "ExpiredMetadataError",
    "HealthCheckError",
    "InsufficientStorageError",
    "MetadataError",
    "MetadataSignatureError",
    "MixAndMatchError",
    "NotInstalledError",
    "RollbackError",
    "SlotError",
    "SlowRetrievalError",
    "TargetVerificationError",
    "UnsafeTargetError",
    "UpdateError",
]


class UpdateError(EdgepackError):
    """An update could not be checked, fetched or installed; the active model is intact."""


class MetadataError(UpdateError):
    """The TUF metadata (or the update-check answer) is malformed or inconsistent."""


class MetadataSignatureError(MetadataError, SignatureError):
    """Metadata not signed by the threshold of trusted keys (an unknown key, say)."""


class ExpiredMetadataError(MetadataError, SignatureError):
    """Metadata past its expiry: the server is frozen or replaying an old state."""


class RollbackError(MetadataError, SignatureError):
    """Metadata or a release older than what this device already trusts."""


class MixAndMatchError(RollbackError):
    """Metadata that is not the version the signed snapshot names: a targets file
    replayed from another snapshot (mix-and-match)."""


class UnsafeTargetError(MetadataError, SignatureError):
    """A target the signed metadata does not vouch for, or a path that leaves its tree."""


class DownloadError(UpdateError):
    """Fetching failed; ``retriable`` says whether trying again later may help."""

    def __init__(self, message: str, *, retriable: bool = True) -> None:
        super().__init__(message)
        self.retriable = retriable


class DownloadHTTPError(DownloadError):
    """The server answered an HTTP error status (kept as ``status_code``)."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message, retriable=status_code >= 500 or status_code == 429)
        self.status_code = status_code


class DownloadLengthError(DownloadError):
    """The server sent more bytes than the signed length (endless data)."""


class SlowRetrievalError(DownloadError):
    """The server sent too slowly or stalled past the config's timeouts."""


class TargetVerificationError(UpdateError, CorruptPackageError):
    """Downloaded or staged bytes do not match their signed hash or length."""


class InsufficientStorageError(UpdateError):
    """Not enough free space for the download and the staged file."""

    def __init__(self, message: str, *, needed_bytes: int, free_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes


class HealthCheckError(UpdateError):
    """The new model opened but failed its health check; the client switched back."""


class SlotError(UpdateError):
    """The slot directory is unusable: no trusted root yet, or a damaged journal."""


class NotInstalledError(SlotError):
    """No model is installed in the slot directory yet: run an update first."""

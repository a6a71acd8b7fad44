"""One exception tree for all of edgepack, typed by what the caller can do about it.

Every error a user can act on derives from :class:`EdgepackError` and carries the
process exit code the CLI maps it to, so the mapping lives in exactly one place.
Programming mistakes (wrong argument types, misuse of an API) stay ``ValueError`` /
``TypeError`` and are not part of this tree.
"""

from __future__ import annotations

__all__ = [
    "EXIT_CORRUPT",
    "EXIT_INCOMPATIBLE",
    "EXIT_OK",
    "EXIT_SIGNATURE",
    "EXIT_USAGE",
    "CorruptPackageError",
    "EdgepackError",
    "EncodingError",
    "ImportModelError",
    "IncompatiblePackageError",
    "SignatureError",
    "TruncatedPackageError",
    "UnsupportedFeatureError",
]

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_CORRUPT = 3
EXIT_SIGNATURE = 4
EXIT_INCOMPATIBLE = 5


class EdgepackError(Exception):
    """Root of every error edgepack raises on bad input or a failed check."""

    exit_code: int = 1


class CorruptPackageError(EdgepackError):
    """The bytes are not a well-formed package: bad magic, bad offsets, hash mismatch."""

    exit_code = EXIT_CORRUPT


class TruncatedPackageError(CorruptPackageError):
    """The file ends before the data its header promises (an interrupted download)."""


class UnsupportedFeatureError(CorruptPackageError):
    """A required feature of the file (encoding, section kind) is unknown to this reader."""


class SignatureError(EdgepackError):
    """The signature is missing, malformed, does not verify, or is from an untrusted key."""

    exit_code = EXIT_SIGNATURE


class IncompatiblePackageError(EdgepackError):
    """The package is well formed but this runtime cannot honour its requirements.

    ``verdict`` holds the full :class:`~edgepack.format.compat.CompatibilityVerdict`.
    """

    exit_code = EXIT_INCOMPATIBLE

    def __init__(self, message: str, verdict: object | None = None) -> None:
        super().__init__(message)
        self.verdict = verdict


class EncodingError(EdgepackError):
    """A tensor cannot be encoded as asked (non-finite weights, incompatible shape)."""

    exit_code = EXIT_USAGE


class ImportModelError(EdgepackError):
    """A source model (safetensors, GGUF, HF directory) cannot be read or understood."""

    exit_code = EXIT_CORRUPT

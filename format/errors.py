"""One exception tree for all of edgepack, typed by what the caller can do about it.

Every error a user can act on derives from :class:`EdgepackError`; the CLI maps each
type to a process exit code in one table (:mod:`edgepack.cli.exit_codes`). This module
imports nothing of edgepack, so every layer can raise these and extend the tree.
Programming mistakes (wrong argument types, misuse of an API) stay ``ValueError`` /
``TypeError`` and are not part of this tree.
"""

from __future__ import annotations

__all__ = [
    "AdapterBaseError",
    "AdapterMismatchError",
    "AdapterTargetError",
    "CorruptPackageError",
    "EdgepackError",
    "EncodingError",
    "IncompatiblePackageError",
    "InvalidThresholdError",
    "OutputPathError",
    "RequiredFeatureError",
    "SignatureError",
    "TruncatedPackageError",
    "UnsupportedFeatureError",
]


class EdgepackError(Exception):
    """Root of every error edgepack raises on bad input or a failed check."""


class CorruptPackageError(EdgepackError):
    """The bytes are not a well-formed package: bad magic, bad offsets, hash mismatch."""


class TruncatedPackageError(CorruptPackageError):
    """The file ends before the data its header promises (an interrupted download)."""


class UnsupportedFeatureError(CorruptPackageError):
    """A required feature of the file (encoding, section kind) is unknown to this reader."""


class RequiredFeatureError(UnsupportedFeatureError):
    """The package lists a ``required_features`` entry this reader does not implement:
    well formed, and a newer reader is the fix (the CLI exits "incompatible")."""


class SignatureError(EdgepackError):
    """The signature is missing, malformed, does not verify, or is from an untrusted key."""


class IncompatiblePackageError(EdgepackError):
    """The package is well formed but this runtime cannot honour its requirements.

    ``verdict`` holds the full :class:`~edgepack.format.compat.CompatibilityVerdict`.
    """

    def __init__(self, message: str, verdict: object | None = None) -> None:
        super().__init__(message)
        self.verdict = verdict


class OutputPathError(EdgepackError):
    """An output path is unusable: it is one of the inputs, it exists (and overwriting
    was not asked for), it is not a regular file, or its parent is not a directory."""


class EncodingError(EdgepackError):
    """A tensor cannot be encoded as asked (non-finite weights, incompatible shape)."""


class InvalidThresholdError(EdgepackError, ValueError):
    """A signature threshold below 1 was asked for: it would accept unsigned input."""


class AdapterMismatchError(EdgepackError):
    """A well-formed LoRA adapter that does not fit the base it is used with."""


class AdapterBaseError(AdapterMismatchError):
    """The adapter was made for other weights (its base weights digest differs)."""


class AdapterTargetError(AdapterMismatchError):
    """The adapter's targets name no tensor of the base, or one of another shape."""

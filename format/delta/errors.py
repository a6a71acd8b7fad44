"""Typed errors of the delta reader and patcher (spec/DELTA.md section 7).

They extend the package error tree of :mod:`edgepack.format.errors`, so the CLI's one
mapping from error to exit code covers them and callers catch one root.
"""

from __future__ import annotations

from edgepack.format.errors import (
    CorruptPackageError,
    IncompatiblePackageError,
    SignatureError,
    TruncatedPackageError,
    UnsupportedFeatureError,
)

__all__ = [
    "CorruptDeltaError",
    "DeltaError",
    "IncompatibleDeltaError",
    "SignatureError",
    "TargetMismatchError",
    "TruncatedDeltaError",
    "UnsupportedDeltaError",
    "WrongBaseError",
]


class DeltaError(CorruptPackageError):
    """Root of the delta failures that are about bytes (exit code 3)."""


class CorruptDeltaError(DeltaError):
    """The delta file is malformed, inconsistent, or its payload does not match its hash."""


class TruncatedDeltaError(CorruptDeltaError, TruncatedPackageError):
    """The delta ends before the data its preamble promises (an interrupted download)."""


class UnsupportedDeltaError(CorruptDeltaError, UnsupportedFeatureError):
    """The delta uses an op, codec or feature this patcher does not know; update edgepack."""


class WrongBaseError(DeltaError):
    """The base file is not the one the delta was made from (checked before any work)."""


class TargetMismatchError(DeltaError):
    """Applying the delta did not reproduce the recorded target (bad base or delta bytes)."""


class IncompatibleDeltaError(IncompatiblePackageError):
    """The delta's format major version is newer than this patcher reads."""

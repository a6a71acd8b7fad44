"""edgepack.format.delta: read, check and apply `.epkd` deltas (spec/DELTA.md).

This is the device side: it imports only numpy, zstandard, cryptography, flatbuffers and
edgepack.format. Creating deltas lives in :mod:`edgepack.server.delta`.

Public API: :func:`apply_delta` (streaming, atomic, verified), :class:`DeltaFile` (parse,
validate and inspect without applying) and the errors of :mod:`.errors`.
"""

from .apply import ApplyReport, DeltaFile, apply_delta, check_base
from .container import DELTA_MAGIC, DeltaHeader, Op, Stream
from .errors import (
    CorruptDeltaError,
    DeltaError,
    IncompatibleDeltaError,
    TargetMismatchError,
    TruncatedDeltaError,
    UnsupportedDeltaError,
    WrongBaseError,
)

__all__ = [
    "DELTA_MAGIC",
    "ApplyReport",
    "CorruptDeltaError",
    "DeltaError",
    "DeltaFile",
    "DeltaHeader",
    "IncompatibleDeltaError",
    "Op",
    "Stream",
    "TargetMismatchError",
    "TruncatedDeltaError",
    "UnsupportedDeltaError",
    "WrongBaseError",
    "apply_delta",
    "check_base",
]

"""edgepack.server.delta: create tensor-aware deltas (the write side of spec/DELTA.md).

Applying them is :mod:`edgepack.format.delta` (device side, no server imports).
"""

from .build import DeltaOptions, DeltaStats, create_delta

__all__ = ["DeltaOptions", "DeltaStats", "create_delta"]

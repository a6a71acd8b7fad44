"""Encoding RANS streams (the inverse of :mod:`edgepack.format.delta.rans`).

Static order-0 rANS over bytes, symbols dealt round-robin to interleaved lanes: the
coder for residual streams that are close to memoryless, where it lands within ~0.1%
of their order-0 entropy and zstd's Huffman stage 2-7% above it. The creator keeps
whichever of zstd and rANS is smaller per stream.
"""

from __future__ import annotations

import struct

import numpy as np

from edgepack.format.delta.rans import MAX_LANES, PROB_BITS, STATE_LOW

__all__ = ["normalized_frequencies", "rans_encode"]

_TOTAL = 1 << PROB_BITS
_SYMBOLS_PER_LANE = 8192  # lanes = length / this (one Python step per `lanes` symbols)
_MAX_AUTO_LANES = 128  # each lane costs 4 bytes of final state
_COUNT_CHUNK = 1 << 20


def normalized_frequencies(counts: np.ndarray) -> np.ndarray:
    """Frequencies summing to 2^PROB_BITS, at least 1 for every symbol that occurs."""
    counts = np.asarray(counts, np.int64)
    present = counts > 0
    freq = np.where(present, np.maximum(1, counts * _TOTAL // max(int(counts.sum()), 1)), 0)
    # hand the rounding remainder out largest-first (or take it back, never below 1)
    order = np.argsort(-freq, kind="stable")
    diff = _TOTAL - int(freq.sum())
    while diff:
        for s in order[: int(present.sum())]:
            if diff > 0:
                freq[s] += 1
                diff -= 1
            elif freq[s] > 1:
                freq[s] -= 1
                diff += 1
            if not diff:
                break
    return freq


def _byte_counts(sym: np.ndarray) -> np.ndarray:
    """Occurrences of each byte value, counted in chunks: ``bincount`` widens its input
    to intp, eight times the stream's size at once."""
    counts = np.zeros(256, np.int64)
    for start in range(0, sym.size, _COUNT_CHUNK):
        counts += np.bincount(sym[start : start + _COUNT_CHUNK], minlength=256)
    return counts


def rans_encode(data: bytes | np.ndarray, lanes: int | None = None) -> bytes:
    """The RANS blob of ``data`` (spec/DELTA.md section 3.1)."""
    sym = np.frombuffer(bytes(data), np.uint8) if not isinstance(data, np.ndarray) else data
    sym = np.ascontiguousarray(sym, np.uint8).ravel()
    n = sym.size
    if lanes is None:
        lanes = int(np.clip(n // _SYMBOLS_PER_LANE, 1, _MAX_AUTO_LANES))
    if not 1 <= lanes <= MAX_LANES:
        raise ValueError(f"lanes must be 1..{MAX_LANES}")
    counts = _byte_counts(sym)
    if not counts.any():
        counts[0] = 1  # an empty stream still carries a valid table
    freq = normalized_frequencies(counts)
    cum = np.cumsum(freq) - freq
    f64, c64 = freq.astype(np.uint64), cum.astype(np.uint64)
    x = np.full(lanes, STATE_LOW, np.uint64)
    words: list[np.ndarray] = []
    shift, renorm = np.uint64(PROB_BITS), np.uint64(16)
    for t in range(-(-n // lanes) - 1, -1, -1):
        s = sym[t * lanes : (t + 1) * lanes].astype(np.intp)
        k = s.size
        xs, f = x[:k], f64[s]
        emit = np.flatnonzero(xs >= f << np.uint64(32 - PROB_BITS))[::-1]
        if emit.size:
            words.append((xs[emit] & np.uint64(0xFFFF)).astype("<u2"))
            xs[emit] >>= renorm
        x[:k] = ((xs // f) << shift) + xs % f + c64[s]
    symbols = np.flatnonzero(freq)
    table = np.empty((symbols.size, 3), np.uint8)
    table[:, 0] = symbols
    table[:, 1] = freq[symbols] & 0xFF
    table[:, 2] = freq[symbols] >> 8
    stream = np.concatenate(words)[::-1] if words else np.empty(0, "<u2")
    return b"".join(
        (
            struct.pack("<IH", lanes, symbols.size),
            table.tobytes(),
            x.astype("<u4").tobytes(),
            np.ascontiguousarray(stream).tobytes(),
        )
    )

"""Decoding RANS streams (spec/DELTA.md section 3.1): static order-0 rANS, interleaved.

Residual streams of re-quantized tensors (f16 scale planes, sparse gaps and values) are
close to memoryless: zstd's Huffman stage pays 2-7% over their order-0 entropy (a
Huffman code cannot spend fractions of a bit on the four near-equiprobable values of a
sparse 4-bit residual), rANS about 0.1%. Symbols go round-robin to ``lanes``
independent coders, so a decoding step is a handful of numpy operations over all lanes
and a Python loop runs once per ``lanes`` symbols. Decoding is pulled in bounded
pieces; every malformed input raises :class:`CorruptDeltaError`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np

from .errors import CorruptDeltaError

__all__ = ["MAX_LANES", "PROB_BITS", "STATE_LOW", "RansDecoder", "parse_table"]

PROB_BITS = 14  # frequencies sum to 2^14
STATE_LOW = 1 << 16  # states live in [2^16, 2^32); renormalisation moves 16-bit words
MAX_LANES = 4096
_HEAD = struct.Struct("<IH")  # lanes, symbols in the table
_STEPS_PER_CALL = 64
_WORD_READ = 1 << 16  # bytes of words fetched at a time


def parse_table(raw: bytes) -> tuple[int, np.ndarray, int]:
    """``(lanes, freq[256], header bytes)`` from the start of a RANS blob, checked."""
    if len(raw) < _HEAD.size:
        raise CorruptDeltaError("rANS stream header is truncated")
    lanes, k = _HEAD.unpack_from(raw)
    if not 1 <= lanes <= MAX_LANES or not 1 <= k <= 256:
        raise CorruptDeltaError("rANS stream header is impossible")
    end = _HEAD.size + 3 * k
    if len(raw) < end:
        raise CorruptDeltaError("rANS frequency table is truncated")
    entries = np.frombuffer(raw, np.uint8, 3 * k, _HEAD.size).reshape(k, 3)
    symbols = entries[:, 0].astype(np.int64)
    freqs = entries[:, 1].astype(np.int64) | (entries[:, 2].astype(np.int64) << 8)
    if (np.diff(symbols) <= 0).any() or (freqs == 0).any() or freqs.sum() != 1 << PROB_BITS:
        raise CorruptDeltaError("rANS frequency table is invalid")
    freq = np.zeros(256, np.int64)
    freq[symbols] = freqs
    return lanes, freq, end


class RansDecoder:
    """The ``length`` symbols of one RANS blob, decoded on demand.

    ``read(offset, n)`` returns ``n`` bytes of the blob (offsets relative to its start).
    """

    def __init__(self, read: Callable[[int, int], bytes], blob_length: int, length: int):
        self._read = read
        self._blob_length = blob_length
        head = read(0, min(blob_length, _HEAD.size + 3 * 256))
        self.lanes, freq, pos = parse_table(head)
        states_end = pos + 4 * self.lanes
        if blob_length < states_end or (blob_length - states_end) % 2:
            raise CorruptDeltaError("rANS stream is truncated or has a stray byte")
        x = np.frombuffer(read(pos, 4 * self.lanes), "<u4").astype(np.uint64)
        if len(x) != self.lanes or (x < STATE_LOW).any():
            raise CorruptDeltaError("rANS stream has an impossible state")
        self._x = x
        self._freq = freq.astype(np.uint64)
        self._cum = (np.cumsum(freq) - freq).astype(np.uint64)
        self._slot_symbol = np.repeat(np.arange(256, dtype=np.uint8), freq)
        self._word_pos = states_end  # next unread word (byte offset in the blob)
        self._words = np.empty(0, np.uint64)
        self._left = length  # symbols not yet decoded

    def _take_words(self, n: int) -> np.ndarray:
        while self._words.size < n:
            want = min(_WORD_READ, self._blob_length - self._word_pos)
            if want <= 0:
                raise CorruptDeltaError("rANS stream ends early")
            more = np.frombuffer(self._read(self._word_pos, want), "<u2").astype(np.uint64)
            self._word_pos += want
            self._words = np.concatenate([self._words, more])
        out, self._words = self._words[:n], self._words[n:]
        return out

    def decode(self, limit: int) -> bytes:
        """Up to ``limit`` (at least one step's worth when symbols remain) next symbols."""
        lanes, mask = self.lanes, np.uint64((1 << PROB_BITS) - 1)
        steps = max(1, min(_STEPS_PER_CALL, limit // lanes))
        out = []
        x = self._x
        shift, renorm = np.uint64(PROB_BITS), np.uint64(16)
        for _ in range(steps):
            k = min(lanes, self._left)
            if k <= 0:
                break
            xs = x[:k]
            slot = xs & mask
            sym = self._slot_symbol[slot]
            s64 = sym.astype(np.intp)
            xs = self._freq[s64] * (xs >> shift) + slot - self._cum[s64]
            need = np.flatnonzero(xs < STATE_LOW)
            if need.size:
                xs[need] = (xs[need] << renorm) | self._take_words(need.size)
            x[:k] = xs
            out.append(sym)
            self._left -= k
        return b"".join(a.tobytes() for a in out)

    def finish(self) -> None:
        """Everything decoded: every word used, every lane back at its initial state."""
        if self._left:
            raise CorruptDeltaError("rANS stream was not fully decoded")
        if self._words.size or self._word_pos != self._blob_length:
            raise CorruptDeltaError("rANS stream has words left over")
        if (self._x != STATE_LOW).any():
            raise CorruptDeltaError("rANS stream does not end in its initial state")

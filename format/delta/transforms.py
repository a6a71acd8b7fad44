"""Residual transforms of DATA ops (spec/DELTA.md section 4), both directions.

``residual_of`` (used by the creator) and ``combine`` (used by the patcher) are exact
inverses on any bytes; both work on chunks, so a patcher never holds a whole part.
Arrays are 1-D uint8; element widths are in bits (4 = nibbles, low nibble first).
"""

from __future__ import annotations

import numpy as np

from .container import SHUFFLE_BLOCK, SPARSE_BLOCK_HEADER, Combine
from .errors import CorruptDeltaError

__all__ = [
    "combine",
    "planes",
    "residual_of",
    "shuffle",
    "sparse_block",
    "sparsify",
    "unshuffle_block",
    "varints",
]

_UINT = {8: np.dtype("u1"), 16: np.dtype("<u2"), 32: np.dtype("<u4")}


def _zigzag(s: np.ndarray, bits: int) -> np.ndarray:
    """Signed difference (as unsigned ``bits``-bit values) -> zigzag code, same dtype."""
    one = s.dtype.type(1)
    top = s.dtype.type(bits - 1)
    neg = (s >> top) & one  # sign bit
    return (s << one) ^ (s.dtype.type(0) - neg)


def _unzigzag(z: np.ndarray) -> np.ndarray:
    one = z.dtype.type(1)
    return (z >> one) ^ (z.dtype.type(0) - (z & one))


def residual_of(
    target: np.ndarray,
    ref: np.ndarray | None,
    mode: int,
    width: int,
    negate: np.ndarray | None = None,
) -> np.ndarray:
    """The residual that :func:`combine` turns back into ``target`` given ``ref``.

    ``negate`` (ADD_DIRECTED only): per byte, which elements' differences are negated;
    width 8: 0/1 per byte; width 4: bit 0 the low nibble, bit 1 the high one.
    """
    target = np.ascontiguousarray(target, dtype=np.uint8).ravel()
    if mode == Combine.LITERAL:
        return target.copy()
    assert ref is not None and ref.size == target.size
    ref = np.ascontiguousarray(ref, dtype=np.uint8).ravel()
    if mode == Combine.XOR:
        return target ^ ref
    if width == 4:
        lo = (target - ref) & np.uint8(0x0F)
        hi = ((target >> np.uint8(4)) - (ref >> np.uint8(4))) & np.uint8(0x0F)
        if mode == Combine.ADD_DIRECTED:
            lo, hi = _negate4(lo, hi, negate)
        return _zig4(lo) | (_zig4(hi) << np.uint8(4))
    dt = _UINT[width]
    with np.errstate(over="ignore"):
        diff = target.view(dt) - ref.view(dt)
        if mode == Combine.ADD_DIRECTED:
            diff = _negate8(diff, negate, width)
        return _zigzag(diff, width).view(np.uint8)


def _negate4(
    lo: np.ndarray, hi: np.ndarray, negate: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Low / high nibbles negated mod 16 where bit 0 / bit 1 of ``negate`` is set."""
    assert negate is not None

    def neg(v: np.ndarray, flag: np.ndarray) -> np.ndarray:
        return np.where(flag.astype(bool), (np.uint8(16) - v) & np.uint8(0x0F), v)

    return neg(lo, negate & np.uint8(1)), neg(hi, (negate >> np.uint8(1)) & np.uint8(1))


def _negate8(v: np.ndarray, negate: np.ndarray | None, width: int) -> np.ndarray:
    """Bytes negated mod 256 where ``negate`` is 1 (directed ADD is int8 or int4 only)."""
    assert negate is not None and width == 8
    return np.where(negate.astype(bool), np.uint8(0) - v, v)


def _zig4(s: np.ndarray) -> np.ndarray:
    """4-bit zigzag of nibbles 0..15 read as signed -8..7."""
    neg = (s >> np.uint8(3)) & np.uint8(1)
    return ((s << np.uint8(1)) ^ (np.uint8(0) - neg)) & np.uint8(0x0F)


def _unzig4(z: np.ndarray) -> np.ndarray:
    return ((z >> np.uint8(1)) ^ (np.uint8(0) - (z & np.uint8(1)))) & np.uint8(0x0F)


def combine(
    residual: np.ndarray,
    ref: np.ndarray | None,
    mode: int,
    width: int,
    negate: np.ndarray | None = None,
) -> np.ndarray:
    """Output bytes of a DATA op chunk (``residual`` already unshuffled)."""
    if mode == Combine.LITERAL:
        return residual
    assert ref is not None
    if mode == Combine.XOR:
        return residual ^ ref
    if width == 4:
        lo = _unzig4(residual & np.uint8(0x0F))
        hi = _unzig4(residual >> np.uint8(4))
        if mode == Combine.ADD_DIRECTED:
            lo, hi = _negate4(lo, hi, negate)
        lo = (ref + lo) & np.uint8(0x0F)
        hi = ((ref >> np.uint8(4)) + hi) & np.uint8(0x0F)
        return lo | (hi << np.uint8(4))
    dt = _UINT[width]
    with np.errstate(over="ignore"):
        step = _unzigzag(residual.view(dt))
        if mode == Combine.ADD_DIRECTED:
            step = _negate8(step, negate, width)
        return (ref.view(dt) + step).view(np.uint8)


def shuffle(data: np.ndarray, elem: int) -> np.ndarray:
    """Byte planes per 2^20-byte block (``elem`` bytes per element; 1 = no-op)."""
    data = np.ascontiguousarray(data, dtype=np.uint8).ravel()
    if elem <= 1:
        return data
    out = np.empty_like(data)
    for start in range(0, data.size, SHUFFLE_BLOCK):
        block = data[start : start + SHUFFLE_BLOCK]
        out[start : start + block.size] = block.reshape(-1, elem).T.ravel()
    return out


def planes(data: np.ndarray, elem: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`shuffle` split in two: plane 0 of every block, and the other planes."""
    data = np.ascontiguousarray(data, dtype=np.uint8).ravel()
    first, rest = [], []
    for start in range(0, data.size, SHUFFLE_BLOCK):
        block = data[start : start + SHUFFLE_BLOCK].reshape(-1, elem).T
        first.append(block[0])
        rest.append(block[1:].ravel())
    return np.concatenate(first), np.concatenate(rest)


def unshuffle_block(block: np.ndarray, elem: int) -> np.ndarray:
    """Inverse of one block of :func:`shuffle`."""
    if elem <= 1:
        return block
    return np.ascontiguousarray(block.reshape(elem, -1).T).ravel()


# ------------------------------------------------------------------ sparse residuals
#
# A residual that is mostly zero (a re-quantized fine-tune moves a few percent of the
# codes) costs zstd far more than its entropy; stored as the positions (LEB128 gaps) and
# values of its non-zero bytes, zstd's entropy stage sees two dense, skewed alphabets.

_MAX_VARINT = 3  # gaps inside a 2^20-byte block are < 2^21


def _varint_bytes(values: np.ndarray) -> np.ndarray:
    """LEB128 of each value (< 2^21), concatenated."""
    v = values.astype(np.uint32)
    n = 1 + (v >= 1 << 7).astype(np.int64) + (v >= 1 << 14)
    starts = np.cumsum(n) - n
    k = np.arange(int(n.sum())) - np.repeat(starts, n)
    out = (np.repeat(v, n) >> (7 * k).astype(np.uint32)) & np.uint32(0x7F)
    out |= np.where(k < np.repeat(n, n) - 1, np.uint32(0x80), np.uint32(0))
    return out.astype(np.uint8)


def varints(buf: np.ndarray, count: int) -> np.ndarray:
    """Exactly ``count`` LEB128 values of at most 3 bytes filling ``buf`` (int64)."""
    ends = np.flatnonzero(buf < 0x80)
    if ends.size != count or (count and ends[-1] != buf.size - 1) or (not count and buf.size):
        raise CorruptDeltaError("sparse residual: gap list does not hold its count")
    if not count:
        return np.empty(0, np.int64)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lens = ends - starts + 1
    if int(lens.max()) > _MAX_VARINT:
        raise CorruptDeltaError("sparse residual: gap too long")
    k = np.arange(buf.size) - np.repeat(starts, lens)
    parts = (buf.astype(np.int64) & 0x7F) << (7 * k)
    return np.add.reduceat(parts, starts)


def sparsify(residual: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(positions, values)``: per 2^20-byte block, positions get a u32 count, u32 gap
    bytes and the gaps; values get the block's non-zero bytes."""
    residual = np.ascontiguousarray(residual, dtype=np.uint8).ravel()
    heads: list[np.ndarray] = []
    values: list[np.ndarray] = []
    for start in range(0, max(residual.size, 1), SHUFFLE_BLOCK):
        block = residual[start : start + SHUFFLE_BLOCK]
        pos = np.flatnonzero(block)
        gap_bytes = _varint_bytes(np.diff(pos, prepend=-1) - 1)
        heads += [np.array([pos.size, gap_bytes.size], "<u4").view(np.uint8), gap_bytes]
        values.append(block[pos])
    return np.concatenate(heads), np.concatenate(values)


def sparse_block(read_positions, read_values, length: int) -> np.ndarray:
    """One block (``length`` residual bytes) of :func:`sparsify` output, pulled from the
    two ``read(n) -> bytes`` callables; every count and position is checked before use."""
    head = np.frombuffer(read_positions(SPARSE_BLOCK_HEADER), "<u4")
    count, gap_len = int(head[0]), int(head[1])
    if count > length or not count <= gap_len <= _MAX_VARINT * count:
        raise CorruptDeltaError("sparse residual: impossible block counts")
    pos = np.cumsum(varints(np.frombuffer(read_positions(gap_len), np.uint8), count) + 1) - 1
    values = np.frombuffer(read_values(count), np.uint8)
    if count and (int(pos[-1]) >= length or not values.all()):
        raise CorruptDeltaError("sparse residual: position out of range or zero value")
    out = np.zeros(length, np.uint8)
    out[pos] = values
    return out

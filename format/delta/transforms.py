"""Residual transforms of DATA ops (spec/DELTA.md section 4), both directions.

``residual_of`` (used by the creator) and ``combine`` (used by the patcher) are exact
inverses on any bytes; both work on chunks, so a patcher never holds a whole part.
Arrays are 1-D uint8; element widths are in bits (4 = nibbles, low nibble first).
"""

from __future__ import annotations

import numpy as np

from .container import SHUFFLE_BLOCK, Combine

__all__ = ["combine", "residual_of", "shuffle", "unshuffle_block"]

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


def residual_of(target: np.ndarray, ref: np.ndarray | None, mode: int, width: int) -> np.ndarray:
    """The residual that :func:`combine` turns back into ``target`` given ``ref``."""
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
        return _zig4(lo) | (_zig4(hi) << np.uint8(4))
    dt = _UINT[width]
    with np.errstate(over="ignore"):
        diff = target.view(dt) - ref.view(dt)
        return _zigzag(diff, width).view(np.uint8)


def _zig4(s: np.ndarray) -> np.ndarray:
    """4-bit zigzag of nibbles 0..15 read as signed -8..7."""
    neg = (s >> np.uint8(3)) & np.uint8(1)
    return ((s << np.uint8(1)) ^ (np.uint8(0) - neg)) & np.uint8(0x0F)


def _unzig4(z: np.ndarray) -> np.ndarray:
    return ((z >> np.uint8(1)) ^ (np.uint8(0) - (z & np.uint8(1)))) & np.uint8(0x0F)


def combine(residual: np.ndarray, ref: np.ndarray | None, mode: int, width: int) -> np.ndarray:
    """Output bytes of a DATA op chunk (``residual`` already unshuffled)."""
    if mode == Combine.LITERAL:
        return residual
    assert ref is not None
    if mode == Combine.XOR:
        return residual ^ ref
    if width == 4:
        lo = (ref + _unzig4(residual & np.uint8(0x0F))) & np.uint8(0x0F)
        hi = ((ref >> np.uint8(4)) + _unzig4(residual >> np.uint8(4))) & np.uint8(0x0F)
        return lo | (hi << np.uint8(4))
    dt = _UINT[width]
    with np.errstate(over="ignore"):
        return (ref.view(dt) + _unzigzag(residual.view(dt))).view(np.uint8)


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


def unshuffle_block(block: np.ndarray, elem: int) -> np.ndarray:
    """Inverse of one block of :func:`shuffle`."""
    if elem <= 1:
        return block
    return np.ascontiguousarray(block.reshape(elem, -1).T).ravel()

"""Predictions of PREDICTED references (spec/DELTA.md section 4), row block by row block.

The creator and the patcher run this same code, so a prediction only has to be
deterministic, not exact: the residual corrects any difference and the final SHA-256
proves the result. It never raises on strange values (non-finite inputs become 0,
float16 overflow gives infinities): a hostile base or delta yields a wrong output that
the hash check refuses, never a crash. Formulas follow edgepack.format.codecs.
"""

from __future__ import annotations

import numpy as np

from edgepack.format import codecs
from edgepack.format.encodings import Encoding
from edgepack.format.layout import tensor_layout

from .container import Part

__all__ = [
    "BaseRows",
    "Factors",
    "predict_codes",
    "predict_codes_directed",
    "predict_part",
    "row_bytes",
]

_F32 = np.float32


def row_bytes(encoding: int, cols: int, group_size: int) -> tuple[int, int, int]:
    """Bytes per row of (codes, scales, zeros) of a ``[*, cols]`` tensor."""
    layout = tensor_layout(Encoding(encoding), (1, cols), group_size)
    return tuple(
        p.nbytes if p is not None else 0 for p in (layout.codes, layout.scales, layout.zeros)
    )


class Factors:
    """A FACTORS op's low-rank correction ``L`` (spec section 4.1), by row block.

    The integer products are summed in float64, where every partial sum of int8 products
    is an exact integer whatever the summation order, so BLAS may be used and the result
    is still bit-identical everywhere.
    """

    def __init__(self, raw: bytes, rows: int, cols: int, rank: int) -> None:
        pos = 0

        def take(dtype: str, count: int) -> np.ndarray:
            nonlocal pos
            arr = np.frombuffer(raw, dtype, count, pos)
            pos += arr.nbytes
            return arr

        self.su = take("<f2", rows).astype(_F32)
        self.u = take("i1", rows * rank).reshape(rows, rank)
        self.sv = take("<f2", cols).astype(_F32)
        self.v = take("i1", rank * cols).reshape(rank, cols)

    def block(self, r0: int, r1: int) -> np.ndarray:
        dot = (self.u[r0:r1].astype(np.float64) @ self.v.astype(np.float64)).astype(_F32)
        with np.errstate(all="ignore"):
            return (dot * self.su[r0:r1, None]) * self.sv[None, :]


class BaseRows:
    """Dequantizes row blocks of a base tensor given a ``read(offset, length)`` callable."""

    def __init__(self, read, encoding: int, cols: int, group_size: int, offsets) -> None:
        self.read = read
        self.encoding = Encoding(encoding)
        self.cols = cols
        self.group_size = group_size
        self.offsets = offsets
        self.layout = tensor_layout(self.encoding, (1, cols), group_size)
        self.per_row = row_bytes(encoding, cols, group_size)

    def _part(self, k: int, r0: int, r1: int) -> np.ndarray | None:
        part = (self.layout.codes, self.layout.scales, self.layout.zeros)[k]
        if part is None:
            return None
        n = self.per_row[k]
        raw = self.read(self.offsets[k] + r0 * n, (r1 - r0) * n)
        return np.frombuffer(raw, part.dtype).reshape((r1 - r0, *part.shape[1:]))

    def dequantize(self, r0: int, r1: int, factors: Factors | None = None) -> np.ndarray:
        """Rows ``r0:r1`` of the base tensor as float32 (plus the correction, if any)."""
        with np.errstate(all="ignore"):
            parts = (self._part(k, r0, r1) for k in range(3))
            w = codecs.dequantize(self.encoding, *parts, self.group_size)
            w = np.ascontiguousarray(w, dtype=_F32).reshape(r1 - r0, self.cols)
            w[~np.isfinite(w)] = 0
            if factors is not None:
                w += factors.block(r0, r1)
                w[~np.isfinite(w)] = 0
        return w


def predict_part(w: np.ndarray, encoding: int, group_size: int, part: int) -> np.ndarray:
    """Scales (part 1) or zeros (part 2) the target encoder computes from ``w``, as bytes."""
    enc = Encoding(encoding)
    rows = w.shape[0]
    with np.errstate(all="ignore"):
        if not enc.is_group:  # int8 per channel
            d = np.abs(w).max(axis=1) / _F32(127)
            return d.astype("<f4").view(np.uint8).ravel()
        grp = w.reshape(rows, -1, group_size)
        if enc.is_symmetric:
            idx = np.abs(grp).argmax(axis=-1)
            peak = np.take_along_axis(grp, idx[..., None], axis=-1)[..., 0]
            out = (peak / _F32(-(1 << (enc.bits - 1)))).astype(np.float16)
        else:
            lo = grp.min(axis=-1) + _F32(0)
            if part == Part.ZEROS:
                out = lo.astype(np.float16)
            else:
                hi = grp.max(axis=-1) + _F32(0)
                out = ((hi - lo) / _F32((1 << enc.bits) - 1)).astype(np.float16)
    return np.ascontiguousarray(out, dtype="<f2").view(np.uint8).ravel()


def _reciprocal(d: np.ndarray) -> np.ndarray:
    return np.divide(_F32(1), d, out=np.zeros_like(d), where=d != 0)


def predict_codes(
    w: np.ndarray, encoding: int, group_size: int, scales: bytes, zeros: bytes | None
) -> np.ndarray:
    """``w`` re-quantized with the target's actual scales (and zeros), as code bytes."""
    return _requantize(w, encoding, group_size, scales, zeros, False)[0]


def predict_codes_directed(
    w: np.ndarray, encoding: int, group_size: int, scales: bytes, zeros: bytes | None
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`predict_codes` plus ``negate``, marking per code byte the codes that were
    rounded up (``rint(x) > x``; int8: 0/1, packed int4: bit 0 for the low nibble, bit 1
    for the high one). A value just below a rounding boundary that the update pushes
    across moves its code up, one just above moves it down: negating the residual where
    the prediction rounded up turns both into +1 (ADD_DIRECTED)."""
    codes, up = _requantize(w, encoding, group_size, scales, zeros, True)
    assert up is not None
    return codes, up


def _requantize(
    w: np.ndarray,
    encoding: int,
    group_size: int,
    scales: bytes,
    zeros: bytes | None,
    directions: bool,
) -> tuple[np.ndarray, np.ndarray | None]:
    enc = Encoding(encoding)
    rows, cols = w.shape
    with np.errstate(all="ignore"):
        if not enc.is_group:  # int8 per channel
            d = np.frombuffer(scales, "<f4").astype(_F32)
            x = w * _reciprocal(d)[:, None]
            lo, hi, offset = -127, 127, 0
        else:
            d = np.frombuffer(scales, "<f2").astype(_F32).reshape(rows, -1)
            grp = w.reshape(rows, -1, group_size)
            half = 1 << (enc.bits - 1)
            if enc.is_symmetric:
                x = grp * _reciprocal(d)[..., None]
                lo, hi, offset = -half, half - 1, half
            else:
                z = np.frombuffer(zeros, "<f2").astype(_F32).reshape(rows, -1)
                x = (grp - z[..., None]) * _reciprocal(d)[..., None]
                lo, hi, offset = 0, 2 * half - 1, 0
        up = None
        if directions:
            r = np.rint(x)
            up = (r > x).reshape(rows, cols).astype(np.uint8)  # NaN is not rounded up
            x = r
        else:
            np.rint(x, out=x)
        np.clip(x, lo, hi, out=x)
        x[np.isnan(x)] = 0
        if not enc.is_group:
            return x.astype(np.int8).view(np.uint8).ravel(), (
                up.ravel() if up is not None else None
            )
        q = (x.reshape(rows, cols) + offset).astype(np.uint8)
    codes = (q[:, 0::2] | (q[:, 1::2] << np.uint8(4))).ravel()
    if up is None:
        return codes, None
    return codes, (up[:, 0::2] | (up[:, 1::2] << np.uint8(1))).ravel()

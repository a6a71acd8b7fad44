"""Reference weight quantizers: the normative definition of edgepack's tensor encodings.

A quantized tensor is viewed as a 2-D ``[R, C]`` float32 matrix (``R = shape[0]``,
``C = prod(shape[1:])``, one row per output channel).  Every step below is float32
arithmetic with round-half-to-even, so any other implementation (the native kernels)
must reproduce these outputs bit for bit.  Native code is tested against this module.

* int8 per channel:  ``d = max|w| / 127``, ``q = clip(rint(w / d), -127, 127)``.
* int4 symmetric (group ``g``):  ``d = f16(w[argmax|w|] / -8)``,
  ``nibble = clip(rint(w / d), -8, 7) + 8``.
* int4 asymmetric (group ``g``):  ``d = f16((max - min) / 15)``, ``m = f16(min)``,
  ``nibble = clip(rint((w - m) / d), 0, 15)``.
* int3 / int2 (any ``b`` in 4, 3, 2 bits, :func:`quantize_group`): the int4 rules with
  ``h = 2^(b-1)``: symmetric ``d = f16(w[argmax|w|] / -h)``,
  ``code = clip(rint(w / d), -h, h - 1) + h``; asymmetric ``d = f16((max - min) / (2^b - 1))``,
  ``m = f16(min)``, ``code = clip(rint((w - m) / d), 0, 2^b - 1)``.  int4 is the ``b = 4`` case.

Division by the scale is a multiply by ``inv = 1/d`` (``0`` when ``d == 0``).  A product
``0 * inf`` (a zero weight in an int8 row whose scale is so small that ``1/d`` overflows)
is defined to quantize to ``0``.  Signed zeros of ``min``/``max`` are canonicalised to
``+0`` so the stored ``mins``/``scales`` bits do not depend on reduction order.
Nibbles are packed two per byte, even element in the low nibble.  3-bit codes: element
``i`` of a row occupies bits ``[3i, 3i+3)`` of the row's little-endian bit stream (8 codes in
3 bytes).  2-bit codes: element ``4k+j`` is bits ``2j..2j+1`` of byte ``k``.

Inputs must be finite and every float16 scale/min representable, otherwise
:class:`~edgepack.format.errors.EncodingError` is raised.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from edgepack.format.constants import MAX_GROUP_SIZE as _MAX_GROUP
from edgepack.format.constants import MIN_GROUP_SIZE as _MIN_GROUP
from edgepack.format.encodings import REGISTRY, Encoding, Family
from edgepack.format.errors import EncodingError
from edgepack.format.layout import S8_ROW_BYTES

__all__ = [
    "GROUP_BITS",
    "S8_MAX",
    "S8_ROW_BYTES",
    "dequantize",
    "dequantize_group",
    "dequantize_int4_group",
    "dequantize_int8_channel",
    "expand_s8",
    "group_values",
    "pack_codes",
    "pack_nibbles",
    "quantize_group",
    "quantize_int4_group",
    "quantize_int8_channel",
    "s8_multipliers",
    "snap_s8",
    "unpack_codes",
    "unpack_nibbles",
]

GROUP_BITS = tuple(dict.fromkeys(r.bits for r in REGISTRY if r.is_group))  # (4, 3, 2)
S8_MAX = 127  # *_S8 group scales: int8 codes in [-127, 127] times a float32 per row

# Rows are processed in chunks of about this many elements so temporaries stay small.
_CHUNK_ELEMS = 1 << 18

_F32 = np.float32
_ONE = _F32(1.0)
_ZERO = _F32(0.0)


def _as_matrix(w: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    """Return ``w`` as a C-contiguous float32 ``[R, C]`` view plus its original shape."""
    a = np.asarray(w)
    if a.dtype.kind != "f":
        raise EncodingError(f"cannot encode tensor of dtype {a.dtype}: a float dtype is required")
    if a.ndim < 2:
        raise EncodingError(f"cannot encode a {a.ndim}-D tensor: at least 2 dimensions needed")
    if a.size == 0:
        raise EncodingError(f"cannot encode empty tensor of shape {a.shape}")
    with np.errstate(over="ignore"):  # f64 beyond f32 range becomes inf, reported below
        m = np.ascontiguousarray(a, dtype=_F32).reshape(a.shape[0], -1)
    return m, a.shape


def _row_blocks(rows: int, cols: int) -> Iterator[tuple[int, int]]:
    """Yield ``(r0, r1)`` row ranges of about ``_CHUNK_ELEMS`` elements each."""
    step = max(1, _CHUNK_ELEMS // max(cols, 1))
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def _raise_first_error(
    block: np.ndarray,
    row0: int,
    shape: tuple[int, ...],
    f16: tuple[tuple[str, np.ndarray], ...] = (),
    bits: int = 4,
) -> None:
    """Raise for the first bad row of ``block``, if any.

    Within a row a non-finite weight wins over a float16 overflow; within a group the
    scale is checked before the min.  The native kernels report errors in the same order.
    """
    bad = ~np.isfinite(block)
    bad_rows = bad.any(axis=1)
    over = np.zeros(block.shape[0], dtype=bool)
    for _, values in f16:
        over |= np.isinf(values).any(axis=1)
    if not (bad_rows.any() or over.any()):
        return
    r = int(np.argmax(bad_rows | over))
    if bad_rows[r]:
        c = int(np.argmax(bad[r]))
        value = float(block[r, c])
        flat = (row0 + r) * block.shape[1] + c
        index = tuple(int(i) for i in np.unravel_index(flat, shape))
        raise EncodingError(f"cannot encode tensor: non-finite value ({value}) at index {index}")
    hits = np.zeros(f16[0][1].shape[1], dtype=bool)
    for _, values in f16:
        hits |= np.isinf(values[r])
    grp = int(np.argmax(hits))
    what = next(name for name, values in f16 if np.isinf(values[r, grp]))
    raise EncodingError(
        f"cannot encode tensor: float16 {what} overflows in row {row0 + r}, "
        f"group {grp} (weights too large for int{bits})"
    )


def _check_group(cols: int, group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)):
        raise EncodingError(f"group size must be an int, got {group_size!r}")
    g = int(group_size)
    if g < _MIN_GROUP or g > _MAX_GROUP or g % 8:
        raise EncodingError(
            f"group size {g} invalid: must be a multiple of 8 in [{_MIN_GROUP}, {_MAX_GROUP}]"
        )
    if cols % g:
        raise EncodingError(f"row length {cols} is not a multiple of the group size {g}")


def _reciprocal(d: np.ndarray) -> np.ndarray:
    """``1/d`` where ``d != 0``, else ``0`` (float32; may be ``inf`` for subnormal ``d``)."""
    return np.divide(_ONE, d, out=np.zeros_like(d), where=d != 0)


def quantize_int8_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 with one float32 scale per row; returns ``(codes[R, C], scales[R])``."""
    m, shape = _as_matrix(w)
    rows, cols = m.shape
    codes = np.empty((rows, cols), np.int8)
    scales = np.empty(rows, _F32)
    with np.errstate(all="ignore"):
        for r0, r1 in _row_blocks(rows, cols):
            blk = m[r0:r1]
            _raise_first_error(blk, r0, shape)
            d = np.abs(blk).max(axis=1) / _F32(127)
            inv = _reciprocal(d)
            x = blk * inv[:, None]
            np.rint(x, out=x)
            np.clip(x, -127, 127, out=x)
            if np.isinf(inv).any():  # 0 * inf -> nan: a zero weight encodes as 0
                x[np.isnan(x)] = 0
            codes[r0:r1] = x
            scales[r0:r1] = d
    return codes, scales


def dequantize_int8_channel(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Inverse of :func:`quantize_int8_channel`: ``codes * scales[:, None]`` as float32."""
    codes = np.asarray(codes)
    scales = np.asarray(scales)
    if codes.dtype != np.int8 or codes.ndim != 2:
        raise EncodingError(f"int8 codes must be a 2-D int8 array, got {codes.dtype} {codes.shape}")
    if scales.dtype != _F32 or scales.shape != (codes.shape[0],):
        raise EncodingError(
            f"int8 scales must be float32 of shape ({codes.shape[0]},), "
            f"got {scales.dtype} {scales.shape}"
        )
    return codes.astype(_F32) * scales[:, None]


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Pack uint8 values 0..15 two per byte along the last axis (even index -> low nibble)."""
    q = np.asarray(q)
    if q.dtype != np.uint8 or q.ndim < 1 or q.shape[-1] % 2:
        raise EncodingError(
            f"nibbles must be uint8 with an even last dimension, got {q.dtype} {q.shape}"
        )
    if q.size and int(q.max()) > 15:
        raise EncodingError("nibble values must be in 0..15")
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_nibbles`: ``[..., n]`` bytes -> ``[..., 2n]`` values 0..15."""
    codes = np.asarray(codes)
    if codes.dtype != np.uint8 or codes.ndim < 1:
        raise EncodingError(f"packed nibbles must be uint8, got {codes.dtype} {codes.shape}")
    out = np.empty((*codes.shape[:-1], codes.shape[-1] * 2), np.uint8)
    out[..., 0::2] = codes & 0x0F
    out[..., 1::2] = codes >> 4
    return out


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or bits not in GROUP_BITS:
        raise EncodingError(f"group codes have 4, 3 or 2 bits, got {bits!r}")
    return int(bits)


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack uint8 codes of ``bits`` (4, 3, 2) bits along the last axis, little-endian bit order.

    The last dimension must hold whole bytes' worth of codes (even for 4 bits, a multiple of
    8 for 3 bits, of 4 for 2 bits); returns ``[..., n * bits / 8]`` bytes.
    """
    bits = _check_bits(bits)
    if bits == 4:
        return pack_nibbles(q)
    q = np.asarray(q)
    per = 8 if bits == 3 else 4
    if q.dtype != np.uint8 or q.ndim < 1 or q.shape[-1] % per:
        raise EncodingError(
            f"{bits}-bit codes must be uint8 with a last dimension divisible by {per}, "
            f"got {q.dtype} {q.shape}"
        )
    if q.size and int(q.max()) >= 1 << bits:
        raise EncodingError(f"{bits}-bit code values must be in 0..{(1 << bits) - 1}")
    lead, n = q.shape[:-1], q.shape[-1]
    if bits == 2:
        g = q.reshape(*lead, n // 4, 4)
        out = g[..., 0] | (g[..., 1] << 2) | (g[..., 2] << 4) | (g[..., 3] << 6)
        return out.reshape(*lead, n // 4)
    g = q.reshape(*lead, n // 8, 8).astype(np.uint32)
    word = g[..., 0].copy()
    for j in range(1, 8):
        word |= g[..., j] << np.uint32(3 * j)
    out = np.empty((*lead, n // 8, 3), np.uint8)
    out[..., 0] = word & 0xFF
    out[..., 1] = (word >> 8) & 0xFF
    out[..., 2] = word >> 16
    return out.reshape(*lead, n * 3 // 8)


def unpack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_codes`: ``[..., m]`` bytes -> ``[..., m * 8 / bits]`` codes."""
    bits = _check_bits(bits)
    if bits == 4:
        return unpack_nibbles(codes)
    codes = np.asarray(codes)
    if codes.dtype != np.uint8 or codes.ndim < 1 or (bits == 3 and codes.shape[-1] % 3):
        raise EncodingError(
            f"packed {bits}-bit codes must be uint8, got {codes.dtype} {codes.shape}"
        )
    lead, m = codes.shape[:-1], codes.shape[-1]
    if bits == 2:
        out = np.empty((*lead, m, 4), np.uint8)
        for j in range(4):
            np.right_shift(codes, 2 * j, out=out[..., j])
            out[..., j] &= 3
        return out.reshape(*lead, m * 4)
    b = codes.reshape(*lead, m // 3, 3).astype(np.uint32)
    word = b[..., 0] | (b[..., 1] << np.uint32(8)) | (b[..., 2] << np.uint32(16))
    out = np.empty((*lead, m // 3, 8), np.uint8)
    for j in range(8):
        out[..., j] = (word >> np.uint32(3 * j)) & 7
    return out.reshape(*lead, m // 3 * 8)


def quantize_group(
    w: np.ndarray, bits: int, group_size: int, symmetric: bool, scale_bits: int = 16
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Group-wise ``bits``-bit codes (4, 3, 2); returns ``(codes, scales, mins | None)``.

    ``codes``: uint8 ``[R, C * bits / 8]`` packed (:func:`pack_codes`); ``scales``: float16
    ``[R, C/g]``; ``mins`` (same shape) only for the asymmetric form. With
    ``scale_bits=8`` (the ``*_S8`` encodings) scales and mins are stored parts of
    :func:`snap_s8` (uint8 ``[R, 4 + C/g]``) and the codes are computed against the
    float16 values those parts decode to.
    """
    bits = _check_bits(bits)
    if scale_bits not in (16, 8):
        raise EncodingError(f"group scales have 16 or 8 bits, got {scale_bits!r}")
    m, shape = _as_matrix(w)
    rows, cols = m.shape
    _check_group(cols, group_size)
    g = int(group_size)
    ngroups = cols // g
    half = 1 << (bits - 1)
    top = (1 << bits) - 1
    s8 = scale_bits == 8
    codes = np.empty((rows, cols * bits // 8), np.uint8)
    pshape = (rows, S8_ROW_BYTES + ngroups) if s8 else (rows, ngroups)
    pdtype = np.uint8 if s8 else np.float16
    scales = np.empty(pshape, pdtype)
    mins = None if symmetric else np.empty(pshape, pdtype)
    with np.errstate(all="ignore"):
        for r0, r1 in _row_blocks(rows, cols):
            blk = m[r0:r1]
            grp = blk.reshape(blk.shape[0], ngroups, g)
            if symmetric:
                idx = np.abs(grp).argmax(axis=-1)
                peak = np.take_along_axis(grp, idx[..., None], axis=-1)[..., 0]
                d32 = peak / _F32(-half)
                if s8:
                    _raise_first_error(blk, r0, shape, (("scale", d32.astype(np.float16)),), bits)
                    scales[r0:r1], d16 = snap_s8(d32)
                else:
                    d16 = d32.astype(np.float16)
                    _raise_first_error(blk, r0, shape, (("scale", d16),), bits)
                    scales[r0:r1] = d16
                d = d16.astype(_F32)
                x = grp * _reciprocal(d)[..., None]
                np.rint(x, out=x)
                np.clip(x, -half, half - 1, out=x)
                x += half
            else:
                lo = grp.min(axis=-1) + _ZERO  # + 0 turns -0 into +0
                hi = grp.max(axis=-1) + _ZERO
                d32 = (hi - lo) / _F32(top)
                f16 = (("scale", d32.astype(np.float16)), ("min", lo.astype(np.float16)))
                _raise_first_error(blk, r0, shape, f16, bits)
                if s8:
                    scales[r0:r1], d16 = snap_s8(d32)
                    mins[r0:r1], m16 = snap_s8(lo)
                else:
                    d16, m16 = f16[0][1], f16[1][1]
                    scales[r0:r1], mins[r0:r1] = d16, m16
                d = d16.astype(_F32)
                x = grp - m16.astype(_F32)[..., None]
                x *= _reciprocal(d)[..., None]
                np.rint(x, out=x)
                np.clip(x, 0, top, out=x)
            codes[r0:r1] = pack_codes(x.astype(np.uint8).reshape(blk.shape[0], cols), bits)
    return codes, scales, mins


def snap_s8(
    values: np.ndarray, multipliers: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The ``*_S8`` form of per-group float32 ``values [R, G]``: ``(part, decoded)``.

    Per row ``a = max|v| / 127`` (float32; or the given ``multipliers``) and
    ``q = clamp(rint(v * (1/a)), -127, 127)``; ``part`` is uint8 ``[R, 4 + G]`` (``a`` as
    little-endian float32, then ``q`` as int8) and ``decoded`` the float16 values
    :func:`expand_s8` gives for it.
    """
    v = np.ascontiguousarray(values, _F32)
    if v.ndim != 2:
        raise EncodingError(f"group values must be 2-D, got shape {v.shape}")
    with np.errstate(all="ignore"):
        if multipliers is None:
            a = np.abs(v).max(axis=1, initial=_ZERO) / _F32(S8_MAX)
        else:
            a = np.ascontiguousarray(multipliers, _F32).reshape(v.shape[0])
        q = v * _reciprocal(a)[:, None]
        np.rint(q, out=q)
        np.clip(q, -S8_MAX, S8_MAX, out=q)
        q[np.isnan(q)] = 0
    part = np.empty((v.shape[0], S8_ROW_BYTES + v.shape[1]), np.uint8)
    part[:, :S8_ROW_BYTES] = a.astype("<f4").view(np.uint8).reshape(-1, S8_ROW_BYTES)
    part[:, S8_ROW_BYTES:] = q.astype(np.int8).view(np.uint8)
    return part, expand_s8(part)


def expand_s8(part: np.ndarray) -> np.ndarray:
    """float16 group values ``f16(a_r * q[r, j])`` of a stored ``*_S8`` scales/zeros part
    (uint8 ``[R, 4 + G]``); raises EncodingError if a value is not a finite binary16."""
    p = np.asarray(part)
    if p.dtype != np.uint8 or p.ndim != 2 or p.shape[1] < S8_ROW_BYTES:
        raise EncodingError(f"8-bit group scales must be uint8 [R, 4 + G], got {p.dtype} {p.shape}")
    a = s8_multipliers(p)
    q = p[:, S8_ROW_BYTES:].view(np.int8).astype(_F32)
    with np.errstate(all="ignore"):
        out = (q * a[:, None]).astype(np.float16)
    bad = ~np.isfinite(a) | ~np.isfinite(out).all(axis=1)
    if bad.any():
        row = int(np.argmax(bad))
        raise EncodingError(f"8-bit group scales of row {row} do not decode to finite binary16")
    return out


def group_values(
    encoding: Encoding, scales: np.ndarray, zeros: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """float16 ``(scales, mins)`` ``[R, C/g]`` of stored group parts, whatever the scale
    width: ``*_S8`` parts are expanded (:func:`expand_s8`), binary16 ones returned as is."""
    if encoding.scale_bits != 8:
        return scales, zeros
    return expand_s8(scales), None if zeros is None else expand_s8(zeros)


def dequantize(
    encoding: Encoding,
    codes: np.ndarray,
    scales: np.ndarray | None = None,
    zeros: np.ndarray | None = None,
    group_size: int = 0,
) -> np.ndarray:
    """float32 values of a tensor's stored parts, in any encoding but LOW_RANK: the one
    decoder the reader, the runtime's embedding lookup and the delta predictor share.

    Floats keep the shape of ``codes`` (bfloat16 given as raw uint16); integer encodings
    give ``[R, C]``. ``*_S8`` parts are expanded (:func:`group_values`) first.
    """
    rec = Encoding(encoding).info
    if rec.is_float:
        if rec.encoding == Encoding.BF16:  # the upper half of a float32
            return (np.asarray(codes).astype(np.uint32) << 16).view(_F32)
        return np.asarray(codes).astype(_F32)
    if rec.family is Family.CHANNEL:
        return dequantize_int8_channel(codes, scales)
    if rec.is_group:
        scales, zeros = group_values(rec.encoding, scales, zeros)
        return dequantize_group(codes, scales, zeros, rec.bits, group_size)
    raise EncodingError(f"{rec.name} stores no parts to dequantize (decode its factors)")


def s8_multipliers(part: np.ndarray) -> np.ndarray:
    """The float32 row multipliers of a stored ``*_S8`` part (uint8 ``[R, 4 + G]``)."""
    return np.ascontiguousarray(part[:, :S8_ROW_BYTES]).view("<f4").reshape(-1).astype(_F32)


def dequantize_group(
    codes: np.ndarray,
    scales: np.ndarray,
    mins: np.ndarray | None,
    bits: int,
    group_size: int,
) -> np.ndarray:
    """Inverse of :func:`quantize_group`; returns float32 ``[R, C]``.

    Symmetric: ``(code - 2^(b-1)) * d``.  Asymmetric: ``code * d + m`` (two roundings).
    """
    bits = _check_bits(bits)
    codes = np.asarray(codes)
    scales = np.asarray(scales)
    if codes.dtype != np.uint8 or codes.ndim != 2 or (codes.shape[1] * 8) % bits:
        raise EncodingError(
            f"int{bits} codes must be a 2-D uint8 array, got {codes.dtype} {codes.shape}"
        )
    rows, cols = codes.shape[0], codes.shape[1] * 8 // bits
    _check_group(cols, group_size)
    g = int(group_size)
    ngroups = cols // g
    if scales.dtype != np.float16 or scales.shape != (rows, ngroups):
        raise EncodingError(
            f"int{bits} scales must be float16 of shape {(rows, ngroups)}, "
            f"got {scales.dtype} {scales.shape}"
        )
    if mins is not None:
        mins = np.asarray(mins)
        if mins.dtype != np.float16 or mins.shape != (rows, ngroups):
            raise EncodingError(
                f"int{bits} mins must be float16 of shape {(rows, ngroups)}, "
                f"got {mins.dtype} {mins.shape}"
            )
    half = _F32(1 << (bits - 1))
    out = np.empty((rows, cols), _F32)
    with np.errstate(all="ignore"):
        for r0, r1 in _row_blocks(rows, cols):
            q = unpack_codes(codes[r0:r1], bits).astype(_F32).reshape(r1 - r0, ngroups, g)
            d = scales[r0:r1].astype(_F32)[..., None]
            if mins is None:
                q -= half
                q *= d
            else:
                q *= d
                q += mins[r0:r1].astype(_F32)[..., None]
            out[r0:r1] = q.reshape(r1 - r0, cols)
    return out


def quantize_int4_group(
    w: np.ndarray, group_size: int, symmetric: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Group-wise int4; returns ``(codes[R, C/2] uint8, scales[R, C/g] f16, mins | None)``.

    ``mins`` (float16, same shape as ``scales``) is only produced for the asymmetric form.
    The ``bits = 4`` case of :func:`quantize_group`.
    """
    return quantize_group(w, 4, group_size, symmetric)


def dequantize_int4_group(
    codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, group_size: int
) -> np.ndarray:
    """Inverse of :func:`quantize_int4_group`; returns float32 ``[R, C]``.

    Symmetric: ``(nibble - 8) * d``.  Asymmetric: ``nibble * d + m`` (two roundings).
    """
    return dequantize_group(codes, scales, mins, 4, group_size)

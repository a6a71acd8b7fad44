"""KV cache V codecs of the numpy reference shared with the native kernels' numerics
(native/src/infer/generic.h): the int6 one of layout ``"int8"`` and the rounding every V
codec uses."""

from __future__ import annotations

import numpy as np

__all__ = ["codes_of", "quantize_v6", "v6_scale"]

_F32 = np.float32


def codes_of(xg: np.ndarray, d: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``clip(rint(x * (1/d)), lo, hi)`` per group of the last axis (``1/0`` taken as 0,
    NaN codes as 0), float32."""
    inv = np.divide(_F32(1), d, out=np.zeros_like(d), where=d != 0)
    q = xg * inv[..., None]
    np.rint(q, out=q)
    np.clip(q, lo, hi, out=q)
    return np.nan_to_num(q, nan=0.0)


def v6_scale(code: np.ndarray) -> np.ndarray:
    """The float32 value of int6-V scale bytes (e5m3: the float16 whose bits are code << 7)."""
    return (code.astype(np.uint16) << 7).view(np.float16).astype(_F32)


def quantize_v6(
    v: np.ndarray, group: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """int6 symmetric per group: ``d = f16(absmax/31)`` rounded up to its top 8 magnitude
    bits (one byte; 248 and above overflow), ``c = clip(rint(v * (1/d)), -31, 31) + 32``.
    Returns the nibble plane, the 2-bit plane of bits 4-5, scale bytes, all finite."""
    t, h, dim = v.shape
    vg = v.reshape(t, h, dim // group, group)
    with np.errstate(all="ignore"):
        absmax = np.abs(vg).max(axis=-1)
        h16 = (absmax / _F32(31)).astype(np.float16).view(np.uint16).astype(np.uint32)
        code = (h16 + 127) >> 7
        ok = bool(np.isfinite(v).all() and (code < 248).all())
        code = np.minimum(code, 247).astype(np.uint8)
        c = codes_of(vg, v6_scale(code), -31, 31)
    codes = (c + 32).astype(np.uint8).reshape(t, h, dim)
    packed = (codes[..., 0::2] & 0x0F) | ((codes[..., 1::2] & 0x0F) << 4)
    top = codes >> 4
    high = top[..., 0::4] | (top[..., 1::4] << 2) | (top[..., 2::4] << 4) | (top[..., 3::4] << 6)
    return packed, high, code, ok

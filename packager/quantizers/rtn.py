"""Round-to-nearest on the format's grids, with the codec's scales or searched ones.

Everything here produces exactly what :mod:`edgepack.format.codecs` decodes: codes are
computed with the codec's arithmetic (float32, multiply by ``1/d``, round half to even,
clip) from float16 scales/mins, and :func:`dequantize_codes` is bit-identical to
:func:`~edgepack.format.codecs.dequantize_group`. With ``search=False`` the result is
byte-identical to ``encode_tensor`` (the codec's own scale rule).

``search=True`` picks each group's scale (and min) from a small grid of clipped ranges,
both orientations of the symmetric grid, plus one weighted least-squares refit, minimising
``sum_j h_j (w_j - w'_j)^2`` with ``h`` the input channels' second moments (the diagonal
of the calibration Hessian, as llama.cpp's imatrix does); ``h = 1`` without calibration.
"""

from __future__ import annotations

import numpy as np

from edgepack.format import Encoding, codecs
from edgepack.format.errors import EncodingError

from ..encode import EncodedTensor, EncodingChoice, encode_tensor

__all__ = [
    "GroupParams",
    "codec_params",
    "dequantize_codes",
    "embedding_weights",
    "encode_codes",
    "quantize_codes",
    "rtn_quantize",
    "search_params",
]

_F32 = np.float32
_SYM_SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
_ASYM_SHRINK = (0.0, 0.05, 0.1)
_SEARCH_ROWS = 4096  # rows searched at a time


class GroupParams:
    """Float16 scales ``d`` and mins ``z`` (None: symmetric) of ``[R, C/g]`` groups; for
    the ``*_S8`` encodings also their stored 8-bit parts (``d_part``, ``z_part``), of
    which ``d``/``z`` are the decoded values."""

    __slots__ = ("bits", "d", "d_part", "g", "z", "z_part")

    def __init__(
        self,
        d: np.ndarray,
        z: np.ndarray | None,
        bits: int,
        g: int,
        d_part: np.ndarray | None = None,
        z_part: np.ndarray | None = None,
    ) -> None:
        self.d, self.z, self.bits, self.g = d, z, bits, g
        self.d_part, self.z_part = d_part, z_part

    @property
    def symmetric(self) -> bool:
        return self.z is None

    def take(self, r0: int, r1: int, g0: int, g1: int) -> GroupParams:
        z = None if self.z is None else self.z[r0:r1, g0:g1]
        return GroupParams(self.d[r0:r1, g0:g1], z, self.bits, self.g)

    def snapped(self) -> GroupParams:
        """These parameters moved onto the 8-bit scale grid of the ``*_S8`` encodings."""
        d_part, d = codecs.snap_s8(self.d.astype(_F32))
        z_part = z = None
        if self.z is not None:
            z_part, z = codecs.snap_s8(self.z.astype(_F32))
        return GroupParams(d, z, self.bits, self.g, d_part, z_part)


def embedding_weights(h: np.ndarray | None) -> np.ndarray | None:
    """Column weights of the scale search for a token embedding that is also the head:
    the head's input second moments (normalised) plus 1, since every lookup row weighs
    all columns alike. None (plain weights) without a Hessian."""
    if h is None:
        return None
    d = np.diag(h).astype(np.float64)
    return d / max(float(d.mean()), 1e-30) + 1.0


def _inv(d: np.ndarray) -> np.ndarray:
    return np.divide(_F32(1), d, out=np.zeros_like(d), where=d != 0)


def quantize_codes(w: np.ndarray, d: np.ndarray, z: np.ndarray | None, bits: int) -> np.ndarray:
    """Codes (float32 holding integers) of ``w`` against per-element ``d``/``z`` (float32,
    broadcastable), with the codec's arithmetic."""
    with np.errstate(all="ignore"):
        if z is None:
            half = 1 << (bits - 1)
            x = w * _inv(d)
            np.rint(x, out=x)
            np.clip(x, -half, half - 1, out=x)
            x += half
        else:
            x = w - z
            x *= _inv(d)
            np.rint(x, out=x)
            np.clip(x, 0, (1 << bits) - 1, out=x)
    return x


def dequantize_codes(q: np.ndarray, d: np.ndarray, z: np.ndarray | None, bits: int) -> np.ndarray:
    """Decoded values of codes ``q`` (float32), bit-identical to the codec's decoder."""
    if z is None:
        out = q - _F32(1 << (bits - 1))
        out *= d
        return out
    out = q * d
    out += z
    return out


def codec_params(w: np.ndarray, bits: int, g: int, symmetric: bool) -> GroupParams:
    """The codec's own scale rule (what ``codecs.quantize_group`` stores)."""
    _, scales, mins = codecs.quantize_group(w, bits, g, symmetric)
    return GroupParams(scales, mins, bits, g)


def _grouped(w: np.ndarray, g: int) -> np.ndarray:
    return w.reshape(w.shape[0], w.shape[1] // g, g)


def _err(w3: np.ndarray, d: np.ndarray, z: np.ndarray | None, bits: int, h3: np.ndarray):
    df = d.astype(_F32)[..., None]
    zf = None if z is None else z.astype(_F32)[..., None]
    q = quantize_codes(w3, df, zf, bits)
    diff = dequantize_codes(q, df, zf, bits) - w3
    return np.einsum("rgj,rgj->rg", diff * diff, h3), q


def _f16(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x.astype(np.float16)


def search_params(
    w: np.ndarray, bits: int, g: int, symmetric: bool, h: np.ndarray | None = None
) -> GroupParams:
    """Per-group scales (and mins) minimising the ``h``-weighted squared error of ``w``.

    Candidates: the codec's rule (so the result is never worse than plain RTN), clipped
    ranges, the opposite orientation of the symmetric grid, and a weighted least-squares
    refit of ``d`` (and ``z``) to the best candidate's codes.
    """
    w = np.ascontiguousarray(w, _F32)
    cols = w.shape[1]
    w3 = _grouped(w, g)
    hv = np.ones(cols, _F32) if h is None else np.maximum(np.asarray(h, _F32), _F32(1e-12))
    h3 = np.broadcast_to(hv.reshape(1, cols // g, g), w3.shape)
    base = codec_params(w, bits, g, symmetric)
    best_d, best_z = base.d.copy(), None if symmetric else base.z.copy()
    best_e, best_q = _err(w3, best_d, best_z, bits, h3)
    half = 1 << (bits - 1)
    top = (1 << bits) - 1

    def consider(d16: np.ndarray, z16: np.ndarray | None) -> None:
        nonlocal best_e, best_q
        if not np.isfinite(d16).all() or (z16 is not None and not np.isfinite(z16).all()):
            ok = np.isfinite(d16) & (np.isfinite(z16) if z16 is not None else True)
            d16 = np.where(ok, d16, best_d)
            if z16 is not None:
                z16 = np.where(ok, z16, best_z)
        e, q = _err(w3, d16, z16, bits, h3)
        better = e < best_e
        if better.any():
            best_e = np.where(better, e, best_e)
            best_q = np.where(better[..., None], q, best_q)
            best_d[better] = d16[better]
            if z16 is not None:
                best_z[better] = z16[better]

    with np.errstate(all="ignore"):
        if symmetric:
            idx = np.abs(w3).argmax(axis=-1)
            peak = np.take_along_axis(w3, idx[..., None], axis=-1)[..., 0]
            for s in _SYM_SHRINK:
                consider(_f16(peak * _F32(s) / _F32(-half)), None)
                consider(_f16(peak * _F32(s) / _F32(half - 1)), None)
            # weighted least squares d = sum h w c / sum h c^2 for the chosen codes c
            c = best_q - _F32(half)
            num = np.einsum("rgj,rgj->rg", h3 * w3, c)
            den = np.einsum("rgj,rgj->rg", h3 * c, c)
            consider(_f16(np.where(den > 0, num / np.where(den > 0, den, 1), best_d)), None)
        else:
            lo = w3.min(axis=-1) + _F32(0)
            hi = w3.max(axis=-1) + _F32(0)
            span = hi - lo
            for a in _ASYM_SHRINK:
                for b in _ASYM_SHRINK:
                    if a == 0 and b == 0:
                        continue
                    lo2 = lo + _F32(a) * span
                    hi2 = hi - _F32(b) * span
                    consider(_f16((hi2 - lo2) / _F32(top)), _f16(lo2))
            # weighted least squares w ~ d c + z for the chosen codes c
            c = best_q
            sh = h3.sum(axis=-1)
            shc = np.einsum("rgj,rgj->rg", h3, c)
            shcc = np.einsum("rgj,rgj->rg", h3 * c, c)
            shw = np.einsum("rgj,rgj->rg", h3, w3)
            shcw = np.einsum("rgj,rgj->rg", h3 * c, w3)
            det = sh * shcc - shc * shc
            ok = det > 1e-20 * np.maximum(sh * shcc, 1e-30)
            safe = np.where(ok, det, 1)
            d_ls = np.where(ok, (sh * shcw - shc * shw) / safe, best_d)
            z_ls = np.where(ok, (shcc * shw - shc * shcw) / safe, best_z)
            consider(_f16(d_ls), _f16(z_ls))
    return GroupParams(best_d, best_z, bits, g)


def encode_codes(
    q: np.ndarray, params: GroupParams, choice: EncodingChoice, shape: tuple[int, ...]
) -> EncodedTensor:
    """Pack float32 integer codes ``[R, C]`` with their parameters into format parts."""
    codes = codecs.pack_codes(q if q.dtype == np.uint8 else q.astype(np.uint8), params.bits)
    for what, arr in (("scale", params.d), ("min", params.z)):
        if arr is not None and not np.isfinite(arr).all():
            raise EncodingError(f"a float16 {what} overflows (weights too large)")
    if choice.encoding.scale_bits == 8:
        if params.d_part is None or (params.z is not None and params.z_part is None):
            raise EncodingError("8-bit group scales were not snapped (GroupParams.snapped)")
        d, z = params.d_part, params.z_part
    else:
        d, z = params.d, params.z
    return EncodedTensor(choice, shape, codes, d.copy(), None if z is None else z.copy())


def rtn_quantize(
    w: np.ndarray,
    choice: EncodingChoice,
    h: np.ndarray | None = None,
    search: bool = False,
    name: str = "tensor",
) -> tuple[EncodedTensor, np.ndarray]:
    """Round-to-nearest; returns the encoded parts and the decoded float32 ``[R, C]``.

    ``search=False``: byte-identical to :func:`~edgepack.packager.encode.encode_tensor`.
    """
    enc = choice.encoding
    shape = tuple(w.shape)
    if not enc.is_group or not search:
        encoded = encode_tensor(w, choice, name)
        return encoded, decode(encoded)
    m = np.ascontiguousarray(w, _F32).reshape(shape[0], -1)
    if not np.isfinite(m).all():
        encode_tensor(w, choice, name)  # raises the codec's error, naming the position
    g, bits, sym = choice.group_size, enc.bits, enc.is_symmetric
    s8 = enc.scale_bits == 8
    rows = m.shape[0]
    q = np.empty(m.shape, np.uint8)
    deq = np.empty(m.shape, _F32)
    d_all = np.empty((rows, m.shape[1] // g), np.float16)
    z_all = None if sym else np.empty_like(d_all)
    parts: list[GroupParams] = []
    for r0 in range(0, rows, _SEARCH_ROWS):  # rows are independent: bounded temporaries
        r1 = min(rows, r0 + _SEARCH_ROWS)
        p = search_params(m[r0:r1], bits, g, sym, h)
        if s8:
            p = p.snapped()
            parts.append(p)
        df = np.repeat(p.d.astype(_F32), g, axis=1)
        zf = None if p.z is None else np.repeat(p.z.astype(_F32), g, axis=1)
        qf = quantize_codes(m[r0:r1], df, zf, bits)
        deq[r0:r1] = dequantize_codes(qf, df, zf, bits)
        q[r0:r1] = qf
        d_all[r0:r1] = p.d
        if z_all is not None:
            z_all[r0:r1] = p.z
    params = GroupParams(d_all, z_all, bits, g)
    if s8:  # row blocks snap independently (multipliers are per row): stack their parts
        params.d_part = np.concatenate([p.d_part for p in parts])
        if not sym:
            params.z_part = np.concatenate([p.z_part for p in parts])
    try:
        encoded = encode_codes(q, params, choice, shape)
    except EncodingError as exc:
        raise EncodingError(f"{name}: {exc}") from None
    return encoded, deq


def decode(e: EncodedTensor) -> np.ndarray:
    """float32 ``[R, C]`` of an encoded tensor, through the format's codecs."""
    enc = e.choice.encoding
    rows = e.shape[0]
    if enc == Encoding.F32:
        return np.asarray(e.codes, _F32).reshape(rows, -1)
    if enc == Encoding.F16:
        return e.codes.astype(_F32).reshape(rows, -1)
    if enc == Encoding.BF16:
        return (e.codes.astype(np.uint32) << 16).view(_F32).reshape(rows, -1)
    if enc == Encoding.INT8_CHANNEL:
        return codecs.dequantize_int8_channel(e.codes, e.scales)
    scales, zeros = codecs.group_values(enc, e.scales, e.zeros)
    return codecs.dequantize_group(e.codes, scales, zeros, enc.bits, e.choice.group_size)

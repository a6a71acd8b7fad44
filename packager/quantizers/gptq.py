"""GPTQ (Frantar et al. 2022) onto the format's group encodings, bit-exact with decode.

For a weight ``W [R, C]`` and the calibration Hessian ``H = E[x x^T] [C, C]`` of its
input, columns are quantized one at a time and each one's rounding error is spread over
the columns not yet quantized through the inverse Hessian's Cholesky factor, so the
*output* error ``tr((W - Q) H (W - Q)^T)`` is what gets minimised. Implementation notes:

* damping ``damp * mean(diag H)`` on the diagonal; dead inputs (``H_jj = 0``) are zeroed;
* lazy batch updates over blocks of ``block_size`` columns (within a block a column's
  current value is computed from the block's earlier errors when it is reached);
* ``act_order``: columns in decreasing ``H_jj`` order. Groups stay the format's contiguous
  column groups, so with act-order the group parameters are fixed up front ("static
  groups"); without it they are chosen when the quantizer reaches a group's first
  column, from the error-updated weights;
* group parameters are float16 scales (and mins) chosen by the codec's rule or by the
  weighted grid search of :mod:`.rtn`; every code is computed with the codec's arithmetic
  against those stored parameters, so ``dequantize(stored) == Q`` exactly (the quantizer's
  own view of the result is the decoder's).

int8 (per-row scale) and float encodings are not error-compensated (the gain is nil at 8
bits); they go through RTN.
"""

from __future__ import annotations

import numpy as np

from edgepack.format import codecs
from edgepack.format.errors import EncodingError

from ..encode import EncodedTensor, EncodingChoice
from .rtn import (
    GroupParams,
    codec_params,
    dequantize_codes,
    encode_codes,
    quantize_codes,
    rtn_quantize,
    search_params,
)

__all__ = ["gptq_quantize", "output_error"]

_F32 = np.float32


def output_error(delta: np.ndarray, h: np.ndarray) -> float:
    """``tr(delta H delta^T)``: the mean squared output error per token of ``delta @ x``."""
    d = np.asarray(delta, _F32)
    return float(np.einsum("ij,ij->", d @ np.asarray(h, _F32), d))


def _inverse_cholesky(h: np.ndarray, damp: float) -> np.ndarray:
    """Upper Cholesky factor ``U`` of ``H^-1`` (``H^-1 = U^T U``), damped until it works."""
    n = h.shape[0]
    mean_diag = float(np.mean(np.diag(h))) or 1.0
    for factor in (1, 10, 100, 1000):
        hd = h + np.eye(n) * (damp * factor * mean_diag)
        try:
            lower = np.linalg.cholesky(hd)
            inv_lower = np.linalg.solve(lower, np.eye(n))
            hinv = inv_lower.T @ inv_lower
            return np.linalg.cholesky(hinv).T
        except np.linalg.LinAlgError:
            continue
    raise EncodingError("the calibration Hessian is not positive definite even when damped")


def gptq_quantize(
    w: np.ndarray,
    hessian: np.ndarray,
    choice: EncodingChoice,
    *,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = True,
    scale_search: bool = True,
    name: str = "tensor",
) -> tuple[EncodedTensor, np.ndarray]:
    """Quantize ``w`` (``[R, ...]``) against ``hessian`` (``[C, C]``, C = prod(shape[1:])).

    Returns the encoded parts and the decoded float32 ``[R, C]`` (== the codecs' decode).
    """
    enc = choice.encoding
    if not enc.is_group:
        return rtn_quantize(w, choice, name=name)
    shape = tuple(w.shape)
    m = np.ascontiguousarray(w, _F32).reshape(shape[0], -1)
    if not np.isfinite(m).all():
        return rtn_quantize(w, choice, name=name)  # raises the codec's error
    rows, cols = m.shape
    g, bits, sym = choice.group_size, enc.bits, enc.is_symmetric
    if cols % g:
        raise EncodingError(f"{name}: row length {cols} is not a multiple of the group size {g}")
    h = np.array(hessian, np.float64, copy=True)
    if h.shape != (cols, cols):
        raise ValueError(f"{name}: Hessian {h.shape} does not match {cols} columns")
    if not act_order and block_size % g:
        block_size = max(g, block_size // g * g)  # groups must not straddle blocks
    W = m.copy()
    dead = np.diag(h) <= 0
    if dead.any():
        h[dead, dead] = 1.0
        W[:, dead] = 0.0
    diag = np.diag(h).astype(_F32)
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(cols)

    s8 = enc.scale_bits == 8

    def params_for(block: np.ndarray, h_diag: np.ndarray) -> GroupParams:
        if scale_search:
            return search_params(block, bits, g, sym, h_diag)
        return codec_params(block, bits, g, sym)

    ngroups = cols // g
    d_all = np.zeros((rows, ngroups), np.float16)
    z_all = None if sym else np.zeros((rows, ngroups), np.float16)
    have = np.zeros(ngroups, bool)
    static = params_for(W, diag) if act_order or s8 else None
    if s8:
        # 8-bit scales are multiples of a per-row float32: fix those from the original
        # weights, then every group's scale (chosen now or when reached) snaps to them
        static = static.snapped()
        d_mult = codecs.s8_multipliers(static.d_part)
        z_mult = None if sym else codecs.s8_multipliers(static.z_part)
        d_q = static.d_part.copy()
        z_q = None if sym else static.z_part.copy()
    if act_order:  # static groups from the original weights
        d_all[:], have[:] = static.d, True
        if z_all is not None:
            z_all[:] = static.z

    U = _inverse_cholesky(h[np.ix_(perm, perm)], damp).astype(_F32)
    # Work on W^T (a column of W is a contiguous row here). Within a block, column i's
    # current value is its start value minus the block's earlier errors through U (one
    # matrix-vector product) instead of updating the whole block after every column.
    WT = np.ascontiguousarray(W[:, perm].T)
    codes = np.zeros((cols, rows), _F32)  # transposed, original column order
    deq = np.zeros((cols, rows), _F32)
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        ET = np.zeros((i2 - i1, rows), _F32)
        for i in range(i2 - i1):
            col = WT[i1 + i]
            if i:
                col = col - U[i1 : i1 + i, i1 + i] @ ET[:i]
            c = int(perm[i1 + i])
            gi = c // g
            if not have[gi]:  # natural order: a group starts here, within this block
                cur = WT[i1 + i : i1 + i + g]
                if i:
                    cur = cur - U[i1 : i1 + i, i1 + i : i1 + i + g].T @ ET[:i]
                p = params_for(np.ascontiguousarray(cur.T), diag[c : c + g])
                if s8:
                    part, p.d = codecs.snap_s8(p.d.astype(_F32), d_mult)
                    d_q[:, codecs.S8_ROW_BYTES + gi] = part[:, codecs.S8_ROW_BYTES]
                    if z_all is not None:
                        part, p.z = codecs.snap_s8(p.z.astype(_F32), z_mult)
                        z_q[:, codecs.S8_ROW_BYTES + gi] = part[:, codecs.S8_ROW_BYTES]
                d_all[:, gi] = p.d[:, 0]
                if z_all is not None:
                    z_all[:, gi] = p.z[:, 0]
                have[gi] = True
            d = d_all[:, gi].astype(_F32)
            z = None if z_all is None else z_all[:, gi].astype(_F32)
            q = quantize_codes(col, d, z, bits)
            v = dequantize_codes(q, d, z, bits)
            codes[c] = q
            deq[c] = v
            ET[i] = (col - v) / U[i1 + i, i1 + i]
        if i2 < cols:
            WT[i2:] -= U[i1:i2, i2:].T @ ET
    codes = np.ascontiguousarray(codes.T)
    deq = np.ascontiguousarray(deq.T)
    params = GroupParams(d_all, z_all, bits, g)
    if s8:
        params.d_part, params.z_part = d_q, z_q
    try:
        encoded = encode_codes(codes, params, choice, shape)
    except EncodingError as exc:
        raise EncodingError(f"{name}: {exc}") from None
    return encoded, deq

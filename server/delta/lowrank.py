"""Fit a FACTORS correction (spec/DELTA.md section 4.1) to a re-quantized tensor update.

A merged fine-tune changes a weight matrix by a low-rank update (LoRA) and re-quantizes
it. The new codes and scales pin every new weight to a quantization cell; relative to
the old (dequantized) weights, the update lies in a box ``lo <= L <= hi`` per element.
We look for a low-rank ``L`` in that box by alternating projections (clip to the box,
project to rank k by subspace iteration), starting from the rank-k part of the cell
midpoints; the rank is the number of singular values standing out of the quantization
noise. Only matrix products and k x k factorizations are used: a full SVD is slow and
multi-threaded BLAS is pathological on a loaded 2-core machine.

Creator-only and not normative: any ``L`` is correct (the residual fixes the rest), a
better one is just smaller.
"""

from __future__ import annotations

import os

import numpy as np

from edgepack.format import Encoding, codecs
from edgepack.format.delta.container import MAX_RANK

__all__ = ["cell_bounds", "fit_lowrank", "quantize_factors"]

_F32 = np.float32
_MAX_FIT_RANK = 32
_NOISE_MARGIN = 1.5


_BLOCK_ELEMENTS = 1 << 20  # elements per row block of the element-wise passes


def cell_bounds(
    w_old: np.ndarray, encoding: Encoding, group_size: int, codes, scales, zeros
) -> tuple[np.ndarray, np.ndarray]:
    """Per element, the interval the update ``new - w_old`` must lie in for the new
    tensor to quantize to the given codes (its scales taken as known).

    Computed a block of rows at a time: the element-wise steps need a dozen
    temporaries, which for a whole matrix would be ten times its float32 size."""
    rows, cols = w_old.shape
    lo = np.empty((rows, cols), _F32)
    hi = np.empty((rows, cols), _F32)
    if not encoding.is_group:  # int8 per channel
        codes = np.asarray(codes).view(np.int8).reshape(rows, cols)
        scales = np.asarray(scales, _F32).reshape(rows, 1)
    else:
        codes = np.asarray(codes).view(np.uint8).reshape(rows, -1)
        scales = np.asarray(scales).reshape(rows, -1)
        zeros = np.asarray(zeros).reshape(rows, -1) if not encoding.is_symmetric else None
    step = max(1, _BLOCK_ELEMENTS // max(cols, 1))
    for r in range(0, rows, step):
        block = slice(r, min(rows, r + step))
        zero_block = zeros[block] if zeros is not None else None
        lo[block], hi[block] = _cell_bounds_block(
            w_old[block], encoding, group_size, codes[block], scales[block], zero_block
        )
    return lo, hi


def _cell_bounds_block(w_old, encoding: Encoding, group_size: int, codes, scales, zeros):
    cols = w_old.shape[1]
    if not encoding.is_group:
        q = codes.astype(_F32)
        d = np.repeat(scales, cols, axis=1)
        lo_q, hi_q = -127, 127
    else:
        q = codecs.unpack_codes(codes, encoding.bits).astype(_F32)
        d = np.repeat(scales.astype(_F32), group_size, axis=1)
        half = 1 << (encoding.bits - 1)
        if encoding.is_symmetric:
            q -= half
            lo_q, hi_q = -half, half - 1
        else:
            lo_q, hi_q = 0, 2 * half - 1
    with np.errstate(all="ignore"):
        base = q * d
        if not encoding.is_symmetric:
            base += np.repeat(zeros.astype(_F32), group_size, axis=1)
        half = 0.5 * np.abs(d)
        lo, hi = base - half - w_old, base + half - w_old
        # a clipped code only bounds the value on one side; keep a finite box anyway
        sign = np.sign(d)
        open_hi = (q == hi_q) & (sign > 0) | (q == lo_q) & (sign < 0)
        open_lo = (q == lo_q) & (sign > 0) | (q == hi_q) & (sign < 0)
        hi[open_hi] += 4 * half[open_hi]
        lo[open_lo] -= 4 * half[open_lo]
    bad = ~(np.isfinite(lo) & np.isfinite(hi))
    lo[bad], hi[bad] = 0, 0
    return lo, hi


def _orth(y: np.ndarray) -> np.ndarray:
    """Orthonormal basis of the columns of ``y`` (Cholesky QR, twice for accuracy)."""
    dtype = y.dtype
    y = y.astype(np.float64)
    for _ in range(2):
        g = y.T @ y
        g += np.eye(g.shape[0]) * (1e-9 * max(float(np.trace(g)), 1e-300))
        r = np.linalg.cholesky(g)
        y = np.linalg.solve(r, y.T).T
    return y.astype(dtype)


def fit_lowrank(
    lo: np.ndarray, hi: np.ndarray, *, iterations: int = 40, margin: float = 0.2, seed: int = 0
) -> tuple[np.ndarray, np.ndarray] | None:
    """``(U, V)`` with ``U @ V`` low-rank and (nearly) inside ``[lo, hi]``, or None when the
    box midpoints have no component standing out of the quantization noise.

    The boxes are shrunk by ``margin`` of their width at first, linearly relaxed to 0:
    plain alternating projections stall with a few percent of elements on the wrong side
    of a rounding boundary; the shrunken boxes push the fit into their interiors, where
    it also survives the quantization of the factors.
    """
    rows, cols = lo.shape
    k_max = min(_MAX_FIT_RANK, rows // 4, cols // 4)
    if k_max < 1:
        return None
    width = hi - lo
    noise = float(np.sqrt(np.mean(width.astype(np.float64) ** 2) / 12.0))
    mid = 0.5 * (lo + hi)
    edge = noise * (np.sqrt(rows) + np.sqrt(cols))
    rng = np.random.default_rng(seed)
    q = _orth(mid @ rng.standard_normal((cols, k_max)).astype(_F32))
    for _ in range(3):
        q = _orth(mid @ (mid.T @ q))
    p = (q.T @ mid).astype(np.float64)
    s2, vecs = np.linalg.eigh(p @ p.T)
    s = np.sqrt(np.maximum(s2[::-1], 0))
    rank = min(int(np.sum(s > _NOISE_MARGIN * edge)), MAX_RANK)
    if rank < 1:
        return None
    q = (q @ vecs[:, ::-1][:, :rank].astype(_F32)).astype(_F32)
    x = mid
    del mid
    for it in range(iterations):
        q = _orth(x @ (x.T @ q))
        low = q @ (q.T @ x)
        m = margin * (1.0 - it / iterations)
        _clip_to_shrunken_box(low, lo, hi, width, m)
        x = low
    p = (q.T @ x).astype(np.float64)
    q = q.astype(np.float64)
    # balance: L = (Q Up S^1/2)(S^1/2 Vt) so both factors carry similar magnitudes
    s2, up = np.linalg.eigh(p @ p.T)
    s = np.sqrt(np.maximum(s2, 1e-300))
    vt = (up.T @ p) / s[:, None]
    u = q @ up * np.sqrt(s)[None, :]
    v = np.sqrt(s)[:, None] * vt
    return u, v


def _clip_to_shrunken_box(
    x: np.ndarray, lo: np.ndarray, hi: np.ndarray, width: np.ndarray, m: float
) -> None:
    """``x = clip(x, lo + m * width, hi - m * width)`` in place, a block of rows at a
    time (the bounds of the whole matrix would be two more matrices)."""
    step = max(1, _BLOCK_ELEMENTS // max(x.shape[1], 1))
    for r in range(0, x.shape[0], step):
        b = slice(r, r + step)
        np.clip(x[b], lo[b] + m * width[b], hi[b] - m * width[b], out=x[b])


def quantize_factors(u: np.ndarray, v: np.ndarray, qmax: int) -> bytes:
    """The FACTORS op bytes for ``u @ v``: ``su, u, sv, v`` with ``|codes| <= qmax``."""

    def scale(m: np.ndarray, axis: int) -> np.ndarray:
        s = (np.abs(m).max(axis=axis) / qmax).astype(np.float16)
        s[~np.isfinite(s) | (s == 0)] = np.float16(1)
        return s

    su = scale(u, 1)
    sv = scale(v, 0)
    uq = np.clip(np.rint(u / su.astype(np.float64)[:, None]), -qmax, qmax).astype(np.int8)
    vq = np.clip(np.rint(v / sv.astype(np.float64)[None, :]), -qmax, qmax).astype(np.int8)
    return su.astype("<f2").tobytes() + uq.tobytes() + sv.astype("<f2").tobytes() + vq.tobytes()


class blas_single_thread:
    """Context manager: run OpenBLAS single-threaded (best effort, restored on exit).

    The fit is many small products; on a loaded machine OpenBLAS's thread pool makes them
    4x slower, and the planner already parallelizes over tensors.
    """

    _lib = None
    _searched = False

    def __enter__(self) -> blas_single_thread:
        lib = self._find()
        self._previous = None
        if lib is not None:
            try:
                self._previous = lib[0]()
                lib[1](1)
            except Exception:  # pragma: no cover - a foreign BLAS build
                self._previous = None
        return self

    def __exit__(self, *exc) -> None:
        lib = self._find()
        if lib is not None and self._previous:
            try:
                lib[1](int(self._previous))
            except Exception:  # pragma: no cover
                pass

    @classmethod
    def _find(cls):
        if cls._searched:
            return cls._lib
        cls._searched = True
        import ctypes

        try:
            # bytes: a mapped file's name need not be UTF-8 (an input named so is mapped)
            with open("/proc/self/maps", "rb") as f:
                paths = {
                    os.fsdecode(line.split()[-1]) for line in f if b"openblas" in line.lower()
                }
        except OSError:
            return None
        for path in sorted(paths):
            try:
                dll = ctypes.CDLL(path)
            except OSError:
                continue
            for prefix in ("scipy_openblas", "openblas"):
                for suffix in ("64_", ""):
                    get = getattr(dll, f"{prefix}_get_num_threads{suffix}", None)
                    put = getattr(dll, f"{prefix}_set_num_threads{suffix}", None)
                    if get is not None and put is not None:
                        get.restype = ctypes.c_int
                        put.argtypes = [ctypes.c_int]
                        cls._lib = (get, put)
                        return cls._lib
        return None

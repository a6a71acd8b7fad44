"""The numpy backend: the reference every native kernel is checked against, and the
fallback for any op or weight the extension does not take.

Weights are decoded in row blocks (bounded memory); row blocks of a matmul are split over
the backend's threads, each on single-threaded BLAS (:func:`set_blas_threads`).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from edgepack.format import Encoding, codecs

from ..errors import KernelStatus, NumericError
from ..kv_cache import LayerKV, rotate_heads
from ..weights import Linear
from .activations import gelu
from .interface import ACT_SCALE_MAX, QuantizedActivations
from .kv_codecs import codes_of, quantize_v6, v6_scale
from .layer import CompositeLayer

__all__ = ["NumpyKernels", "set_blas_threads"]

_BLOCK_ELEMS = 1 << 17  # f32 elements of one dequantized weight block (512 KiB)
_PARALLEL_MIN = 1 << 22  # weight elements x tokens worth splitting over threads
_F32 = np.float32


def set_blas_threads(n: int) -> bool:
    """Set numpy's OpenBLAS thread count for the process (best effort; False when no
    OpenBLAS is found). The packager pins 1: OpenBLAS's own threads spin and collapse on
    a busy machine, and the backends' parallelism is their row blocks."""
    return _BlasThreads.set(n)


class _BlasThreads:
    """Best-effort control of numpy's OpenBLAS thread count (no threadpoolctl needed)."""

    _fn: Callable[[int], None] | None = None
    _looked = False

    @classmethod
    def set(cls, n: int) -> bool:
        if not cls._looked:
            cls._looked = True
            cls._fn = cls._find()
        if cls._fn is None:
            return False
        cls._fn(int(n))
        return True

    @staticmethod
    def _find() -> Callable[[int], None] | None:
        try:
            with open("/proc/self/maps") as maps:
                libs = {line.split()[-1] for line in maps if "openblas" in line.lower()}
        except OSError:
            return None
        names = (
            "scipy_openblas_set_num_threads64_",
            "scipy_openblas_set_num_threads",
            "openblas_set_num_threads64_",
            "openblas_set_num_threads",
        )
        for path in sorted(libs):
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            for name in names:
                fn = getattr(lib, name, None)
                if fn is not None:
                    fn.argtypes = [ctypes.c_int]
                    fn.restype = None
                    return fn
        return None


class NumpyKernels(CompositeLayer):
    """Reference kernels in numpy; weights are decoded in row blocks (bounded memory).

    Row blocks of a matmul are split over ``threads`` workers (numpy releases the GIL),
    each using single-threaded BLAS, so ``threads`` is the parallelism: creating one
    sets numpy's OpenBLAS to one thread for the process (best effort, via ctypes).
    One token against int4 weights never materializes float weights (nibble planes
    times the even/odd columns of ``x``, per-group sums, scales applied per group).
    """

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, int(threads or os.cpu_count() or 1))
        self.name = "numpy"
        self._pool = ThreadPoolExecutor(self.threads - 1) if self.threads > 1 else None
        self._tls = threading.local()
        _BlasThreads.set(1)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    # -- elementwise ---------------------------------------------------------------------
    def rmsnorm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        ms = np.mean(np.square(x), axis=-1, keepdims=True, dtype=_F32)
        r = _F32(1.0) / np.sqrt(ms + _F32(eps))
        return weight * (x * r)

    def quantize_activations(self, x: np.ndarray, group: int) -> QuantizedActivations:
        t, k = x.shape
        if k % group:
            raise ValueError(f"activation width {k} is not a multiple of group {group}")
        xg = x.reshape(t, k // group, group)
        with np.errstate(all="ignore"):
            absmax = np.max(np.abs(xg), axis=-1)
            d = (absmax / _F32(127)).astype(_F32)
            overflow = not (np.isfinite(absmax).all() and float(d.max(initial=0)) <= ACT_SCALE_MAX)
            if overflow:
                return QuantizedActivations(np.zeros((t, k), np.int8), d, group, True)
            inv = np.divide(_F32(1), d, out=np.zeros_like(d), where=d != 0)
            q = xg * inv[:, :, None]
            np.rint(q, out=q)
            np.clip(q, -127, 127, out=q)
        return QuantizedActivations(q.astype(np.int8).reshape(t, k), d, group, False)

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return gate / (_F32(1) + np.exp(-gate)) * up

    def gated_activation(self, gate: np.ndarray, up: np.ndarray, act: str) -> np.ndarray:
        """``act(gate) * up`` for the non-SiLU activations of ``config_table.ACTIVATIONS``."""
        if act == "relu":
            return np.maximum(gate, _F32(0)) * up
        if act in ("gelu", "gelu_tanh"):
            return gelu(gate, tanh=act == "gelu_tanh") * up
        raise ValueError(f"unknown activation {act!r}")

    def rope(
        self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray
    ) -> np.ndarray:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        c, s = cos[:, None, :], sin[:, None, :]
        out = np.empty_like(x)
        out[..., :half] = x1 * c - x2 * s
        out[..., half:] = x2 * c + x1 * s
        return out

    # -- matmul ------------------------------------------------------------------------------
    def matmul(
        self,
        x: np.ndarray | QuantizedActivations,
        w: Linear,
        residual: np.ndarray | None = None,
    ) -> np.ndarray:
        if isinstance(x, QuantizedActivations):
            x = x.dequantize()
        if w.factors is not None:  # low rank: U (V x)
            u, v = w.factors
            out = self.matmul(self.matmul(x, v), u)
        else:
            out = self._matmul(np.ascontiguousarray(x, _F32), w)
        if w.bias is not None:
            out += w.bias
        if residual is not None:
            out += residual
        return out

    def _matmul(self, x: np.ndarray, w: Linear) -> np.ndarray:
        t = x.shape[0]
        out = np.empty((t, w.rows), _F32)
        enc = w.encoding
        rows_per_block = max(1, _BLOCK_ELEMS // w.cols)
        blocks = [(r, min(r + rows_per_block, w.rows)) for r in range(0, w.rows, rows_per_block)]
        int4 = enc.is_group and enc.bits == 4
        if int4 and t == 1:
            self._parallel(blocks, self._int4_gemv(x[0], w, out[0]), w.rows * w.cols * t)
            return out
        if int4:  # columns permuted so nibbles need no interleave
            g = w.group_size
            xin = np.ascontiguousarray(
                x.reshape(t, w.cols // g, g // 2, 2).transpose(0, 1, 3, 2).reshape(t, w.cols)
            )
        else:
            xin = x

        def work(part: Sequence[tuple[int, int]]) -> None:
            for r0, r1 in part:
                wb = self._decode_block(w, r0, r1)
                np.matmul(xin, wb.T, out=out[:, r0:r1])
                if enc == Encoding.INT8_CHANNEL:
                    out[:, r0:r1] *= w.scales[r0:r1]

        self._parallel(blocks, work, w.rows * w.cols * t)
        return out

    def _int4_gemv(
        self, x: np.ndarray, w: Linear, out: np.ndarray
    ) -> Callable[[Sequence[tuple[int, int]]], None]:
        """One token against int4 weights without materializing scaled weights:
        ``y[r] = sum_g d[r,g] * sum_j nib[r,g,j] * x[g,j] + sum_g (z[r,g] or -8 d[r,g]) * xs[g]``
        with the nibble planes multiplied straight into ``x``'s even/odd columns."""
        g = w.group_size
        ng = w.cols // g
        xe = np.ascontiguousarray(x[0::2])  # low nibble of byte b is column 2b
        xo = np.ascontiguousarray(x[1::2])
        xs = x.reshape(ng, g).sum(axis=1, dtype=_F32)  # group sums for the offset term
        ones = np.ones(g // 2, _F32)
        half = w.cols // 2

        def work(part: Sequence[tuple[int, int]]) -> None:
            for r0, r1 in part:
                n = r1 - r0
                c = w.codes[r0:r1]
                nib = self._scratch("nib", n * half, np.uint8).reshape(n, half)
                lo = self._scratch("w", n * half, _F32).reshape(n, half)
                hi = self._scratch("w2", n * half, _F32).reshape(n, half)
                np.bitwise_and(c, 0x0F, out=nib)
                np.multiply(nib, xe, out=lo, dtype=_F32, casting="unsafe")
                np.right_shift(c, 4, out=nib)
                np.multiply(nib, xo, out=hi, dtype=_F32, casting="unsafe")
                lo += hi
                p = lo.reshape(n * ng, g // 2) @ ones  # per-group dots of raw nibbles
                d = w.scales[r0:r1].astype(_F32)
                y = np.einsum("rg,rg->r", p.reshape(n, ng), d)
                if w.zeros is None:
                    y -= _F32(8) * (d @ xs)
                else:
                    y += w.zeros[r0:r1].astype(_F32) @ xs
                out[r0:r1] = y

        return work

    def _parallel(self, blocks: list, work: Callable[[Sequence], None], size: int) -> None:
        """Run ``work`` over contiguous shares of ``blocks``; ``size`` (weight elements x
        tokens) below ``_PARALLEL_MIN`` stays on the caller's thread: a hand-off through
        the pool costs more than a layer matrix against one token takes."""
        n = self.threads if self._pool is not None and size >= _PARALLEL_MIN else 1
        n = min(n, len(blocks))
        if n <= 1:
            work(blocks)
            return
        per = -(-len(blocks) // n)
        parts = [blocks[i * per : (i + 1) * per] for i in range(n)]
        futures = [self._pool.submit(work, p) for p in parts[1:]]
        work(parts[0])
        for f in futures:
            f.result()

    def _scratch(self, name: str, size: int, dtype: type) -> np.ndarray:
        key = (name, np.dtype(dtype).str)
        buf = getattr(self._tls, "bufs", None)
        if buf is None:
            buf = self._tls.bufs = {}
        arr = buf.get(key)
        if arr is None or arr.size < size:
            arr = buf[key] = np.empty(max(size, _BLOCK_ELEMS), dtype)
        return arr[:size]

    def _decode_block(self, w: Linear, r0: int, r1: int) -> np.ndarray:
        """Rows ``r0:r1`` as float32 ``[n, cols]`` (int4: columns in nibble order)."""
        enc, n, cols = w.encoding, r1 - r0, w.cols
        codes = w.codes
        assert codes is not None
        if enc == Encoding.F32:
            return codes[r0:r1]
        out = self._scratch("w", n * cols, _F32).reshape(n, cols)
        if enc == Encoding.F16 or enc == Encoding.INT8_CHANNEL:
            np.copyto(out, codes[r0:r1], casting="unsafe")
            return out
        if enc == Encoding.BF16:
            wide = self._scratch("bf", n * cols, np.uint32).reshape(n, cols)
            np.copyto(wide, codes[r0:r1], casting="unsafe")
            np.left_shift(wide, 16, out=wide)
            np.copyto(out, wide.view(_F32))
            return out
        if enc.bits != 4:  # int3/int2: the format's reference decoder (no fast path yet)
            zeros = None if w.zeros is None else w.zeros[r0:r1]
            codes_rows = codes[r0:r1]
            out[:] = codecs.dequantize_group(
                codes_rows, w.scales[r0:r1], zeros, enc.bits, w.group_size
            )
            return out
        # int4: nibble planes [n, G, 2, g/2] (low nibbles = even columns first)
        g = w.group_size
        ng = cols // g
        c = codes[r0:r1].reshape(n, ng, g // 2)
        nib = self._scratch("nib", n * cols, np.uint8).reshape(n, ng, 2, g // 2)
        np.bitwise_and(c, 0x0F, out=nib[:, :, 0])
        np.right_shift(c, 4, out=nib[:, :, 1])
        nib3 = nib.reshape(n, ng, g)
        out3 = out.reshape(n, ng, g)
        d = w.scales[r0:r1].astype(_F32)[:, :, None]
        if enc == Encoding.INT4_GROUP_SYM:
            np.subtract(nib3, _F32(8), out=out3, dtype=_F32, casting="unsafe")
            out3 *= d
        else:
            np.multiply(nib3, d, out=out3, dtype=_F32, casting="unsafe")
            out3 += w.zeros[r0:r1].astype(_F32)[:, :, None]
        return out

    # -- KV cache ---------------------------------------------------------------------------
    def attend(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        kv: LayerKV,
        block_table: np.ndarray,
        start: int,
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> np.ndarray:
        """Write K/V of positions ``start..start+T-1``, then causal attention over
        ``0..start+T-1`` (only the last ``window`` positions with a sliding window);
        ``[T, heads * head_dim]``."""
        t = q.shape[0]
        self.kv_write(kv, k, v, block_table, start)
        positions = np.arange(start, start + t, dtype=np.int64)
        return self.attention(q, kv, block_table, start + t, positions, window, scale, softcap)

    def kv_write(
        self, kv: LayerKV, k: np.ndarray, v: np.ndarray, block_table: np.ndarray, start: int
    ) -> None:
        bs = kv.block_size
        pos = np.arange(start, start + k.shape[0], dtype=np.int64)
        blk, off = block_table[pos // bs], pos % bs
        if kv.mode == "float":
            kv.k[blk, off] = k
            kv.v[blk, off] = v
            return
        layout = kv.layout
        sd = np.dtype(layout.scale_dtype)
        if layout.rotate:
            k, v = rotate_heads(k), rotate_heads(v)
        kq, kd, ok_k = _quantize_k(k, sd)
        if layout.v_bits == 6:
            (vq, vhi, vd, ok_v), vm = quantize_v6(v, kv.v_group), None
        elif layout.v_bits == 5:
            vq, vhi, vd, vm, ok_v = _quantize_v5(v, kv.v_group, sd)
        else:
            (vq, vd, ok_v), vhi, vm = _quantize_v(v, kv.v_group), None, None
        if not (ok_k and ok_v):
            raise NumericError(
                "non-finite K/V cannot be quantized into the KV cache",
                KernelStatus.NON_FINITE,
                op="kv_write",
            )
        kv.k[blk, off] = kq
        kv.k_scales[blk, off] = kd
        kv.v[blk, off] = vq
        kv.v_scales[blk, off] = vd
        if vhi is not None:
            kv.v_high[blk, off] = vhi
        if vm is not None:
            kv.v_mins[blk, off] = vm

    def read_kv(
        self, kv: LayerKV, block_table: np.ndarray, n: int, stored: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """Dequantized ``K, V: [n, kv_heads, head_dim]`` for cache positions ``0..n-1``
        (``stored``: in the layout's rotated basis, as the attention reads them)."""
        nb = block_table.size
        bs = kv.block_size

        def rows(a: np.ndarray) -> np.ndarray:  # cache positions 0..n-1 of one array
            return a[block_table].reshape(nb * bs, *a.shape[2:])[:n]

        if kv.mode == "float":
            return rows(kv.k), rows(kv.v)
        k = rows(kv.k).astype(_F32)
        k *= rows(kv.k_scales).astype(_F32)[:, :, None]
        vc = rows(kv.v)
        h, half = vc.shape[1], vc.shape[2]
        nib = np.empty((n, h, half, 2), np.uint8)
        np.bitwise_and(vc, 0x0F, out=nib[..., 0])
        np.right_shift(vc, 4, out=nib[..., 1])
        g = kv.v_group
        if kv.layout.v_bits == 6:  # int6: bits 4-5 from the 2-bit plane, then (c - 32) * d
            hi = rows(kv.v_high)
            top = np.stack([(hi >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)
            nib.reshape(n, h, 2 * half)[:] |= top.reshape(n, h, 2 * half) << 4
            v = nib.reshape(n, h, (2 * half) // g, g).astype(_F32)
            v -= _F32(32)
            v *= v6_scale(rows(kv.v_scales))[..., None]
        elif kv.v_high is not None:  # int5: bit 4 from the bit plane, then c * d + m
            nib.reshape(n, h, 2 * half)[:] |= (
                np.unpackbits(rows(kv.v_high), axis=-1, bitorder="little") << 4
            )
            v = nib.reshape(n, h, (2 * half) // g, g).astype(_F32)
            v *= rows(kv.v_scales).astype(_F32)[..., None]
            v += rows(kv.v_mins).astype(_F32)[..., None]
        else:
            v = nib.reshape(n, h, (2 * half) // g, g).astype(_F32)
            v -= _F32(8)
            v *= rows(kv.v_scales).astype(_F32)[..., None]
        if kv.layout.rotate and not stored:  # back from the stored (rotated) basis
            return rotate_heads(k), rotate_heads(v.reshape(n, h, 2 * half))
        return k, v.reshape(n, h, 2 * half)

    def attention(
        self,
        q: np.ndarray,
        kv: LayerKV,
        block_table: np.ndarray,
        n_ctx: int,
        positions: np.ndarray,
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> np.ndarray:
        t, nh, hd = q.shape
        k, v = self.read_kv(kv, block_table, n_ctx, stored=True)
        rotated = kv.mode != "float" and kv.layout.rotate
        if rotated:  # q . k and sum p v in the stored basis: rotate q now, the output after
            q = rotate_heads(q)
        nkv = k.shape[1]
        rep = nh // nkv
        qh = q.reshape(t, nkv, rep, hd).transpose(1, 2, 0, 3).reshape(nkv, rep * t, hd)
        scores = np.matmul(qh, k.transpose(1, 2, 0))  # [nkv, rep*t, n]
        scores *= _F32(1.0 / np.sqrt(hd) if scale is None else scale)
        if softcap is not None:  # gemma2: cap * tanh(scores / cap), before the mask
            scores /= _F32(softcap)
            np.tanh(scores, out=scores)
            scores *= _F32(softcap)
        windowed = window is not None and n_ctx > window
        if t > 1 or int(positions[-1]) != n_ctx - 1 or windowed:
            pos = np.tile(positions, rep)  # row r*t + i is query i
            keys = np.arange(n_ctx)[None, :]
            mask = keys > pos[:, None]
            if windowed:  # transformers' sliding_window_overlay: key > query - window
                mask |= keys <= pos[:, None] - window
            scores[:, mask] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out = np.matmul(scores, v.transpose(1, 0, 2))  # [nkv, rep*t, hd]
        out = out.reshape(nkv, rep, t, hd).transpose(2, 0, 1, 3)
        if rotated:
            return rotate_heads(out).reshape(t, nh * hd)
        return np.ascontiguousarray(out.reshape(t, nh * hd))


def _quantize_k(k: np.ndarray, scale_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, bool]:
    """int8 per token and head; the scale is rounded to ``scale_dtype`` before use."""
    with np.errstate(all="ignore"):
        absmax = np.max(np.abs(k), axis=-1)
        d = (absmax / _F32(127)).astype(scale_dtype).astype(_F32)
        ok = bool(np.isfinite(absmax).all() and np.isfinite(d).all())
        inv = np.divide(_F32(1), d, out=np.zeros_like(d), where=d != 0)
        q = k * inv[..., None]
        np.rint(q, out=q)
        np.clip(q, -127, 127, out=q)
        q = np.nan_to_num(q, nan=0.0)
    return q.astype(np.int8), d.astype(scale_dtype), ok


def _quantize_v(v: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, bool]:
    t, h, d = v.shape
    vg = v.reshape(t, h, d // group, group)
    with np.errstate(all="ignore"):
        idx = np.abs(vg).argmax(axis=-1)
        peak = np.take_along_axis(vg, idx[..., None], axis=-1)[..., 0]
        ok = bool(np.isfinite(peak).all() and np.isfinite(v).all())
        scale = (peak / _F32(-8)).astype(_F32) + _F32(0)
        q = codes_of(vg, scale, -8, 7)
    nib = (q + 8).astype(np.uint8).reshape(t, h, d)
    packed = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return packed, scale, ok



def _quantize_v5(
    v: np.ndarray, group: int, scale_dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]:
    """int5 asymmetric per group: ``m = min``, ``d = (max - min)/31`` (both rounded to
    ``scale_dtype`` first), ``c = clip(rint((v - m) * (1/d)), 0, 31)``. Returns the nibble
    plane, the bit plane of bit 4, scales, mins and whether everything was finite."""
    t, h, dim = v.shape
    vg = v.reshape(t, h, dim // group, group)
    with np.errstate(all="ignore"):
        lo, hi = vg.min(axis=-1), vg.max(axis=-1)
        m = lo.astype(scale_dtype).astype(_F32)
        d = ((hi - m) / _F32(31)).astype(scale_dtype).astype(_F32)
        ok = bool(np.isfinite(v).all() and np.isfinite(m).all() and np.isfinite(d).all())
        inv = np.divide(_F32(1), d, out=np.zeros_like(d), where=d != 0)
        c = (vg - m[..., None]) * inv[..., None]
        np.rint(c, out=c)
        np.clip(c, 0, 31, out=c)
        c = np.nan_to_num(c, nan=0.0)
    codes = c.astype(np.uint8).reshape(t, h, dim)
    packed = (codes[..., 0::2] & 0x0F) | ((codes[..., 1::2] & 0x0F) << 4)
    high = np.packbits(codes >> 4, axis=-1, bitorder="little")
    return packed, high, d.astype(scale_dtype), m.astype(scale_dtype), ok

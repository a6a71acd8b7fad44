"""The kernel interface the decoder runs on, its numpy implementation and the native adapter.

The model never does arithmetic itself: every op goes through a :class:`Kernels`
object. :class:`NumpyKernels` implements all of them (the reference and the fallback);
:class:`NativeKernels` calls ``edgepack.native._kernels`` for each op that module
provides and numpy for the rest (one warning naming them). ``EDGEPACK_KERNELS`` (or
``open(kernels=...)``) picks ``numpy`` or ``native``; unset, native is used when the
extension loads and provides runtime ops. One INFO line on ``edgepack.runtime`` says
which path is active.

Conventions (all arrays C-contiguous unless noted, float32 unless noted):

* activations ``x: [T, K]`` (T tokens); weights are :class:`~.weights.Linear` ``[R, K]``;
  ``matmul`` returns ``x @ W.T (+ bias) (+ residual)`` as ``[T, R]``;
* dynamic activation quantization, per row and group of ``group`` columns (the
  weight's ``act_group``: its own group for int4, 32 for int8, like llama.cpp's Q8_0;
  ``group == K`` is one scale per token): ``d = absmax / 127``,
  ``q = clip(rint(x * (1/d)), -127, 127)`` (``1/d = 0`` when ``d == 0``), scales float32.
  It *overflows* when ``absmax`` is not finite or ``d > ACT_SCALE_MAX`` (the largest
  float16, so native kernels may keep scales in float16); then the layer is recomputed
  on the float-activation path;
* int8-activation matmul against int4 / int8 weights: int32 dot per (activation group,
  weight group) and one float multiply by both scales; the numpy reference computes the
  same value as ``(q * d) @ dequantize(W).T`` in float32;
* RoPE is Hugging Face's rotate-half on ``[T, heads, head_dim]`` with ``cos, sin:
  [T, head_dim/2]`` tables;
* the KV cache is :mod:`.kv_cache`'s paged layout; ``attend`` writes the new tokens'
  K/V (quantized on write; :class:`FloatingPointError` if they are not finite) and then
  attends causally (query at position ``p`` sees cache positions ``<= p``), dequantizing
  on read.

A decoder layer is one ``decoder_layer(layer, x, ctx) -> LayerResult`` call. The
composite default chains the ops above (fused ``rmsnorm_quantize`` / ``swiglu_quantize``
where one activation group serves every consumer); :class:`NativeKernels` calls the
extension's ``decoder_layer`` when it has one (a whole layer per call, the design target),
else an inlined chain of its ops. A result with ``fallback`` set makes the model
recompute that layer with float activations (:mod:`.model`).

Determinism: every output element is produced by one fixed sequence of float ops for a
given shape and thread count (row blocks are statically assigned to threads), so the
same input gives the same bits.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from edgepack.format import Encoding, codecs

from .errors import KernelUnavailableError
from .kv_cache import LayerKV
from .weights import LayerWeights, Linear

__all__ = [
    "ACT_SCALE_MAX",
    "KERNEL_OPS",
    "Kernels",
    "LayerContext",
    "LayerResult",
    "NativeKernels",
    "NumpyKernels",
    "QuantizedActivations",
    "select_kernels",
]

_log = logging.getLogger("edgepack.runtime")

ENV_VAR = "EDGEPACK_KERNELS"
ACT_SCALE_MAX = 65504.0
# The injected-overflow hook multiplies a layer's first quantized activation by this.
INJECT_FACTOR = np.float32(1e36)
_BLOCK_ELEMS = 1 << 17  # f32 elements of one dequantized weight block (512 KiB)
_PARALLEL_MIN = 1 << 22  # weight elements x tokens worth splitting over threads
_F32 = np.float32

# Ops a backend provides (the Protocol below); native may provide any subset.
KERNEL_OPS = (
    "rmsnorm",
    "rmsnorm_quantize",
    "quantize_activations",
    "matmul",
    "swiglu",
    "swiglu_quantize",
    "rope",
    "attend",
)


class QuantizedActivations(NamedTuple):
    q: np.ndarray  # int8 [T, K]
    scales: np.ndarray  # float32 [T, K // group]
    group: int
    overflow: bool

    def dequantize(self) -> np.ndarray:
        t, k = self.q.shape
        x = self.q.reshape(t, k // self.group, self.group).astype(_F32)
        x *= self.scales[:, :, None]
        return x.reshape(t, k)


@dataclass(frozen=True)
class LayerContext:
    """Everything one decoder layer call needs besides weights and input."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    cos: np.ndarray  # [T, head_dim/2], row t for positions[t]
    sin: np.ndarray
    positions: np.ndarray  # int64 [T], consecutive: start .. start+T-1
    block_table: np.ndarray  # int32 [ceil(n_ctx / block_size)] of the sequence
    n_ctx: int  # cache positions valid after this call's writes (= positions[-1] + 1)
    kv: LayerKV
    act_int8: bool  # int8-activation path (else float activations)
    inject_overflow: bool = False

    @property
    def start(self) -> int:
        return int(self.positions[0])


class LayerResult(NamedTuple):
    x: np.ndarray | None  # the layer's output (residual stream), None when it gave up
    fallback: str | None  # why the float path must recompute this layer, or None


@runtime_checkable
class Kernels(Protocol):
    """What a backend implements (see the module docstring for the numerics).

    Quantizing ops report an overflow through ``QuantizedActivations.overflow``; ``attend``
    raises :class:`FloatingPointError` when K/V to be quantized are not finite.
    """

    name: str
    threads: int

    def rmsnorm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray: ...

    def quantize_activations(self, x: np.ndarray, group: int) -> QuantizedActivations: ...

    def rmsnorm_quantize(
        self, x: np.ndarray, weight: np.ndarray, eps: float, group: int
    ) -> QuantizedActivations: ...

    def matmul(
        self,
        x: np.ndarray | QuantizedActivations,
        w: Linear,
        residual: np.ndarray | None = None,
    ) -> np.ndarray: ...

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray: ...

    def swiglu_quantize(
        self, gate: np.ndarray, up: np.ndarray, group: int
    ) -> QuantizedActivations: ...

    def rope(
        self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray
    ) -> np.ndarray: ...

    def attend(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        kv: LayerKV,
        block_table: np.ndarray,
        start: int,
    ) -> np.ndarray: ...

    def decoder_layer(self, lw: LayerWeights, x: np.ndarray, ctx: LayerContext) -> LayerResult: ...

    def bind(self, weights: Sequence[Linear]) -> None: ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------------------
# Composite layer (used by numpy, and by native when it has no fused layer entry point)
# ----------------------------------------------------------------------------------------
class _CompositeLayer:
    """``decoder_layer`` and fused-op defaults built from the single ops."""

    name = "composite"

    def bind(self, weights: Sequence[Linear]) -> None:
        return None

    def rmsnorm_quantize(
        self, x: np.ndarray, weight: np.ndarray, eps: float, group: int
    ) -> QuantizedActivations:
        k: Any = self
        return k.quantize_activations(k.rmsnorm(x, weight, eps), group)

    def swiglu_quantize(self, gate: np.ndarray, up: np.ndarray, group: int) -> QuantizedActivations:
        k: Any = self
        return k.quantize_activations(k.swiglu(gate, up), group)

    def decoder_layer(self, lw: LayerWeights, x: np.ndarray, ctx: LayerContext) -> LayerResult:
        k: Any = self
        t = x.shape[0]
        nh, nkv, hd = ctx.num_heads, ctx.num_kv_heads, ctx.head_dim
        act = ctx.act_int8
        inject = ctx.inject_overflow and act

        # attention: norm (+ quantize), q/k/v projections, RoPE, KV write + attend
        qkv = (lw.q, lw.k, lw.v)
        group = lw.qkv_group if act else None
        if group is not None and not inject:
            h_in: Any = k.rmsnorm_quantize(x, lw.attn_norm, ctx.eps, group)
            if h_in.overflow:
                return LayerResult(None, "activation scale overflow (attention input)")
            ins = [h_in] * 3
        else:
            h = k.rmsnorm(x, lw.attn_norm, ctx.eps)
            if inject:
                h = h * INJECT_FACTOR
            ins = _activations(k, h, qkv, act)
            if ins is None:
                return LayerResult(None, "activation scale overflow (attention input)")
        q = k.matmul(ins[0], lw.q).reshape(t, nh, hd)
        kk = k.matmul(ins[1], lw.k).reshape(t, nkv, hd)
        v = k.matmul(ins[2], lw.v).reshape(t, nkv, hd)
        q = k.rope(q, ctx.cos, ctx.sin, ctx.positions)
        kk = k.rope(kk, ctx.cos, ctx.sin, ctx.positions)
        try:
            a = k.attend(q, kk, v, ctx.kv, ctx.block_table, ctx.start)
        except FloatingPointError:
            if act:
                return LayerResult(None, "non-finite K/V")
            raise
        a_in = _activations(k, a, (lw.o,), act)
        if a_in is None:
            return LayerResult(None, "activation scale overflow (attention output)")
        x = k.matmul(a_in[0], lw.o, residual=x)

        # FFN: norm (+ quantize), gate/up, SwiGLU (+ quantize), down
        gu = (lw.gate, lw.up)
        group = lw.gate_up_group if act else None
        if group is not None:
            h_in = k.rmsnorm_quantize(x, lw.ffn_norm, ctx.eps, group)
            if h_in.overflow:
                return LayerResult(None, "activation scale overflow (FFN input)")
            ins = [h_in, h_in]
        else:
            ins = _activations(k, k.rmsnorm(x, lw.ffn_norm, ctx.eps), gu, act)
            if ins is None:
                return LayerResult(None, "activation scale overflow (FFN input)")
        g = k.matmul(ins[0], lw.gate)
        u = k.matmul(ins[1], lw.up)
        if act and lw.down.is_quantized:
            s_in: Any = k.swiglu_quantize(g, u, lw.down.act_group)
            if s_in.overflow:
                return LayerResult(None, "activation scale overflow (FFN hidden)")
        else:
            s_in = k.swiglu(g, u)
        x = k.matmul(s_in, lw.down, residual=x)
        if not np.isfinite(x).all():
            return LayerResult(x, "non-finite layer output")
        return LayerResult(x, None)


def _activations(
    k: Any, x: np.ndarray, lins: Sequence[Linear], act: bool
) -> list[np.ndarray | QuantizedActivations] | None:
    """Each weight's input: ``x`` itself, or ``x`` quantized (once per group); None on overflow."""
    out: list[np.ndarray | QuantizedActivations] = []
    by_group: dict[int, QuantizedActivations] = {}
    for lin in lins:
        if not (act and lin.is_quantized):
            out.append(x)
            continue
        g = lin.act_group
        qa = by_group.get(g)
        if qa is None:
            qa = by_group[g] = k.quantize_activations(x, g)
            if qa.overflow:
                return None
        out.append(qa)
    return out


# ----------------------------------------------------------------------------------------
# numpy
# ----------------------------------------------------------------------------------------
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


class NumpyKernels(_CompositeLayer):
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
    ) -> np.ndarray:
        """Write K/V of positions ``start..start+T-1``, then causal attention over
        ``0..start+T-1``; ``[T, heads * head_dim]``."""
        t = q.shape[0]
        self.kv_write(kv, k, v, block_table, start)
        positions = np.arange(start, start + t, dtype=np.int64)
        return self.attention(q, kv, block_table, start + t, positions)

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
        kq, kd, ok_k = _quantize_k(k)
        vq, vd, ok_v = _quantize_v(v, kv.v_group)
        if not (ok_k and ok_v):
            raise FloatingPointError("non-finite K/V cannot be quantized into the KV cache")
        kv.k[blk, off] = kq
        kv.k_scales[blk, off] = kd
        kv.v[blk, off] = vq
        kv.v_scales[blk, off] = vd

    def read_kv(
        self, kv: LayerKV, block_table: np.ndarray, n: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Dequantized ``K, V: [n, kv_heads, head_dim]`` for cache positions ``0..n-1``."""
        nb = block_table.size
        bs = kv.block_size
        if kv.mode == "float":
            k = kv.k[block_table].reshape(nb * bs, *kv.k.shape[2:])[:n]
            v = kv.v[block_table].reshape(nb * bs, *kv.v.shape[2:])[:n]
            return k, v
        kc = kv.k[block_table].reshape(nb * bs, *kv.k.shape[2:])[:n]
        ks = kv.k_scales[block_table].reshape(nb * bs, -1)[:n]
        k = kc.astype(_F32)
        k *= ks[:, :, None]
        vc = kv.v[block_table].reshape(nb * bs, *kv.v.shape[2:])[:n]
        vs = kv.v_scales[block_table].reshape(nb * bs, *kv.v_scales.shape[2:])[:n]
        h, half = vc.shape[1], vc.shape[2]
        nib = np.empty((n, h, half, 2), np.uint8)
        np.bitwise_and(vc, 0x0F, out=nib[..., 0])
        np.right_shift(vc, 4, out=nib[..., 1])
        g = kv.v_group
        v = nib.reshape(n, h, (2 * half) // g, g).astype(_F32)
        v -= _F32(8)
        v *= vs[..., None]
        return k, v.reshape(n, h, 2 * half)

    def attention(
        self,
        q: np.ndarray,
        kv: LayerKV,
        block_table: np.ndarray,
        n_ctx: int,
        positions: np.ndarray,
    ) -> np.ndarray:
        t, nh, hd = q.shape
        k, v = self.read_kv(kv, block_table, n_ctx)
        nkv = k.shape[1]
        rep = nh // nkv
        qh = q.reshape(t, nkv, rep, hd).transpose(1, 2, 0, 3).reshape(nkv, rep * t, hd)
        scores = np.matmul(qh, k.transpose(1, 2, 0))  # [nkv, rep*t, n]
        scores *= _F32(1.0 / np.sqrt(hd))
        if t > 1 or int(positions[-1]) != n_ctx - 1:
            pos = np.tile(positions, rep)  # row r*t + i is query i
            mask = np.arange(n_ctx)[None, :] > pos[:, None]
            scores[:, mask] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out = np.matmul(scores, v.transpose(1, 0, 2))  # [nkv, rep*t, hd]
        return np.ascontiguousarray(
            out.reshape(nkv, rep, t, hd).transpose(2, 0, 1, 3).reshape(t, nh * hd)
        )


def _quantize_k(k: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    with np.errstate(all="ignore"):
        absmax = np.max(np.abs(k), axis=-1)
        ok = bool(np.isfinite(absmax).all())
        d = (absmax / _F32(127)).astype(_F32)
        inv = np.divide(_F32(1), d, out=np.zeros_like(d), where=d != 0)
        q = k * inv[..., None]
        np.rint(q, out=q)
        np.clip(q, -127, 127, out=q)
        q = np.nan_to_num(q, nan=0.0)
    return q.astype(np.int8), d, ok


def _quantize_v(v: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, bool]:
    t, h, d = v.shape
    vg = v.reshape(t, h, d // group, group)
    with np.errstate(all="ignore"):
        idx = np.abs(vg).argmax(axis=-1)
        peak = np.take_along_axis(vg, idx[..., None], axis=-1)[..., 0]
        ok = bool(np.isfinite(peak).all() and np.isfinite(v).all())
        scale = (peak / _F32(-8)).astype(_F32) + _F32(0)
        inv = np.divide(_F32(1), scale, out=np.zeros_like(scale), where=scale != 0)
        q = vg * inv[..., None]
        np.rint(q, out=q)
        np.clip(q, -8, 7, out=q)
        q = np.nan_to_num(q, nan=0.0)
    nib = (q + 8).astype(np.uint8).reshape(t, h, d)
    packed = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return packed, scale, ok


# ----------------------------------------------------------------------------------------
# native adapter
# ----------------------------------------------------------------------------------------
# Native function -> the op it serves. An op is native when all its functions exist.
_NATIVE_FUNCS = {
    "rmsnorm": ("rmsnorm",),
    "rmsnorm_quantize": ("rmsnorm_quant",),
    "quantize_activations": ("quantize_act",),
    "matmul": ("Weight", "linear_f32", "linear_q8"),
    "swiglu": ("swiglu",),
    "swiglu_quantize": ("swiglu_quant",),
    "rope": ("rope",),
    "attend": ("attention_prefill", "attention_decode"),
}


class NativeKernels(_CompositeLayer):
    """``edgepack.native._kernels`` where it has the op, numpy for the rest.

    Uses (native/src/infer/bind_infer.cpp): ``Weight(codes, scales, zeros, encoding,
    group)`` bound once per matrix at open, ``linear_f32(x, w, residual, bias=)``,
    ``linear_q8(q, s, act_group, w, residual, bias=)``, ``lowrank(x, u, v, residual,
    bias=)``, ``quantize_act(x, group)``, ``rmsnorm(x, w, eps)``, ``rmsnorm_quant(x, w,
    eps, group)``, ``swiglu(g, u)``, ``swiglu_quant(g, u, group)``, ``rope(x, positions,
    cos=, sin=)`` (in place), ``attention_prefill`` / ``attention_decode(q, k, v, k_cache,
    k_scale, v_cache, v_scale, block_table, start)`` (KV write fused with attention),
    ``set_threads(n)``; quantizing ops raise ``NumericError`` (a ``FloatingPointError``).
    A whole-layer ``decoder_layer(layer, x, ctx) -> (x_out | None, reason | None)`` is
    used when present. An op whose call fails with a TypeError (an API mismatch) is
    switched to numpy for good, with one warning.
    """

    def __init__(self, module: Any, threads: int | None = None) -> None:
        self.mod = module
        self.numpy = NumpyKernels(threads)
        self.threads = self.numpy.threads
        if hasattr(module, "set_threads"):
            module.set_threads(self.threads)
        isa = module.active_isa() if hasattr(module, "active_isa") else "?"
        self.native_ops = {
            op for op, funcs in _NATIVE_FUNCS.items() if all(hasattr(module, f) for f in funcs)
        }
        self.missing = [op for op in KERNEL_OPS if op not in self.native_ops]
        self.isa = isa
        self._fused_layer = hasattr(module, "decoder_layer")
        self._warned: set[str] = set()
        self.partial_matmul = False  # some weights could not be bound natively

    @property
    def name(self) -> str:  # type: ignore[override]
        name = f"native:{self.isa}"
        if self.missing:
            name += " (numpy: " + ", ".join(self.missing) + ")"
        return name

    @property
    def implements_any(self) -> bool:
        return bool(self.native_ops)

    def close(self) -> None:
        self.numpy.close()

    def _drop(self, op: str, exc: BaseException) -> None:
        self.native_ops.discard(op)
        if op not in self.missing:
            self.missing.append(op)
        if op not in self._warned:
            self._warned.add(op)
            _log.warning("native %s failed (%s): using numpy for it from now on", op, exc)

    def bind(self, weights: Sequence[Linear]) -> None:
        """Bind each weight once; one the extension cannot take stays on numpy."""
        if "matmul" not in self.native_ops:
            return
        unbound: dict[str, int] = {}
        for lin in weights:
            for p in lin.factors if lin.factors is not None else (lin,):
                if p.native is not None:
                    continue
                try:
                    codes, enc = _native_codes(p)
                    p.native = self.mod.Weight(codes, p.scales, p.zeros, int(enc), p.group_size)
                except (TypeError, ValueError):
                    name = p.encoding.name.lower()
                    unbound[name] = unbound.get(name, 0) + 1
        if unbound:
            what = ", ".join(f"{n} ({c} weights)" for n, c in sorted(unbound.items()))
            _log.warning("native matmul lacks %s: numpy for those weights", what)
            self.partial_matmul = True

    # -- ops ------------------------------------------------------------------------------------
    def rmsnorm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        if "rmsnorm" in self.native_ops:
            try:
                return self.mod.rmsnorm(x, weight, float(eps))
            except TypeError as exc:
                self._drop("rmsnorm", exc)
        return self.numpy.rmsnorm(x, weight, eps)

    def quantize_activations(self, x: np.ndarray, group: int) -> QuantizedActivations:
        if "quantize_activations" in self.native_ops:
            try:
                q, s = self.mod.quantize_act(x, group)
            except FloatingPointError:
                return _overflowed(group)
            except TypeError as exc:
                self._drop("quantize_activations", exc)
            else:
                return QuantizedActivations(q, s, group, _scale_overflow(s))
        return self.numpy.quantize_activations(x, group)

    def rmsnorm_quantize(
        self, x: np.ndarray, weight: np.ndarray, eps: float, group: int
    ) -> QuantizedActivations:
        if "rmsnorm_quantize" in self.native_ops:
            try:
                q, s = self.mod.rmsnorm_quant(x, weight, eps, group)
            except FloatingPointError:
                return _overflowed(group)
            except TypeError as exc:
                self._drop("rmsnorm_quantize", exc)
            else:
                return QuantizedActivations(q, s, group, _scale_overflow(s))
        return super().rmsnorm_quantize(x, weight, eps, group)

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        if "swiglu" in self.native_ops:
            try:
                return self.mod.swiglu(gate, up)
            except TypeError as exc:
                self._drop("swiglu", exc)
        return self.numpy.swiglu(gate, up)

    def swiglu_quantize(self, gate: np.ndarray, up: np.ndarray, group: int) -> QuantizedActivations:
        if "swiglu_quantize" in self.native_ops:
            try:
                q, s = self.mod.swiglu_quant(gate, up, group)
            except FloatingPointError:
                return _overflowed(group)
            except TypeError as exc:
                self._drop("swiglu_quantize", exc)
            else:
                return QuantizedActivations(q, s, group, _scale_overflow(s))
        return super().swiglu_quantize(gate, up, group)

    def matmul(
        self,
        x: np.ndarray | QuantizedActivations,
        w: Linear,
        residual: np.ndarray | None = None,
    ) -> np.ndarray:
        if "matmul" in self.native_ops and _bound(w):
            try:
                return self._matmul(x, w, residual)
            except TypeError as exc:
                self._drop("matmul", exc)
        return self.numpy.matmul(x, w, residual)

    def _matmul(
        self, x: np.ndarray | QuantizedActivations, w: Linear, residual: np.ndarray | None
    ) -> np.ndarray:
        res = None if residual is None else _c32(residual)
        if w.factors is not None:
            u, v = w.factors
            xf = x.dequantize() if isinstance(x, QuantizedActivations) else _c32(x)
            return self.mod.lowrank(xf, u.native, v.native, res, bias=w.bias)
        if isinstance(x, QuantizedActivations) and w.is_quantized:
            return self.mod.linear_q8(x.q, x.scales, x.group, w.native, res, bias=w.bias)
        xf = x.dequantize() if isinstance(x, QuantizedActivations) else _c32(x)
        return self.mod.linear_f32(xf, w.native, res, bias=w.bias)

    def rope(
        self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray
    ) -> np.ndarray:
        if "rope" in self.native_ops:
            try:
                if not (x.flags.c_contiguous and x.flags.writeable and x.dtype == _F32):
                    x = np.array(x, _F32, order="C")
                # rotated in place (matmul outputs are fresh); cos/sin rows are per token
                self.mod.rope(x, _rows(x.shape[0]), cos=cos, sin=sin)
                return x
            except TypeError as exc:
                self._drop("rope", exc)
        return self.numpy.rope(x, cos, sin, positions)

    def attend(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        kv: LayerKV,
        block_table: np.ndarray,
        start: int,
    ) -> np.ndarray:
        if "attend" in self.native_ops and (kv.mode == "float" or kv.v_group == 32):
            t, nh, hd = q.shape
            try:
                if t == 1:
                    out = self.mod.attention_decode(
                        _c32(q)[0], _c32(k)[0], _c32(v)[0], kv.k, kv.k_scales, kv.v,
                        kv.v_scales, block_table, int(start),
                    )  # fmt: skip
                else:
                    out = self.mod.attention_prefill(
                        _c32(q), _c32(k), _c32(v), kv.k, kv.k_scales, kv.v, kv.v_scales,
                        block_table, int(start),
                    )  # fmt: skip
                return out.reshape(t, nh * hd)
            except TypeError as exc:
                self._drop("attend", exc)
        return self.numpy.attend(q, k, v, kv, block_table, start)

    def decoder_layer(self, lw: LayerWeights, x: np.ndarray, ctx: LayerContext) -> LayerResult:
        if not ctx.inject_overflow:
            if self._fused_layer and all(_bound(lin) for lin in lw.linears):
                out, reason = self.mod.decoder_layer(lw, x, ctx)
                return LayerResult(out, reason)
            if self._can_inline(lw, ctx):
                return self._inline_layer(lw, x, ctx)
        return super().decoder_layer(lw, x, ctx)

    _INLINE_OPS = frozenset(KERNEL_OPS)

    def _can_inline(self, lw: LayerWeights, ctx: LayerContext) -> bool:
        """Every op native, plain (not low-rank) weights, one activation group per input."""
        if not self._INLINE_OPS <= self.native_ops:
            return False
        if ctx.kv.mode != "float" and ctx.kv.v_group != 32:
            return False
        if any(lin.factors is not None or not _bound(lin) for lin in lw.linears):
            return False
        if ctx.act_int8:
            quantized = [lin.is_quantized for lin in lw.linears]
            if not all(quantized):
                return False
            return lw.qkv_group is not None and lw.gate_up_group is not None
        return True

    def _inline_layer(self, lw: LayerWeights, x: np.ndarray, ctx: LayerContext) -> LayerResult:
        """The composite layer calling the extension directly (fewer Python frames)."""
        mod = self.mod
        t = x.shape[0]
        nh, nkv, hd, eps = ctx.num_heads, ctx.num_kv_heads, ctx.head_dim, ctx.eps
        kv = ctx.kv
        rows = _rows(t)
        try:
            if ctx.act_int8:
                g = lw.qkv_group
                hq, hs = mod.rmsnorm_quant(x, lw.attn_norm, eps, g)
                if _scale_overflow(hs):
                    return LayerResult(None, "activation scale overflow (attention input)")
                q = mod.linear_q8(hq, hs, g, lw.q.native, None, bias=lw.q.bias)
                k = mod.linear_q8(hq, hs, g, lw.k.native, None, bias=lw.k.bias)
                v = mod.linear_q8(hq, hs, g, lw.v.native, None, bias=lw.v.bias)
            else:
                h = mod.rmsnorm(x, lw.attn_norm, eps)
                q = mod.linear_f32(h, lw.q.native, None, bias=lw.q.bias)
                k = mod.linear_f32(h, lw.k.native, None, bias=lw.k.bias)
                v = mod.linear_f32(h, lw.v.native, None, bias=lw.v.bias)
            q = q.reshape(t, nh, hd)
            k = k.reshape(t, nkv, hd)
            v = v.reshape(t, nkv, hd)
            mod.rope(q, rows, cos=ctx.cos, sin=ctx.sin)
            mod.rope(k, rows, cos=ctx.cos, sin=ctx.sin)
            if t == 1:
                a = mod.attention_decode(
                    q[0], k[0], v[0], kv.k, kv.k_scales, kv.v, kv.v_scales,
                    ctx.block_table, ctx.start,
                )  # fmt: skip
            else:
                a = mod.attention_prefill(
                    q, k, v, kv.k, kv.k_scales, kv.v, kv.v_scales, ctx.block_table, ctx.start
                )
            a = a.reshape(t, nh * hd)
            if ctx.act_int8:
                go = lw.o.act_group
                aq, as_ = mod.quantize_act(a, go)
                if _scale_overflow(as_):
                    return LayerResult(None, "activation scale overflow (attention output)")
                x = mod.linear_q8(aq, as_, go, lw.o.native, x)
                g = lw.gate_up_group
                hq, hs = mod.rmsnorm_quant(x, lw.ffn_norm, eps, g)
                if _scale_overflow(hs):
                    return LayerResult(None, "activation scale overflow (FFN input)")
                gate = mod.linear_q8(hq, hs, g, lw.gate.native, None)
                up = mod.linear_q8(hq, hs, g, lw.up.native, None)
                gd = lw.down.act_group
                sq, ss = mod.swiglu_quant(gate, up, gd)
                if _scale_overflow(ss):
                    return LayerResult(None, "activation scale overflow (FFN hidden)")
                x = mod.linear_q8(sq, ss, gd, lw.down.native, x)
            else:
                x = mod.linear_f32(a, lw.o.native, x)
                h = mod.rmsnorm(x, lw.ffn_norm, eps)
                gate = mod.linear_f32(h, lw.gate.native, None)
                up = mod.linear_f32(h, lw.up.native, None)
                x = mod.linear_f32(mod.swiglu(gate, up), lw.down.native, x)
        except FloatingPointError as exc:
            if ctx.act_int8:
                return LayerResult(None, f"non-finite value ({getattr(exc, 'op', 'native')})")
            raise
        if not np.isfinite(x).all():
            return LayerResult(x, "non-finite layer output")
        return LayerResult(x, None)


def _native_codes(p: Linear) -> tuple[np.ndarray, Encoding]:
    """Codes and encoding to bind natively. int3/int2 codes are widened to int4 nibbles
    once (same scales and mins, so every decoded value is identical) to run on the int4
    kernels: 4 bits of memory per weight instead of 3 or 2, against about 50x the speed
    of their numpy path."""
    enc = p.encoding
    if not enc.is_group or enc.bits == 4:
        return p.codes, enc
    q = codecs.unpack_codes(p.codes, enc.bits)
    if enc.is_symmetric:  # (c - 2^(b-1)) * d == ((c + 8 - 2^(b-1)) - 8) * d
        q += np.uint8(8 - (1 << (enc.bits - 1)))
    return codecs.pack_nibbles(q), Encoding.group(4, enc.is_symmetric)


def _overflowed(group: int) -> QuantizedActivations:
    return QuantizedActivations(np.zeros((0, 0), np.int8), np.zeros((0, 0), _F32), group, True)


def _scale_overflow(scales: np.ndarray) -> bool:
    return bool(scales.size) and float(scales.max()) > ACT_SCALE_MAX


def _bound(w: Linear) -> bool:
    if w.factors is not None:
        return all(f.native is not None for f in w.factors)
    return w.native is not None


def _c32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, _F32)


_ROWS = np.arange(512, dtype=np.int64)


def _rows(n: int) -> np.ndarray:
    global _ROWS
    if n > _ROWS.size:
        _ROWS = np.arange(max(n, 2 * _ROWS.size), dtype=np.int64)
    return _ROWS[:n]


# ----------------------------------------------------------------------------------------
# selection
# ----------------------------------------------------------------------------------------
def select_kernels(choice: str | None = None, threads: int | None = None) -> Kernels:
    """``choice``: ``"numpy"``, ``"native"`` or None (``$EDGEPACK_KERNELS``, else auto)."""
    from edgepack import native

    requested = (choice or os.environ.get(ENV_VAR, "") or "auto").strip().lower()
    if requested not in ("auto", "numpy", "native"):
        raise ValueError(f"kernels must be 'numpy', 'native' or 'auto', got {requested!r}")
    if requested == "numpy":
        _log.info("kernels: numpy (forced by %s)", "argument" if choice else f"{ENV_VAR}=numpy")
        return NumpyKernels(threads)
    saved = os.environ.get(ENV_VAR)
    if saved is not None and saved.strip().lower() == "numpy":
        os.environ.pop(ENV_VAR)  # an explicit native choice overrides the variable
    try:
        mod = native.load()
    finally:
        if saved is not None:
            os.environ[ENV_VAR] = saved
    if mod is None:
        if requested == "native":
            raise KernelUnavailableError(
                "native kernels requested but the extension is not available "
                "(build it with `pip install -e .`, or use EDGEPACK_KERNELS=numpy)"
            )
        _log.info("kernels: numpy (native extension unavailable)")
        return NumpyKernels(threads)
    nk = NativeKernels(mod, threads)
    if not nk.implements_any:
        if requested == "native":
            raise KernelUnavailableError(
                "native kernels requested but the extension provides no runtime ops "
                f"(it has: {', '.join(sorted(n for n in dir(mod) if not n.startswith('_')))})"
            )
        nk.close()
        _log.info("kernels: numpy (native extension has no runtime kernels yet)")
        return NumpyKernels(threads)
    if nk.missing:
        _log.warning("native kernels lack %s: using numpy for those ops", ", ".join(nk.missing))
    _log.info("kernels: %s", nk.name)
    return nk


def with_float_activations(ctx: LayerContext) -> LayerContext:
    return replace(ctx, act_int8=False, inject_overflow=False)

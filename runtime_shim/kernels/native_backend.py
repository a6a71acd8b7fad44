"""The native backend: ``edgepack.native._kernels`` for each op it provides, numpy for
the rest (one warning naming them); a whole decoder layer per call when it can."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from edgepack.format import Encoding, codecs

from ..errors import NumericError
from ..kv_cache import KV_LAYOUTS, LayerKV
from ..weights import LayerWeights, Linear, ModelWeights
from .fallback import Fallback, NativeGap
from .interface import (
    ACT_SCALE_MAX,
    KERNEL_OPS,
    LayerContext,
    LayerResult,
    QuantizedActivations,
    StackResult,
)
from .layer import CompositeLayer
from .numpy_backend import NumpyKernels

if TYPE_CHECKING:
    from ..adapters import LayerLora

__all__ = ["NativeKernels"]

_log = logging.getLogger("edgepack.runtime")
_F32 = np.float32

_NATIVE_FUNCS = {
    "rmsnorm": ("rmsnorm",),
    "rmsnorm_quantize": ("rmsnorm_quant",),
    "quantize_activations": ("quantize_act",),
    "matmul": ("Weight", "linear_f32", "linear_q8"),
    "swiglu": ("swiglu",),
    "swiglu_quantize": ("swiglu_quant",),
    "rope": ("rope",),
    "attend": ("attention_prefill", "attention_decode"),
    "gated_activation": ("gated_act",),
}


class NativeKernels(CompositeLayer):
    """``edgepack.native._kernels`` where it has the op, numpy for the rest.

    Uses (native/src/infer/bind_infer.cpp): ``Weight(codes, scales, zeros, encoding,
    group)`` bound once per matrix at open, ``linear_f32(x, w, residual, bias=)``,
    ``linear_q8(q, s, act_group, w, residual, bias=)``, ``lowrank(x, u, v, residual,
    bias=)``, ``quantize_act(x, group)``, ``rmsnorm(x, w, eps)``, ``rmsnorm_quant(x, w,
    eps, group)``, ``swiglu(g, u)``, ``swiglu_quant(g, u, group)``, ``rope(x, positions,
    cos=, sin=)`` (in place), ``attention_prefill`` / ``attention_decode(q, k, v, k_cache,
    k_scale, v_cache, v_scale, block_table, start, scale=, v_high=, v_mins=, rotate=,
    window=, softcap=)`` (KV write fused with attention), ``gated_act(g, u, act)`` (GELU,
    tanh-GELU, ReLU), ``set_threads(n)``; quantizing ops raise
    :class:`~edgepack.runtime_shim.errors.NumericError`.
    A whole-layer ``decoder_layer(layer, x, ctx) -> (x_out | None, reason | None)`` is
    used when present, and ``Stack`` (every layer, final norm and head in one call) for
    :meth:`decoder_stack`. An op whose call fails with a TypeError (an API mismatch) is
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
        self._fused_lora = bool(getattr(module, "DECODER_LAYER_LORA", False))
        self._fused_stack = hasattr(module, "Stack")
        self._stacks: dict[int, tuple[ModelWeights, Any]] = {}
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

    def layer_arena(self, nbytes: int, plans: list[tuple[int, dict[str, tuple[int, int]]]]) -> Any:
        """The extension's ``LayerArena`` (a layer's ``ctx.arena``) of ``nbytes`` with the
        memory plans ``[(tokens, {slot: (offset, size)})]``; None when it has none."""
        if not (self._fused_layer and hasattr(self.mod, "LayerArena")):
            return None
        return self.mod.LayerArena(nbytes, plans)

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

    def _quantized(self, op: str, func: str, group: int, *args: Any) -> QuantizedActivations | None:
        """``mod.func(*args, group)`` as activations (overflowed on NumericError); None when
        the op is not (or no longer) native."""
        if op not in self.native_ops:
            return None
        try:
            q, s = getattr(self.mod, func)(*args, group)
        except NumericError:
            return _overflowed(group)
        except TypeError as exc:
            self._drop(op, exc)
            return None
        return QuantizedActivations(q, s, group, _scale_overflow(s))

    def quantize_activations(self, x: np.ndarray, group: int) -> QuantizedActivations:
        qa = self._quantized("quantize_activations", "quantize_act", group, x)
        return self.numpy.quantize_activations(x, group) if qa is None else qa

    def rmsnorm_quantize(
        self, x: np.ndarray, weight: np.ndarray, eps: float, group: int
    ) -> QuantizedActivations:
        qa = self._quantized("rmsnorm_quantize", "rmsnorm_quant", group, x, weight, eps)
        return super().rmsnorm_quantize(x, weight, eps, group) if qa is None else qa

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        if "swiglu" in self.native_ops:
            try:
                return self.mod.swiglu(gate, up)
            except TypeError as exc:
                self._drop("swiglu", exc)
        return self.numpy.swiglu(gate, up)

    def swiglu_quantize(self, gate: np.ndarray, up: np.ndarray, group: int) -> QuantizedActivations:
        qa = self._quantized("swiglu_quantize", "swiglu_quant", group, gate, up)
        return super().swiglu_quantize(gate, up, group) if qa is None else qa

    def gated_activation(self, gate: np.ndarray, up: np.ndarray, act: str) -> np.ndarray:
        if "gated_activation" in self.native_ops:
            try:
                return self.mod.gated_act(_c32(gate), _c32(up), act)
            except TypeError as exc:
                self._drop("gated_activation", exc)
        return self.numpy.gated_activation(gate, up, act)

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
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> np.ndarray:
        native = _native_kv_shape(kv, q.shape[2]) and self._native_kv(kv)
        if "attend" in self.native_ops and native:
            t, nh, hd = q.shape
            try:
                high = getattr(kv, "v_high", None)  # the int5 V layout's extra planes
                opts: dict[str, Any] = {} if high is None else {"v_high": high, "v_mins": kv.v_mins}
                if _rotated(kv):
                    opts["rotate"] = True
                if window is not None:
                    opts["window"] = int(window)
                if softcap is not None:
                    opts["softcap"] = float(softcap)
                if scale is not None:
                    opts["scale"] = float(scale)
                if t == 1:
                    out = self.mod.attention_decode(
                        _c32(q)[0], _c32(k)[0], _c32(v)[0], kv.k, kv.k_scales, kv.v,
                        kv.v_scales, block_table, int(start), **opts,
                    )  # fmt: skip
                else:
                    out = self.mod.attention_prefill(
                        _c32(q), _c32(k), _c32(v), kv.k, kv.k_scales, kv.v, kv.v_scales,
                        block_table, int(start), **opts,
                    )  # fmt: skip
                return out.reshape(t, nh * hd)
            except TypeError as exc:
                self._drop("attend", exc)
        return self.numpy.attend(q, k, v, kv, block_table, start, window, scale, softcap)

    def decoder_layer(self, lw: LayerWeights, x: np.ndarray, ctx: LayerContext) -> LayerResult:
        """The extension's whole layer when it has one, every weight is bound, the KV
        layout is the native kernels' and the layer needs nothing they lack
        (:class:`NativeGap`, logged once each); else the shared chain (:mod:`.layer`) over
        this backend's ops."""
        if (
            not ctx.inject_overflow
            and self._fused_layer
            and self._native_kv(ctx.kv)
            and all(_bound(lin) for lin in lw.linears)
        ):
            gap = _native_gap(lw, ctx)
            if gap is None and getattr(ctx, "lora", None) is not None and not self._fused_lora:
                gap = NativeGap.ADAPTER
            if gap is None:
                out, reason = self.mod.decoder_layer(lw, x, ctx)
                if reason != Fallback.KV_LAYOUT.value:
                    return LayerResult(out, None if reason is None else Fallback(reason))
                self._kv_on_numpy(ctx.kv)
            elif gap not in self._warned:
                self._warned.add(gap)
                _log.info("native whole layer not used: %s", gap)
        return super().decoder_layer(lw, x, ctx)

    def decoder_stack(
        self,
        weights: ModelWeights,
        x: np.ndarray,
        ctx: LayerContext,
        kvs: Sequence[LayerKV],
        windows: Sequence[int | None],
        head: bool,
        loras: Sequence[LayerLora | None] | None = None,
        rows: int = 1,
        picks: np.ndarray | None = None,
    ) -> StackResult | None:
        """The extension's one-call forward (every layer, final norm, head of the last
        ``rows`` rows, the GIL released once) over ``weights`` read once, when every layer
        would take its whole layer; a layer that asks for a fallback ends it there and the
        caller's chain goes on from it. ``loras``: the session's adapter per layer (read
        per call). ``picks`` (int64 ``[rows]``) receives each head row's float32 argmax
        when the head ran. Injected overflows go layer by layer."""
        if not self._fused_layer or ctx.inject_overflow:
            return None
        if not (kvs and self._native_kv(kvs[0]) and _native_kv_shape(kvs[0], ctx.head_dim)):
            return None
        stack = self._stack(weights, ctx)
        if stack is None:
            return None
        out, done, _reason, logits = stack.run(x, ctx, kvs, windows, head, loras, rows, picks)
        return StackResult(out, done, logits)

    def _stack(self, weights: ModelWeights, ctx: LayerContext) -> Any:
        """The extension's Stack over ``weights``, made on first use (reading the bound
        weights, nothing copied); None when some layer is not fully bound natively."""
        key = id(weights)
        if key not in self._stacks:
            layers = weights.layers
            ready = self._fused_stack and all(_bound(lin) for lw in layers for lin in lw.linears)
            head = weights.output if _bound(weights.output) else None
            stack = self.mod.Stack(layers, ctx, weights.norm, ctx.eps, head) if ready else None
            self._stacks[key] = (weights, stack)  # the weights kept: the id stays theirs
        return self._stacks[key][1]

    def _native_kv(self, kv: LayerKV) -> bool:
        """The native attention implements this layer's KV layout (V groups of 8k)."""
        layout = KV_LAYOUTS.get(kv.mode)
        if kv.mode == "float" or (layout is not None and layout.native and kv.v_group % 8 == 0):
            return True
        self._kv_on_numpy(kv)
        return False

    def _kv_on_numpy(self, kv: LayerKV) -> None:
        """Attention of ``kv`` runs on numpy from now on (one warning with the reason)."""
        key = f"kv:{kv.mode}/{kv.v_group}"
        if key not in self._warned:
            self._warned.add(key)
            _log.warning(
                "%s (kv %s, V group %d): attention on numpy",
                Fallback.KV_LAYOUT, kv.mode, kv.v_group,
            )  # fmt: skip


def _native_kv_shape(kv: LayerKV, head_dim: int) -> bool:
    """The native attention reads this cache's shape: float, or quantized V in groups of a
    multiple of 8 dividing head_dim (the layout is :meth:`NativeKernels._native_kv`'s)."""
    return kv.mode == "float" or (kv.v_group % 8 == 0 and head_dim % kv.v_group == 0)


def _rotated(kv: LayerKV) -> bool:
    layout = KV_LAYOUTS.get(kv.mode)
    return layout is not None and layout.rotate


def _native_gap(lw: LayerWeights, ctx: LayerContext) -> NativeGap | None:
    """What the native whole layer lacks for this call. Activations, sliding windows, score
    scale and soft-capping, q/k and sandwich norms are native; a quantized V group that is
    not a multiple of 8 (a legacy cache at an odd head_dim) is not."""
    if not _native_kv_shape(ctx.kv, ctx.head_dim):
        return NativeGap.KV_GROUP
    return None


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


"""The decoder-layer sequence, written once in Python.

:class:`CompositeLayer` chains the single ops of a backend into ``decoder_layer``
(attention: RMSNorm (+ quantize), q/k/v, RoPE, KV write + attend, o + residual; FFN:
RMSNorm (+ quantize), gate/up, ``act(gate) * up`` (+ quantize), down + residual; the
model's activation is SiLU (SwiGLU), GELU, tanh-GELU or ReLU; qwen3's q/k head norms sit
before RoPE; a sliding window masks keys older than ``ctx.window``), with fused
``rmsnorm_quantize`` / ``swiglu_quantize`` where one activation group serves every
consumer. The numpy backend runs it as is; the native backend runs it over its own ops
whenever its whole-layer entry point (the same sequence in C++, native/src/infer/layer.cpp)
cannot take the call. Both report a :class:`~.fallback.Fallback` for the model to
recompute the layer with float activations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import NumericError
from ..weights import LayerWeights, Linear
from .fallback import Fallback
from .interface import INJECT_FACTOR, LayerContext, LayerResult, QuantizedActivations

if TYPE_CHECKING:
    from ..adapters import LayerLora

__all__ = ["CompositeLayer"]


class CompositeLayer:
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

    def _gated(self, gate: np.ndarray, up: np.ndarray, act: str) -> np.ndarray:
        k: Any = self
        return k.swiglu(gate, up) if act == "silu" else k.gated_activation(gate, up, act)

    def _gated_quantize(
        self, gate: np.ndarray, up: np.ndarray, act: str, group: int
    ) -> QuantizedActivations:
        k: Any = self
        if act == "silu":
            return k.swiglu_quantize(gate, up, group)
        return k.quantize_activations(k.gated_activation(gate, up, act), group)

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
                return LayerResult(None, Fallback.ATTENTION_INPUT)
            ins = [h_in] * 3
        else:
            h = k.rmsnorm(x, lw.attn_norm, ctx.eps)
            if inject:
                h = h * INJECT_FACTOR
            ins = _activations(k, h, qkv, act)
            if ins is None:
                return LayerResult(None, Fallback.ATTENTION_INPUT)
        lora = getattr(ctx, "lora", None)  # contexts made before adapters lack it
        q = _adapted(k.matmul(ins[0], lw.q), lora, "q", ins[0]).reshape(t, nh, hd)
        kk = _adapted(k.matmul(ins[1], lw.k), lora, "k", ins[1]).reshape(t, nkv, hd)
        v = _adapted(k.matmul(ins[2], lw.v), lora, "v", ins[2]).reshape(t, nkv, hd)
        if lw.q_norm is not None and lw.k_norm is not None:  # per-head RMSNorm (qwen3)
            q = k.rmsnorm(q.reshape(t * nh, hd), lw.q_norm, ctx.eps).reshape(t, nh, hd)
            kk = k.rmsnorm(kk.reshape(t * nkv, hd), lw.k_norm, ctx.eps).reshape(t, nkv, hd)
        q = k.rope(q, ctx.cos, ctx.sin, ctx.positions)
        kk = k.rope(kk, ctx.cos, ctx.sin, ctx.positions)
        try:
            a = k.attend(
                q, kk, v, ctx.kv, ctx.block_table, ctx.start,
                window=ctx.window, scale=ctx.attn_scale, softcap=ctx.attn_softcap,
            )  # fmt: skip
        except NumericError:
            if act:
                return LayerResult(None, Fallback.NON_FINITE_KV)
            raise
        a_in = _activations(k, a, (lw.o,), act)
        if a_in is None:
            return LayerResult(None, Fallback.ATTENTION_OUTPUT)
        o_delta = None if lora is None else lora.delta("o", a_in[0])
        x = _project_add(k, a_in[0], lw.o, x, lw.attn_post_norm, ctx.eps, o_delta)

        # FFN: norm (+ quantize), gate/up, SwiGLU (+ quantize), down
        gu = (lw.gate, lw.up)
        group = lw.gate_up_group if act else None
        if group is not None:
            h_in = k.rmsnorm_quantize(x, lw.ffn_norm, ctx.eps, group)
            if h_in.overflow:
                return LayerResult(None, Fallback.FFN_INPUT)
            ins = [h_in, h_in]
        else:
            ins = _activations(k, k.rmsnorm(x, lw.ffn_norm, ctx.eps), gu, act)
            if ins is None:
                return LayerResult(None, Fallback.FFN_INPUT)
        g = _adapted(k.matmul(ins[0], lw.gate), lora, "gate", ins[0])
        u = _adapted(k.matmul(ins[1], lw.up), lora, "up", ins[1])
        if act and lw.down.is_quantized:
            s_in: Any = self._gated_quantize(g, u, ctx.activation, lw.down.act_group)
            if s_in.overflow:
                return LayerResult(None, Fallback.FFN_HIDDEN)
        else:
            s_in = self._gated(g, u, ctx.activation)
        down_delta = None if lora is None else lora.delta("down", s_in)
        x = _project_add(k, s_in, lw.down, x, lw.ffn_post_norm, ctx.eps, down_delta)
        if not np.isfinite(x).all():
            return LayerResult(x, Fallback.NON_FINITE_OUTPUT)
        return LayerResult(x, None)


def _project_add(
    k: Any,
    a: Any,
    w: Linear,
    x: np.ndarray,
    post_norm: np.ndarray | None,
    eps: float,
    delta: np.ndarray | None = None,
) -> np.ndarray:
    """``x + a @ w (+ delta)``, the projection (with an adapter's ``delta``) RMS-normed
    first where the model has sandwich norms."""
    if post_norm is None:
        out = k.matmul(a, w, residual=x)
        return out if delta is None else out + delta
    y = k.matmul(a, w)
    return x + k.rmsnorm(y if delta is None else y + delta, post_norm, eps)


def _adapted(y: np.ndarray, lora: LayerLora | None, slot: str, x: Any) -> np.ndarray:
    """``y`` plus the session adapter's ``s * B A x`` where it adapts this projection."""
    if lora is None:
        return y
    delta = lora.delta(slot, x)
    return y if delta is None else y + delta


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


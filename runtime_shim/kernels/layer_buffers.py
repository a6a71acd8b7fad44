"""The buffers of the native decoder layer and when each is live: the memory planner's input.

native/src/infer/layer.cpp takes each buffer from a named slot (layer_arena.h names them;
``LayerArena.SLOTS`` lists them) during the steps of :data:`STEPS`. This module says which
slots a model's layers take, how many bytes each needs for ``tokens`` tokens, and the
steps over which it is live; :func:`~..memory_plan.plan` turns that into offsets. A slot
the layer takes that is missing here, or too small, is refused by the layer (ValueError);
one live longer than said here would corrupt a planned run, which the reuse-off
comparison test catches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..memory_plan import BufferSpec
from ..weights import LayerWeights, Linear

__all__ = ["STEPS", "LayerShape", "layer_buffers"]

# The layer chain's steps, in order (layer.cpp Runner::run).
STEPS = ("attn_norm", "qkv", "attention", "o", "ffn_norm", "gate_up", "act", "down")
_S = {name: i for i, name in enumerate(STEPS)}
_F32, _I8 = 4, 1

# each linear: the steps its quantized input is live over, and the step that applies it
_LINEAR_STEPS = {
    "q": ("attn_norm", "qkv"), "k": ("attn_norm", "qkv"), "v": ("attn_norm", "qkv"),
    "o": ("o", "o"), "gate": ("ffn_norm", "gate_up"), "up": ("ffn_norm", "gate_up"),
    "down": ("act", "down"),
}  # fmt: skip


@dataclass(frozen=True)
class LayerShape:
    """What sizes the layer's buffers besides the weights: the attention heads."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


def _spec(name: str, nbytes: int, first: str, last: str) -> BufferSpec:
    return BufferSpec(name, nbytes, _S[first], _S[last])


def _one_layer(
    lw: LayerWeights, shape: LayerShape, tokens: int, act_int8: bool, lora_rank: int
) -> list[BufferSpec]:
    T = tokens
    H = lw.attn_norm.shape[0]
    QD, KD, F = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, lw.gate.rows
    out = [
        _spec("attn_h", T * H * _F32, "attn_norm", "qkv"),  # float path (and the fallback's)
        _spec("q_out", T * QD * _F32, "qkv", "attention"),
        _spec("k_out", T * KD * _F32, "qkv", "attention"),
        _spec("v_out", T * KD * _F32, "qkv", "attention"),
        _spec("att", T * QD * _F32, "attention", "o"),
        # a rotating KV layout's copies of q, k and v (planned for any: bytes reused here)
        _spec("q_rot", T * QD * _F32, "attention", "attention"),
        _spec("k_rot", T * KD * _F32, "attention", "attention"),
        _spec("v_rot", T * KD * _F32, "attention", "attention"),
        _spec("x1", T * H * _F32, "o", "down"),  # the residual down adds to
        _spec("ffn_h", T * H * _F32, "ffn_norm", "gate_up"),
        _spec("gate_out", T * F * _F32, "gate_up", "act"),
        _spec("up_out", T * F * _F32, "gate_up", "act"),
        _spec("act_out", T * F * _F32, "act", "down"),
        # the one-call forward's second [T, hidden] buffer, each layer's input or output
        _spec("stack_x", T * H * _F32, "attn_norm", "down"),
    ]
    if lw.attn_post_norm is not None:
        out.append(_spec("attn_post", T * H * _F32, "o", "o"))
    if lw.ffn_post_norm is not None:
        out.append(_spec("ffn_post", T * H * _F32, "down", "down"))
    shared = {"attn": lw.qkv_group, "ffn": lw.gate_up_group}
    for prefix, group in shared.items():
        if act_int8 and group:  # RMSNorm fused with the quantization all of them share
            first, last = ("attn_norm", "qkv") if prefix == "attn" else ("ffn_norm", "gate_up")
            out.append(_spec(f"{prefix}_q8", T * H * _I8, first, last))
            out.append(_spec(f"{prefix}_s", T * (H // group) * _F32, first, last))
    shared_by = {"q": "attn", "k": "attn", "v": "attn", "gate": "ffn", "up": "ffn"}
    for name, lin in zip(_LINEAR_STEPS, lw.linears, strict=True):
        own_input = not shared.get(shared_by.get(name, ""))
        out += _linear_buffers(name, lin, T, act_int8, own_input, lora_rank)
    return out


def _linear_buffers(
    name: str, lin: Linear, T: int, act_int8: bool, own_input: bool, lora_rank: int
) -> list[BufferSpec]:
    first, applied = _LINEAR_STEPS[name]
    K = lin.cols
    quantized_input = act_int8 and lin.is_quantized
    out = []
    if quantized_input and own_input:
        out.append(_spec(f"{name}.in_q8", T * K * _I8, first, applied))
        out.append(_spec(f"{name}.in_s", T * (K // lin.act_group) * _F32, first, applied))
    if quantized_input and lin.factors is not None:  # low-rank factors take float input
        out.append(_spec(f"{name}.in_f", T * K * _F32, applied, applied))
    if quantized_input and lin.native is not None:  # that input in the kernels' layout
        prep = lin.native.q8_prep_bytes(lin.act_group)
        out.append(_spec(f"{name}.prep", T * prep, applied, applied))
    if lora_rank > 0:
        if quantized_input:
            out.append(_spec(f"{name}.lora_x", T * K * _F32, applied, applied))
        out.append(_spec(f"{name}.lora_h", T * lora_rank * _F32, applied, applied))
    return out


def layer_buffers(
    layers: Sequence[LayerWeights],
    shape: LayerShape,
    tokens: int,
    act_int8: bool,
    lora_rank: int = 0,
) -> list[BufferSpec]:
    """The slots any of ``layers`` takes for ``tokens`` tokens, each at the largest size a
    layer needs (one plan serves every layer). ``act_int8``: the model runs int8
    activations (the float path, its fallback, is always included); ``lora_rank``: the
    largest adapter rank a session may apply (0: none)."""
    merged: dict[str, BufferSpec] = {}
    for lw in layers:
        for s in _one_layer(lw, shape, tokens, act_int8, lora_rank):
            old = merged.get(s.name)
            if old is None or s.nbytes > old.nbytes:
                merged[s.name] = s
    return list(merged.values())

"""Canonical tensor names for the Llama family, from HF safetensors and from GGUF.

Canonical names (HF layout, numpy order ``[out_features, in_features]``)::

    embed.weight
    layers.{i}.attn_norm.weight
    layers.{i}.attn_q.weight  layers.{i}.attn_k.weight  layers.{i}.attn_v.weight
    layers.{i}.attn_q.bias    layers.{i}.attn_k.bias    layers.{i}.attn_v.bias  (Qwen2)
    layers.{i}.attn_q_norm.weight layers.{i}.attn_k_norm.weight  (Qwen3 head norms)
    layers.{i}.attn_o.weight  layers.{i}.attn_o.bias (Llama attention_bias)
    layers.{i}.ffn_norm.weight
    layers.{i}.ffn_gate.weight layers.{i}.ffn_up.weight layers.{i}.ffn_down.weight
    layers.{i}.ffn_gate.bias   layers.{i}.ffn_up.bias   layers.{i}.ffn_down.bias (mlp_bias)
    layers.{i}.attn_post_norm.weight layers.{i}.ffn_post_norm.weight (Gemma2 sandwich norms)
    norm.weight
    output.weight             (absent when the embeddings are tied)

A tensor whose source name is not in these tables (``rope_freqs.weight``,
``model.layers.0.self_attn.rotary_emb.inv_freq``...) keeps its source name unchanged, so an
unusual checkpoint imports rather than crashes and the packager decides what to do with it.

Q and K rows: llama.cpp's converter permutes them for its interleaved RoPE; the canonical
layout is HF's rotate-half one, so GGUF ``llama`` tensors go through :func:`unpermute_qk`.
"""

from __future__ import annotations

import re

import numpy as np

from edgepack.runtime_shim.config_table import FAMILIES

__all__ = [
    "FUSED",
    "LLAMA_FAMILY",
    "canonical_from_gguf",
    "canonical_from_hf",
    "canonical_sort_key",
    "gguf_from_canonical",
    "permute_qk",
    "unpermute_qk",
]

# HF ``model_type`` values that share the Llama graph: the families the runtime runs.
LLAMA_FAMILY = FAMILIES
# Phi-3's fused projections: canonical name -> the canonical parts, in row order.
FUSED = {
    "attn_qkv.weight": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
    "ffn_gate_up.weight": ("ffn_gate.weight", "ffn_up.weight"),
}

_HF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_o.weight",
    "self_attn.o_proj.bias": "attn_o.bias",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_gate_up.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
}
# Gemma2's four norms per layer: its post_attention_layernorm follows the attention
_HF_SANDWICH = {
    **_HF_LAYER,
    "post_attention_layernorm.weight": "attn_post_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "ffn_post_norm.weight",
}
_HF_GLOBAL = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER = {
    "attn_norm.weight": "attn_norm.weight",
    "attn_q.weight": "attn_q.weight",
    "attn_k.weight": "attn_k.weight",
    "attn_v.weight": "attn_v.weight",
    "attn_q.bias": "attn_q.bias",
    "attn_k.bias": "attn_k.bias",
    "attn_v.bias": "attn_v.bias",
    "attn_q_norm.weight": "attn_q_norm.weight",
    "attn_k_norm.weight": "attn_k_norm.weight",
    "attn_output.weight": "attn_o.weight",
    "attn_output.bias": "attn_o.bias",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "ffn_gate.weight",
    "ffn_up.weight": "ffn_up.weight",
    "ffn_down.weight": "ffn_down.weight",
    "ffn_gate.bias": "ffn_gate.bias",
    "ffn_up.bias": "ffn_up.bias",
    "ffn_down.bias": "ffn_down.bias",
}
_GGUF_GLOBAL = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def _canonical(
    name: str, pattern: re.Pattern[str], layer: dict[str, str], glob: dict[str, str]
) -> str:
    if name in glob:
        return glob[name]
    match = pattern.fullmatch(name)
    if match and match.group(2) in layer:
        return f"layers.{int(match.group(1))}.{layer[match.group(2)]}"
    return name


def canonical_from_hf(name: str, family: str = "llama") -> str:
    """Canonical name of an HF Llama-family tensor; unknown names come back unchanged."""
    layer = _HF_SANDWICH if family == "gemma2" else _HF_LAYER
    return _canonical(name, _HF_LAYER_RE, layer, _HF_GLOBAL)


def canonical_from_gguf(name: str) -> str:
    """Canonical name of a GGUF Llama-family tensor; unknown names come back unchanged."""
    return _canonical(name, _GGUF_LAYER_RE, _GGUF_LAYER, _GGUF_GLOBAL)


_LAYER_ORDER = {
    role: k
    for k, role in enumerate(
        [
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_q_norm",
            "attn_k_norm",
            "attn_o",
            "attn_post_norm",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
            "ffn_post_norm",
        ]
    )
}
_GLOBAL_ORDER = {"embed.weight": (0,), "norm.weight": (2,), "output.weight": (3,)}
_CANONICAL_LAYER_RE = re.compile(r"layers\.(\d+)\.(\w+)\.(weight|bias)")


def canonical_sort_key(name: str) -> tuple[int | str, ...]:
    """Order tensors as the graph uses them (embed, layer by layer, norm, output, others), so
    the same model imports in the same order from any format."""
    if name in _GLOBAL_ORDER:
        return _GLOBAL_ORDER[name]
    match = _CANONICAL_LAYER_RE.fullmatch(name)
    if match and match.group(2) in _LAYER_ORDER:
        return (1, int(match.group(1)), _LAYER_ORDER[match.group(2)], match.group(3))
    return (4, name)


_GGUF_GLOBAL_NAME = {c: g for g, c in _GGUF_GLOBAL.items()}
_GGUF_LAYER_NAME = {c: g for g, c in _GGUF_LAYER.items()}


def gguf_from_canonical(name: str) -> str | None:
    """llama.cpp's name of a canonical Llama-family tensor (the inverse of
    :func:`canonical_from_gguf`), or None for a tensor llama.cpp has no name for."""
    if name in _GGUF_GLOBAL_NAME:
        return _GGUF_GLOBAL_NAME[name]
    match = _CANONICAL_LAYER_RE.fullmatch(name)
    role = f"{match.group(2)}.{match.group(3)}" if match else ""
    if role in _GGUF_LAYER_NAME:
        return f"blk.{int(match.group(1))}.{_GGUF_LAYER_NAME[role]}"
    return None


def _check_heads(rows: int, n_head: int) -> None:
    if n_head <= 0 or rows % (2 * n_head):
        raise ValueError(f"{rows} rows cannot be split into {n_head} heads of even size")


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (rotate-half -> interleaved RoPE), for tests and tools."""
    _check_heads(w.shape[0], n_head)
    rest = w.shape[1:]
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo :func:`permute_qk`: interleaved pairs back to HF's rotate-half halves per head."""
    _check_heads(w.shape[0], n_head)
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)

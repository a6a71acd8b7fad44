"""Canonical Llama-family config from an HF ``config.json`` or from GGUF metadata.

Both sources end up with the same keys, so the packager reads one dict::

    hidden_size intermediate_size num_hidden_layers num_attention_heads
    num_key_value_heads head_dim vocab_size rms_norm_eps rope_theta
    rope_scaling (dict with "rope_type", or None) max_position_embeddings
    tie_word_embeddings attention_bias (q/k/v) attention_out_bias (o) mlp_bias
    hidden_act (silu, gelu, gelu_tanh, relu) qk_norm (qwen3)
    sliding_window (span or None) layer_types (per layer full/sliding, or None: all)
    bos_token_id eos_token_id
    family ("llama", "qwen2", "qwen3", "mistral": the source's own model type)
    variant (a best-effort model name such as "smollm2", or None)
    source_config (the raw config / metadata it came from)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edgepack.runtime_shim.config_table import (
    ACTIVATIONS,
    FAMILIES,
    check_package_config,
    check_source_config,
)

from ..errors import ImportModelError

__all__ = [
    "GGUF_HPARAMS",
    "check_convertible",
    "gguf_source_config",
    "llama_config_from_gguf",
    "llama_config_from_hf",
]


def check_convertible(architecture: str, config: Mapping[str, Any]) -> None:
    """Refuse, before a package is written, a model the runtime would not run exactly:
    :class:`~edgepack.runtime_shim.errors.UnsupportedModelError` names the config key
    (the one table: :mod:`edgepack.runtime_shim.config_table`). The canonical config
    then passes the checks ``open`` makes (types and ranges: :class:`ImportModelError`)."""
    raw = config.get("source_config")
    raw = raw if isinstance(raw, Mapping) else {}
    family = str(config.get("family") or raw.get("model_type") or architecture)
    if architecture != "llama":  # imported without the canonical (runnable) layout
        family = str(raw.get("model_type") or architecture)
        family = family if family not in FAMILIES else f"{family} ({architecture} layout)"
    if "general.architecture" in raw:  # GGUF metadata: only the family is an HF-style key
        check_source_config({}, family)
    else:
        check_source_config(raw, family)
    canonical = {k: v for k, v in config.items() if k != "source_config"}
    from edgepack.format.errors import CorruptPackageError

    try:
        check_package_config(canonical)
    except CorruptPackageError as exc:
        raise ImportModelError(str(exc)) from None


def _require(raw: Mapping[str, Any], key: str, where: str) -> Any:
    value = raw.get(key)
    if value is None:
        raise ImportModelError(f"{where} lacks {key!r}, which a Llama-family model needs")
    return value


def _as_int(value: Any, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ImportModelError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _normalise_rope_scaling(scaling: Any) -> dict[str, Any] | None:
    if not isinstance(scaling, Mapping):
        return None
    out = dict(scaling)
    rope_type = out.pop("type", None)
    out.setdefault("rope_type", rope_type)
    if out["rope_type"] in (None, "default", "none"):
        return None
    return out


def _shape_checks(cfg: dict[str, Any], where: str) -> None:
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if heads % kv:
        raise ImportModelError(f"{where}: {heads} attention heads not divisible by {kv} KV heads")
    if cfg["head_dim"] % 2:
        raise ImportModelError(f"{where}: head_dim {cfg['head_dim']} is odd, RoPE needs pairs")


def llama_config_from_hf(
    raw: Mapping[str, Any], tensor_names: set[str], where: str = "config.json"
) -> dict[str, Any]:
    """Canonical config from an HF config; ``tensor_names`` are the checkpoint's HF names."""
    ints = {}
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        ints[key] = _as_int(_require(raw, key, where), key, where)
    kv = _as_int(raw.get("num_key_value_heads") or ints["num_attention_heads"], "kv", where)
    head_dim = raw.get("head_dim") or ints["hidden_size"] // ints["num_attention_heads"]
    # transformers >= 5 moved rope settings into ``rope_parameters``.
    rope_params = raw.get("rope_parameters")
    rope_params = rope_params if isinstance(rope_params, Mapping) else {}
    rope_theta = raw.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
    scaling = raw.get("rope_scaling") or rope_params
    has_bias = any(n.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) for n in tensor_names)
    family = str(raw.get("model_type", "llama"))
    # which projections have biases, as each family's transformers modeling code decides
    attn_bias = bool(raw.get("attention_bias", False))
    qkv_bias = {"qwen2": True, "mistral": False}.get(family, attn_bias) or has_bias
    o_bias = attn_bias and family in ("llama", "qwen3", "gemma", "gemma2")
    mlp_bias = bool(raw.get("mlp_bias", False)) and family == "llama"
    act = raw.get("hidden_activation" if family == "gemma2" else "hidden_act", "silu")
    if family == "gemma" and act == "gelu":  # transformers reads Gemma's "gelu" as tanh-GELU
        act = "gelu_pytorch_tanh"
    gemma = family in ("gemma", "gemma2")
    # A checkpoint without lm_head can only mean tied embeddings.
    tied = bool(raw.get("tie_word_embeddings", False)) or "lm_head.weight" not in tensor_names
    name = str(raw.get("_name_or_path") or "")
    cfg: dict[str, Any] = {
        **ints,
        "num_key_value_heads": kv,
        "head_dim": _as_int(head_dim, "head_dim", where),
        "vocab_size": _as_int(_require(raw, "vocab_size", where), "vocab_size", where),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(rope_theta),
        "rope_scaling": _normalise_rope_scaling(scaling),
        "max_position_embeddings": int(raw.get("max_position_embeddings", 2048)),
        "tie_word_embeddings": tied,
        "attention_bias": qkv_bias,
        "attention_out_bias": o_bias,
        "mlp_bias": mlp_bias,
        "hidden_act": ACTIVATIONS.get(act, act),  # an unknown one is refused at convert
        "qk_norm": family == "qwen3",
        # Gemma multiplies the embeddings (not the tied head) by sqrt(hidden_size)
        "embedding_scale": float(ints["hidden_size"] ** 0.5) if gemma else None,
        **_gemma2_keys(raw, family),
        **_hf_windows(raw, family, ints["num_hidden_layers"]),
        "bos_token_id": raw.get("bos_token_id"),
        "eos_token_id": raw.get("eos_token_id"),
        "family": family,
        "variant": name.rstrip("/").rsplit("/", 1)[-1].lower() or None,
        "source_config": dict(raw),
    }
    _shape_checks(cfg, where)
    return cfg


def _gemma2_keys(raw: Mapping[str, Any], family: str) -> dict[str, Any]:
    """Gemma2's attention scale (``query_pre_attn_scalar ** -0.5``), soft-capping of the
    attention scores and the final logits (``cap * tanh(x / cap)``) and sandwich norms."""
    if family != "gemma2":
        return {}
    scalar = raw.get("query_pre_attn_scalar", 256)
    ok = isinstance(scalar, (int, float)) and not isinstance(scalar, bool) and scalar > 0
    if not ok:
        raise ImportModelError(f"query_pre_attn_scalar must be a positive number, got {scalar!r}")
    return {
        "attention_scale": float(scalar) ** -0.5,
        "attn_logit_softcapping": raw.get("attn_logit_softcapping"),
        "final_logit_softcapping": raw.get("final_logit_softcapping"),
        "sandwich_norms": True,
    }


def _hf_windows(raw: Mapping[str, Any], family: str, layers: int) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` as transformers applies them: Mistral on every
    layer; Qwen2/Qwen3 only with ``use_sliding_window``, on the layers ``layer_types``
    marks (default: from ``max_window_layers`` on); Llama never reads them."""
    # (Phi-3 applies its window on every layer too)
    window = raw.get("sliding_window")
    if family == "gemma2":  # alternating: even layers slide unless layer_types says otherwise
        kinds = raw.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
        ]
        return {"sliding_window": window, "layer_types": list(kinds)}
    if family in ("mistral", "phi3"):
        return {"sliding_window": window, "layer_types": None}
    if family not in ("qwen2", "qwen3") or not raw.get("use_sliding_window") or window is None:
        return {"sliding_window": None, "layer_types": None}
    kinds = raw.get("layer_types")
    if kinds is None:
        start = raw.get("max_window_layers", 28)
        kinds = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
    return {"sliding_window": window, "layer_types": list(kinds)}


def gguf_source_config(meta: Mapping[str, Any]) -> dict[str, Any]:
    """GGUF metadata minus the (huge) tokenizer arrays, kept as ``source_config``."""
    return {
        k: v
        for k, v in meta.items()
        if not (k.startswith("tokenizer.ggml.") and isinstance(v, list))
    }


# Canonical config key -> its GGUF ``{arch}.`` key: read here, written by the GGUF export.
GGUF_HPARAMS = {
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "vocab_size": "vocab_size",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "max_position_embeddings": "context_length",
}
# rope_scaling keys -> GGUF ``{arch}.rope.scaling.*`` keys (the type is ``rope_type``).
GGUF_ROPE_SCALING = {
    "rope_type": "rope.scaling.type",
    "factor": "rope.scaling.factor",
    "original_max_position_embeddings": "rope.scaling.original_context_length",
}


def llama_config_from_gguf(
    meta: Mapping[str, Any], tensor_names: set[str], where: str = "GGUF"
) -> dict[str, Any]:
    """Canonical config from GGUF metadata (``{arch}.*`` keys); names are canonical."""
    arch = str(meta.get("general.architecture", "llama"))

    def key(canonical: str) -> str:
        return f"{arch}.{GGUF_HPARAMS[canonical]}"

    def scaling_key(canonical: str) -> str:
        return f"{arch}.{GGUF_ROPE_SCALING[canonical]}"

    hidden = _as_int(_require(meta, key("hidden_size"), where), "embedding_length", where)
    heads = _as_int(_require(meta, key("num_attention_heads"), where), "head_count", where)
    kv = meta.get(key("num_key_value_heads"), heads)
    if isinstance(kv, list):  # per-layer KV heads: only uniform lists map to this config
        if len(set(kv)) != 1:
            raise ImportModelError(f"{where}: per-layer KV head counts {kv} are not supported")
        kv = kv[0]
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(key("vocab_size")) or (len(tokens) if tokens else None)
    scaling_type = meta.get(scaling_key("rope_type"))
    scaling = None
    if scaling_type not in (None, "none"):
        scaling = {"rope_type": scaling_type, "factor": meta.get(scaling_key("factor"))}
        original = meta.get(scaling_key("original_max_position_embeddings"))
        if original is not None:
            scaling["original_max_position_embeddings"] = original
    basename = meta.get("general.basename")
    cfg: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": _as_int(
            _require(meta, key("intermediate_size"), where), "feed_forward_length", where
        ),
        "num_hidden_layers": _as_int(
            _require(meta, key("num_hidden_layers"), where), "blocks", where
        ),
        "num_attention_heads": heads,
        "num_key_value_heads": _as_int(kv, "head_count_kv", where),
        "head_dim": _as_int(meta.get(key("head_dim"), hidden // heads), "hd", where),
        "vocab_size": _as_int(_require({"vocab": vocab}, "vocab", where), "vocab_size", where),
        "rms_norm_eps": float(meta.get(key("rms_norm_eps"), 1e-6)),
        "rope_theta": float(meta.get(key("rope_theta"), 10000.0)),
        "rope_scaling": scaling,
        "max_position_embeddings": int(meta.get(key("max_position_embeddings"), 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "layers.0.attn_q.bias" in tensor_names,
        "attention_out_bias": "layers.0.attn_o.bias" in tensor_names,
        "mlp_bias": "layers.0.ffn_gate.bias" in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "family": arch,
        "variant": str(basename).lower() if basename else None,
        "source_config": gguf_source_config(meta),
    }
    _shape_checks(cfg, where)
    return cfg

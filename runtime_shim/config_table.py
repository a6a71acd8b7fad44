"""The one table of model-config keys that change the math, and how edgepack handles each.

Rule: a config key that changes what a model computes is either implemented by the
runtime or refused, by name, before a package is written (``edgepack convert`` /
``build`` call :func:`check_source_config`) and again when a package is opened
(:func:`check_package_config`, the runtime's side of the same table). A refused model
gets :class:`UnsupportedModelError` (no edgepack version runs it: exit 2); only a key
this table has never heard of in a *package* means a newer packager wrote it, so a newer
runtime would help (:class:`~edgepack.format.errors.IncompatiblePackageError`, exit 5).

Two views of the same facts:

* ``HF_KEYS``: a Hugging Face ``config.json`` key of a supported ``model_type`` and what
  happens to it (``implemented`` or a refusal predicate). Keys the family's transformers
  modeling code never reads cannot change its math and pass.
* ``PACKAGE_KEYS``: the canonical keys a package's ``identity.config`` may hold (written
  by :mod:`edgepack.packager.importers.config`), each with its type check.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from edgepack.format.compat import CompatibilityProblem, CompatibilityVerdict
from edgepack.format.errors import CorruptPackageError, IncompatiblePackageError

from .errors import UnsupportedModelError

__all__ = [
    "ACTIVATIONS",
    "ATTENTION_KINDS",
    "FAMILIES",
    "HF_KEYS",
    "PACKAGE_KEYS",
    "ROPE_TYPES",
    "check_package_config",
    "check_source_config",
    "rope_type_of",
    "unread_tensors_error",
]

# HF ``model_type`` (GGUF ``general.architecture``) values the runtime runs.
FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2"})
# Known model types no edgepack version runs, with what they would need.
_UNSUPPORTED_FAMILIES = {
    "gemma3": "q/k norms with 1+w, sandwich norms, dual RoPE bases",
    "phi": "parallel attention/MLP blocks and partial rotary",
    "bert": "an encoder (bidirectional attention, LayerNorm, no generation)",
}
# HF ``hidden_act`` -> the runtime's activation of the gate in ``act(gate) * up``.
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "relu": "relu",
}
# RoPE scaling types the runtime computes exactly as transformers does (None: plain).
# "dynamic" (NTK) only rescales beyond max_position_embeddings, which is the runtime's
# context limit (a longer context is refused), so within it it is plain RoPE.
ROPE_TYPES = frozenset({"linear", "llama3", "yarn", "dynamic"})
_PLAIN_ROPE = (None, "default", "none")
ATTENTION_KINDS = frozenset({"full_attention", "sliding_attention"})

_NOT_RUN = (
    "no edgepack version runs it; convert a model of a supported family "
    "(llama, mistral, qwen2, qwen3, phi3, gemma, gemma2)"
)


def _unsupported(key: str, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{key}: {what} is not supported ({_NOT_RUN})", key)


def rope_type_of(scaling: Any) -> str | None:
    """The RoPE scaling type of an HF ``rope_scaling`` / ``rope_parameters`` map (None: plain)."""
    if not isinstance(scaling, Mapping):
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind is not None and not isinstance(kind, str):
        return repr(kind)  # a list or a map: an unknown type, refused as such (not hashed)
    return None if kind in _PLAIN_ROPE else kind


# -- Hugging Face config keys ---------------------------------------------------------------
@dataclass(frozen=True)
class KeyRule:
    """How one HF key is handled: ``refuse(value)`` returns why it cannot run, or None."""

    meaning: str
    refuse: Callable[[Any], str | None] = lambda value: None


def _rope_refusal(value: Any) -> str | None:
    if isinstance(value, Mapping) and _partial_rotary(value.get("partial_rotary_factor")):
        return _partial_rotary(value.get("partial_rotary_factor"))
    kind = rope_type_of(value)
    if kind is None or kind in ROPE_TYPES:
        return None
    return f"RoPE scaling {kind!r}"


def _partial_rotary(value: Any) -> str | None:
    return None if value in (None, 1, 1.0) else f"partial rotary factor {value!r}"


def _activation_refusal(value: Any) -> str | None:
    return None if value in ACTIVATIONS else f"activation {value!r}"


def _layer_types_refusal(value: Any) -> str | None:
    if value is None:
        return None
    odd = sorted({str(v) for v in value} - ATTENTION_KINDS) if isinstance(value, list) else [value]
    return f"attention layer types {odd}" if odd else None


HF_KEYS: dict[str, KeyRule] = {
    "hidden_size": KeyRule("model width"),
    "intermediate_size": KeyRule("MLP width"),
    "num_hidden_layers": KeyRule("layer count"),
    "num_attention_heads": KeyRule("query heads"),
    "num_key_value_heads": KeyRule("KV heads (GQA)"),
    "head_dim": KeyRule("head width (any even value)"),
    "vocab_size": KeyRule("vocabulary"),
    "rms_norm_eps": KeyRule("RMSNorm epsilon"),
    "rope_theta": KeyRule("RoPE base"),
    "rope_scaling": KeyRule("RoPE scaling", _rope_refusal),
    "rope_parameters": KeyRule("RoPE base and scaling (transformers >= 5)", _rope_refusal),
    "partial_rotary_factor": KeyRule("share of each head that is rotated", _partial_rotary),
    "max_position_embeddings": KeyRule("context limit"),
    "tie_word_embeddings": KeyRule("output head shares the embedding"),
    "attention_bias": KeyRule("q/k/v (and o, except qwen2) biases"),
    "mlp_bias": KeyRule("gate/up/down biases"),
    "hidden_act": KeyRule("MLP activation", _activation_refusal),
    "hidden_activation": KeyRule("gemma/gemma2: MLP activation", _activation_refusal),
    "query_pre_attn_scalar": KeyRule("gemma2: attention scale is its inverse square root"),
    "attn_logit_softcapping": KeyRule("gemma2: cap * tanh(scores / cap)"),
    "final_logit_softcapping": KeyRule("gemma2: cap * tanh(logits / cap)"),
    "sliding_window": KeyRule("sliding-window attention span"),
    "use_sliding_window": KeyRule("qwen2/qwen3: sliding window on or off"),
    "max_window_layers": KeyRule("qwen2/qwen3: layers from which the window applies"),
    "layer_types": KeyRule("per-layer full or sliding attention", _layer_types_refusal),
    "attention_dropout": KeyRule("training only: no effect at inference"),
    "pretraining_tp": KeyRule("training only: no effect at inference"),
    "use_bidirectional_attention": KeyRule(
        "gemma: attention without the causal mask",
        lambda v: "bidirectional attention" if v else None,
    ),
}


def check_source_config(raw: Mapping[str, Any], family: str) -> None:
    """Refuse (:class:`UnsupportedModelError`, naming the key) a source model whose
    config changes the math in a way the runtime does not implement."""
    if family not in FAMILIES:
        need = _UNSUPPORTED_FAMILIES.get(family)
        what = f"model type {family!r}" + (f" (needs {need})" if need else "")
        raise _unsupported("model_type", what)
    for key, rule in HF_KEYS.items():
        if key in raw:
            why = rule.refuse(raw[key])
            if why is not None:
                raise _unsupported(key, why)


# -- package (canonical) config keys ------------------------------------------------------------
def _pos_int(value: Any, limit: int = 1 << 24) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit:
        return f"a positive int up to {limit}"
    return None


def _opt_int(value: Any) -> str | None:
    return None if value is None else _pos_int(value, 1 << 31)


def _pos_float(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "a positive number"
    return None if math.isfinite(value) and value > 0 else "a positive finite number"


def _flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else "true or false"


def _token_ids(value: Any) -> str | None:
    ids = value if isinstance(value, list) else [value]
    ok = all(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0) for v in ids)
    return None if ok else "a token id, a list of them, or null"


def _package_family(value: Any) -> str | None:
    if not isinstance(value, str):
        return "a model type name"
    if value not in FAMILIES:
        raise _unsupported("family", f"model type {value!r}")
    return None


def _opt_str(value: Any) -> str | None:
    return None if value is None or isinstance(value, str) else "a string or null"


def _package_rope(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        return "a map or null"
    kind = rope_type_of(value)
    if kind is not None and kind not in ROPE_TYPES:
        raise _unsupported("rope_scaling", f"RoPE scaling {kind!r}")
    numbers = (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
        "attention_factor", "beta_fast", "beta_slow",
    )  # fmt: skip
    for key in numbers:
        if value.get(key) is not None and _pos_float(value[key]) is not None:
            return f"a map whose {key} is a positive finite number, not {value[key]!r}"
    if kind == "llama3" and value.get("high_freq_factor", 4.0) == value.get("low_freq_factor", 1.0):
        return "a map whose high_freq_factor differs from low_freq_factor"
    return None


def _package_activation(value: Any) -> str | None:
    if not isinstance(value, str):
        return "an activation name"
    if value not in set(ACTIVATIONS.values()):
        raise _unsupported("hidden_act", f"activation {value!r}")
    return None


def _package_layer_types(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return "a list of attention kinds or null"
    odd = sorted(set(value) - ATTENTION_KINDS)
    if odd:
        raise _unsupported("layer_types", f"attention layer types {odd}")
    return None


PACKAGE_KEYS: dict[str, Callable[[Any], str | None]] = {
    "hidden_size": _pos_int,
    "intermediate_size": _pos_int,
    "num_hidden_layers": lambda v: _pos_int(v, 4096),
    "num_attention_heads": lambda v: _pos_int(v, 4096),
    "num_key_value_heads": lambda v: _pos_int(v, 4096),
    "head_dim": lambda v: _pos_int(v, 4096),
    "vocab_size": _pos_int,
    "rms_norm_eps": _pos_float,
    "rope_theta": _pos_float,
    "rope_scaling": _package_rope,
    "max_position_embeddings": lambda v: _pos_int(v, 1 << 31),
    "tie_word_embeddings": _flag,
    "attention_bias": _flag,
    "attention_out_bias": _flag,
    "mlp_bias": _flag,
    "hidden_act": _package_activation,
    "sliding_window": _opt_int,
    "layer_types": _package_layer_types,
    "qk_norm": _flag,
    "embedding_scale": lambda v: None if v is None else _pos_float(v),
    "attention_scale": lambda v: None if v is None else _pos_float(v),
    "attn_logit_softcapping": lambda v: None if v is None else _pos_float(v),
    "final_logit_softcapping": lambda v: None if v is None else _pos_float(v),
    "sandwich_norms": _flag,
    "bos_token_id": _token_ids,
    "eos_token_id": _token_ids,
    "family": _package_family,
    "variant": _opt_str,
}


def _incompatible(code: str, message: str, remedy: str) -> IncompatiblePackageError:
    verdict = CompatibilityVerdict((CompatibilityProblem(code, message, remedy),))
    return IncompatiblePackageError(verdict.summary(), verdict)


def unread_tensors_error(names: list[str]) -> IncompatiblePackageError:
    """Stored tensors the decoder would not read: the math they stand for would be missing."""
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return _incompatible(
        "unread_tensors",
        f"tensors {shown} are not read by this runtime (running without them would be wrong)",
        "update the app to a newer edgepack runtime, or re-convert the model with this edgepack",
    )


def check_package_config(cfg: Mapping[str, Any]) -> None:
    """Every key of a package's model config known and of the right type and range.

    Wrong types or ranges are corruption (:class:`CorruptPackageError`); a known key
    with a value no runtime implements is :class:`UnsupportedModelError`; a key this
    table does not know was written by a newer packager (:class:`IncompatiblePackageError`).
    """
    unknown = sorted(set(cfg) - set(PACKAGE_KEYS))
    if unknown:
        raise _incompatible(
            "model_config",
            f"model config keys {unknown} are unknown to this runtime",
            "update the app to a newer edgepack runtime",
        )
    for key, check in PACKAGE_KEYS.items():
        if key in cfg:
            wrong = check(cfg[key])
            if wrong is not None:
                raise CorruptPackageError(
                    f"model config: {key} must be {wrong}, got {cfg[key]!r}"[:300]
                )

"""The Llama-family model config the runtime needs, read from ``header.identity.config``.

Keys are the packager's canonical ones (``edgepack.packager.importers.config``). RoPE
follows Hugging Face exactly (float32 ``inv_freq``, rotate-half layout): plain, ``linear``
and ``llama3`` scaling, and llama.cpp's per-frequency divisors (a ``rope_freqs.weight``
tensor) when a package carries one. Which keys exist and how each is handled is the
one table of :mod:`.config_table`; anything it refuses is refused at open time too
(:class:`~.errors.UnsupportedModelError`), never silently approximated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgepack.format.errors import CorruptPackageError

from .config_table import ROPE_TYPES, check_package_config, rope_type_of

__all__ = ["SUPPORTED_ROPE_TYPES", "LlamaConfig", "RopeTable"]

SUPPORTED_ROPE_TYPES = ROPE_TYPES


@dataclass(frozen=True)
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    attention_out_bias: bool = False  # o projection bias (llama/qwen3 ``attention_bias``)
    mlp_bias: bool = False  # gate/up/down biases
    hidden_act: str = "silu"  # act of ``act(gate) * up``: silu, gelu, gelu_tanh, relu
    qk_norm: bool = False  # RMSNorm over each q/k head before RoPE (qwen3)
    # per layer: the sliding-window span (keys at positions > p - window), None = full
    windows: tuple[int | None, ...] = ()
    embedding_scale: float | None = None  # embeddings (not the tied head) times this (gemma)
    attention_scale: float | None = None  # scores scale (None: 1/sqrt(head_dim))
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (gemma2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (gemma2)
    sandwich_norms: bool = False  # RMSNorm on the attention and FFN outputs too (gemma2)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> LlamaConfig:
        """Validate a canonical config; missing or nonsensical values are corruption."""

        check_package_config(cfg)

        def need_int(key: str, default: int | None = None) -> int:
            value = cfg.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CorruptPackageError(
                    f"model config: {key} must be a positive int, got {value!r}"
                )
            return value

        hidden = need_int("hidden_size")
        heads = need_int("num_attention_heads")
        kv = need_int("num_key_value_heads", heads)
        head_dim = need_int("head_dim", hidden // heads if hidden % heads == 0 else None)
        if heads % kv:
            raise CorruptPackageError(f"model config: {heads} heads not divisible by {kv} KV heads")
        if head_dim % 2:
            raise CorruptPackageError(f"model config: head_dim {head_dim} is odd")
        scaling = cfg.get("rope_scaling")
        if rope_type_of(scaling) is None:  # check_package_config refused other types
            scaling = None
        num_layers = need_int("num_hidden_layers")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        bos = cfg.get("bos_token_id")
        return cls(
            hidden_size=hidden,
            intermediate_size=need_int("intermediate_size"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            vocab_size=need_int("vocab_size"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=need_int("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            bos_token_id=bos if isinstance(bos, int) else None,
            eos_token_ids=tuple(int(e) for e in eos_ids if isinstance(e, int)),
            attention_out_bias=bool(cfg.get("attention_out_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            qk_norm=bool(cfg.get("qk_norm", False)),
            windows=_layer_windows(cfg, num_layers),
            embedding_scale=cfg.get("embedding_scale"),
            attention_scale=cfg.get("attention_scale"),
            attn_softcap=cfg.get("attn_logit_softcapping"),
            final_softcap=cfg.get("final_logit_softcapping"),
            sandwich_norms=bool(cfg.get("sandwich_norms", False)),
        )

    def _yarn(self) -> tuple[np.ndarray, float]:
        return _yarn_params(self)

    @property
    def rope_attention_scaling(self) -> float:
        """What cos/sin are multiplied by (YaRN's attention factor; 1 otherwise)."""
        if rope_type_of(self.rope_scaling) == "yarn":
            return self._yarn()[1]
        return 1.0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def inv_freq(self, freq_factors: np.ndarray | None = None) -> np.ndarray:
        """float32 ``[head_dim/2]`` rotary frequencies, computed as transformers does."""
        dim = self.head_dim
        exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
        inv = (np.float32(1.0) / np.power(np.float32(self.rope_theta), exponents)).astype(
            np.float32
        )
        scaling = self.rope_scaling
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            factor = float(scaling.get("factor") or 1.0)
            if kind == "llama3":
                inv = _llama3_inv_freq(inv, scaling, factor)
            elif kind == "yarn":
                inv = self._yarn()[0]
            elif kind == "linear":
                inv = (inv / np.float32(factor)).astype(np.float32)
        if freq_factors is not None:
            factors = np.asarray(freq_factors, np.float32).reshape(-1)
            if factors.shape != inv.shape:
                raise CorruptPackageError(
                    f"rope_freqs.weight has {factors.size} entries, head_dim/2 is {inv.size}"
                )
            inv = (inv / factors).astype(np.float32)
        return inv


def _yarn_params(cfg: LlamaConfig) -> tuple[np.ndarray, float]:
    """transformers' ``_compute_yarn_parameters``: float32 ``inv_freq`` and the factor
    cos/sin are multiplied by (``attention_factor``)."""
    s = cfg.rope_scaling or {}
    dim, base, f32 = cfg.head_dim, float(cfg.rope_theta), np.float32
    orig = float(s.get("original_max_position_embeddings", cfg.max_position_embeddings))
    factor = s.get("factor")
    factor = float(factor) if factor is not None else cfg.max_position_embeddings / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos = np.power(f32(base), np.arange(0, dim, 2, dtype=np.int64).astype(f32) / f32(dim))
    extrapolation = (f32(1) / pos).astype(f32)
    interpolation = (f32(1) / (f32(factor) * pos)).astype(f32)
    ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1)
    keep = (f32(1) - ramp).astype(f32)
    inv = interpolation * (f32(1) - keep) + extrapolation * keep
    return inv.astype(f32), float(attention)


def _layer_windows(cfg: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window: ``sliding_window`` on the layers ``layer_types`` marks
    ``sliding_attention`` (every layer when it is absent, as Mistral does)."""
    window = cfg.get("sliding_window")
    kinds = cfg.get("layer_types")
    if kinds is None:
        return (window,) * num_layers
    if len(kinds) != num_layers:
        raise CorruptPackageError(
            f"model config: layer_types has {len(kinds)} entries for {num_layers} layers"
        )
    return tuple(window if k == "sliding_attention" else None for k in kinds)


def _llama3_inv_freq(inv: np.ndarray, scaling: Mapping[str, Any], factor: float) -> np.ndarray:
    """transformers' ``_compute_llama3_parameters`` (float32 like torch)."""
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen = old / low
    high_wavelen = old / high
    f32 = np.float32
    wavelen = (f32(2 * math.pi) / inv).astype(np.float32)
    scaled = np.where(wavelen > f32(low_wavelen), inv / f32(factor), inv).astype(np.float32)
    smooth = ((f32(old) / wavelen - f32(low)) / f32(high - low)).astype(np.float32)
    smoothed = ((f32(1) - smooth) * scaled / f32(factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < f32(high_wavelen)) & ~(wavelen > f32(low_wavelen))
    return np.where(medium, smoothed, scaled).astype(np.float32)


class RopeTable:
    """cos/sin ``[positions, head_dim/2]`` (float32), grown on demand in 256-row steps."""

    def __init__(self, inv_freq: np.ndarray, scaling: float = 1.0) -> None:
        self.inv_freq = np.ascontiguousarray(inv_freq, np.float32)
        self.scaling = np.float32(scaling)
        self._cos = np.empty((0, self.inv_freq.size), np.float32)
        self._sin = self._cos

    def _grow(self, n: int) -> None:
        n = (n + 255) // 256 * 256
        pos = np.arange(n, dtype=np.float32)
        freqs = (pos[:, None] * self.inv_freq[None, :]).astype(np.float32)
        self._cos = np.cos(freqs).astype(np.float32)
        self._sin = np.sin(freqs).astype(np.float32)
        if self.scaling != 1:  # YaRN: applied to cos/sin in float32, as transformers does
            self._cos *= self.scaling
            self._sin *= self.scaling

    def lookup(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        top = int(positions.max()) + 1 if positions.size else 0
        if top > self._cos.shape[0]:
            self._grow(top)
        if positions.size and int(positions[-1]) - int(positions[0]) == positions.size - 1:
            p0 = int(positions[0])
            return self._cos[p0 : p0 + positions.size], self._sin[p0 : p0 + positions.size]
        return self._cos[positions], self._sin[positions]

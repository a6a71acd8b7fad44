"""Bind a package's tensors to the decoder without copying them.

Every :class:`Linear` holds zero-copy views of the mmap (codes, scales, zeros exactly as
stored, spec/FORMAT.md section 5); kernels decode them on the fly. Only the small 1-D
tensors (norm weights, biases: a few KB per layer) are converted to float32 copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgepack.format import Encoding, Package, QuantizedTensor
from edgepack.format.errors import CorruptPackageError, EncodingError

from .config import LlamaConfig

__all__ = ["Embedding", "LayerWeights", "Linear", "ModelWeights", "bind_weights"]


@dataclass(eq=False)
class Linear:
    """A weight ``[rows=out, cols=in]`` in its stored encoding, plus an optional bias.

    ``codes``: f32/f16 ``[R, C]``, bf16 as uint16 ``[R, C]``, int8 ``[R, C]`` or packed
    int4 uint8 ``[R, C/2]``; ``scales``: f32 ``[R]`` (int8) or f16 ``[R, C/g]`` (int4);
    ``zeros``: f16 ``[R, C/g]`` (int4 asymmetric). LOW_RANK has ``factors = (U, V)``.
    ``native`` is a slot for an opaque handle a native backend binds once at open.
    """

    name: str
    encoding: Encoding
    rows: int
    cols: int
    codes: np.ndarray | None = None
    scales: np.ndarray | None = None
    zeros: np.ndarray | None = None
    group_size: int = 0
    bias: np.ndarray | None = None
    factors: tuple[Linear, Linear] | None = None
    native: Any = field(default=None, repr=False)
    # derived once (the forward pass asks for them per call)
    is_quantized: bool = field(init=False, repr=False)
    act_group: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.factors is not None:
            self.is_quantized = any(f.is_quantized for f in self.factors)
            self.act_group = self.factors[1].act_group
        else:
            self.is_quantized = not self.encoding.is_float
            self.act_group = self._act_group()

    @property
    def nbytes(self) -> int:
        """Bytes of stored weight data one full read of this matrix touches."""
        if self.factors is not None:
            return sum(f.nbytes for f in self.factors)
        return sum(a.nbytes for a in (self.codes, self.scales, self.zeros) if a is not None)

    def _act_group(self) -> int:
        """Group of the dynamic int8 activation scales this weight is multiplied with:
        the weight's own group for int4 (one int32 dot per group pair), 32 for int8 (as
        llama.cpp's Q8_0: a massive activation only coarsens its own 32 columns), or
        the whole row when 32 does not divide it."""
        if self.encoding.is_group:
            return self.group_size
        return 32 if self.cols % 32 == 0 else self.cols


@dataclass(eq=False)
class Embedding:
    """Token embedding ``[vocab, hidden]``; rows are decoded on lookup."""

    table: Linear

    def lookup(self, ids: np.ndarray | Sequence[int]) -> np.ndarray:
        t = self.table
        if isinstance(ids, list):  # a forward's tokens: checked without numpy reductions
            bad = bool(ids) and (min(ids) < 0 or max(ids) >= t.rows)
            ids = np.asarray(ids, np.int64)
        else:
            ids = np.asarray(ids, np.int64)
            bad = bool(ids.size) and (int(ids.min()) < 0 or int(ids.max()) >= t.rows)
        if bad:
            raise ValueError(f"token id out of range 0..{t.rows - 1}")
        return decode_rows(t, ids)


def decode_rows(t: Linear, ids: np.ndarray) -> np.ndarray:
    """float32 rows ``ids`` of ``t`` (any encoding), bit-exact with the format codecs."""
    from edgepack.format import codecs

    if t.factors is not None:
        u, v = t.factors
        return decode_rows(u, ids) @ decode_rows(v, np.arange(v.rows))
    assert t.codes is not None
    scales = t.scales[ids] if t.scales is not None else None
    zeros = t.zeros[ids] if t.zeros is not None else None
    return codecs.dequantize(t.encoding, t.codes[ids], scales, zeros, t.group_size)


def _shared_group(lins: tuple[Linear, ...]) -> int | None:
    if not all(lin.is_quantized and lin.factors is None for lin in lins):
        return None
    groups = {lin.act_group for lin in lins}
    return groups.pop() if len(groups) == 1 else None


@dataclass(eq=False)
class LayerWeights:
    index: int
    attn_norm: np.ndarray
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    ffn_norm: np.ndarray
    gate: Linear
    up: Linear
    down: Linear
    q_norm: np.ndarray | None = None  # [head_dim] RMSNorm weights of each q/k head (qwen3)
    k_norm: np.ndarray | None = None
    attn_post_norm: np.ndarray | None = None  # [hidden] norms of the attention / FFN
    ffn_post_norm: np.ndarray | None = None  # outputs before their residual add (gemma2)
    # the shared activation group of q/k/v and of gate/up (None: quantize per weight)
    qkv_group: int | None = field(init=False, default=None)
    gate_up_group: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.qkv_group = _shared_group((self.q, self.k, self.v))
        self.gate_up_group = _shared_group((self.gate, self.up))

    @property
    def linears(self) -> tuple[Linear, ...]:
        return (self.q, self.k, self.v, self.o, self.gate, self.up, self.down)


@dataclass(eq=False)
class ModelWeights:
    embed: Embedding
    layers: list[LayerWeights]
    norm: np.ndarray
    output: Linear
    rope_freqs: np.ndarray | None

    @property
    def is_quantized(self) -> bool:
        return any(lin.is_quantized for layer in self.layers for lin in layer.linears)

    def decode_bytes_per_token(self) -> int:
        """Weight bytes one decode step reads: every layer matrix, the head, one embedding row."""
        total = sum(lin.nbytes for layer in self.layers for lin in layer.linears)
        total += self.output.nbytes
        return total + self.embed.table.nbytes // max(self.embed.table.rows, 1)


def _linear(pkg: Package, name: str, bias: str | None = None) -> Linear:
    entry = pkg.entry(name)
    if len(entry.shape) != 2:
        raise CorruptPackageError(f"{name} has shape {entry.shape}, a matrix was expected")
    rows, cols = entry.shape
    b = None
    if bias is not None and bias in pkg.header.tensor_index:
        b = _vector(pkg, bias, rows)
    if entry.encoding == Encoding.LOW_RANK:
        u, v = (_linear(pkg, f) for f in entry.factors)
        if u.rows != rows or v.cols != cols or u.cols != v.rows:
            raise CorruptPackageError(f"{name}: low-rank factors do not compose to {entry.shape}")
        return Linear(name, entry.encoding, rows, cols, bias=b, factors=(u, v))
    stored = pkg.tensor(name)
    if isinstance(stored, QuantizedTensor):
        return quantized_linear(
            name,
            entry.encoding,
            rows,
            cols,
            stored.codes,
            stored.scales,
            stored.zeros,
            entry.group_size,
            bias=b,
        )
    return Linear(name, entry.encoding, rows, cols, codes=stored.reshape(rows, cols), bias=b)


def quantized_linear(
    name: str,
    encoding: Encoding,
    rows: int,
    cols: int,
    codes: np.ndarray,
    scales: np.ndarray | None,
    zeros: np.ndarray | None,
    group_size: int,
    bias: np.ndarray | None = None,
) -> Linear:
    """A :class:`Linear` over stored integer parts. 8-bit group scales (``*_S8``) are
    expanded once to the binary16 ones every kernel reads (R x C/g values, a few % of
    the codes' size) and the weight runs as the binary16 encoding; codes stay mapped."""
    from edgepack.format import codecs

    if encoding.is_group:
        try:
            scales, zeros = codecs.group_values(encoding, scales, zeros)
        except EncodingError as exc:
            raise CorruptPackageError(f"{name}: {exc}") from None
    return Linear(
        name,
        encoding.base,
        rows,
        cols,
        codes=codes,
        scales=scales,
        zeros=zeros,
        group_size=group_size,
        bias=bias,
    )


def _vector(pkg: Package, name: str, size: int) -> np.ndarray:
    if name not in pkg.header.tensor_index:
        raise CorruptPackageError(f"package lacks tensor {name!r}, which its config implies")
    value = np.ascontiguousarray(pkg.dequantize(name), np.float32).reshape(-1)
    if value.size != size:
        raise CorruptPackageError(f"{name} has {value.size} values, {size} expected")
    return value


def bind_weights(pkg: Package, cfg: LlamaConfig) -> ModelWeights:
    """Views of every tensor the decoder needs; shapes are checked against ``cfg``.

    The tensor set must be the one the config implies: a missing tensor is corruption,
    one the decoder would not read (a bias this runtime does not apply, say) is refused,
    so nothing stored is silently ignored."""
    h, q, kv, f = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    names = pkg.header.tensor_index
    used: set[str] = set()

    def need(name: str, shape: tuple[int, int], bias: str | None = None) -> Linear:
        if name not in names:
            raise CorruptPackageError(f"package lacks tensor {name!r}, which its config implies")
        if bias is not None:
            used.add(bias)
        used.add(name)
        lin = _linear(pkg, name, bias)
        if (lin.rows, lin.cols) != shape:
            raise CorruptPackageError(f"{name} is {lin.rows}x{lin.cols}, {shape} expected")
        if bias is not None and lin.bias is None:
            raise CorruptPackageError(f"package lacks tensor {bias!r}, which its config implies")
        return lin

    def vector(name: str, size: int) -> np.ndarray:
        used.add(name)
        return _vector(pkg, name, size)

    def bias(name: str, wanted: bool) -> str | None:
        # q/k/v biases are bound when stored (packages before the config said so)
        return name if wanted or (name.endswith(_QKV_BIAS) and name in names) else None

    layers = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        qkv_bias, o_bias, mlp_bias = cfg.attention_bias, cfg.attention_out_bias, cfg.mlp_bias
        sandwich = cfg.sandwich_norms
        layers.append(
            LayerWeights(
                index=i,
                attn_norm=vector(p + "attn_norm.weight", h),
                q=need(p + "attn_q.weight", (q, h), bias(p + "attn_q.bias", qkv_bias)),
                k=need(p + "attn_k.weight", (kv, h), bias(p + "attn_k.bias", qkv_bias)),
                v=need(p + "attn_v.weight", (kv, h), bias(p + "attn_v.bias", qkv_bias)),
                o=need(p + "attn_o.weight", (h, q), bias(p + "attn_o.bias", o_bias)),
                ffn_norm=vector(p + "ffn_norm.weight", h),
                gate=need(p + "ffn_gate.weight", (f, h), bias(p + "ffn_gate.bias", mlp_bias)),
                up=need(p + "ffn_up.weight", (f, h), bias(p + "ffn_up.bias", mlp_bias)),
                down=need(p + "ffn_down.weight", (h, f), bias(p + "ffn_down.bias", mlp_bias)),
                q_norm=vector(p + "attn_q_norm.weight", cfg.head_dim) if cfg.qk_norm else None,
                k_norm=vector(p + "attn_k_norm.weight", cfg.head_dim) if cfg.qk_norm else None,
                attn_post_norm=vector(p + "attn_post_norm.weight", h) if sandwich else None,
                ffn_post_norm=vector(p + "ffn_post_norm.weight", h) if sandwich else None,
            )
        )
    embed = need("embed.weight", (cfg.vocab_size, h))
    output = need("output.weight", (cfg.vocab_size, h)) if "output.weight" in names else embed
    rope_freqs = None
    if "rope_freqs.weight" in names:
        rope_freqs = vector("rope_freqs.weight", cfg.head_dim // 2)
    norm = vector("norm.weight", h)
    _refuse_unread(pkg, used)
    return ModelWeights(
        embed=Embedding(embed),
        layers=layers,
        norm=norm,
        output=output,
        rope_freqs=rope_freqs,
    )


_QKV_BIAS = (".attn_q.bias", ".attn_k.bias", ".attn_v.bias")
# Buffers some checkpoints carry that transformers derives again (no information).
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


def _refuse_unread(pkg: Package, used: set[str]) -> None:
    """A stored tensor the decoder would not read means the math it stands for is missing
    (an o_proj bias under its source name, say): refuse instead of ignoring it."""
    factors = {f for t in pkg.header.tensors for f in (t.factors or ())}
    unread = sorted(
        name
        for name in pkg.header.tensor_index
        if name not in used and name not in factors and not name.endswith(_DERIVED_SUFFIXES)
    )
    if unread:
        from .config_table import unread_tensors_error

        raise unread_tensors_error(unread)

"""AWQ (Lin et al. 2023): per-input-channel scales that protect salient weights, folded
into the previous op so the model computes the same function.

A *scale site* is a linear input ``x`` shared by some weights (the consumers) together
with the op that produces it, which absorbs ``1/s``:

* attention input (q, k, v) and FFN input (gate, up): the RMSNorm weight before them;
* the down projection's input ``silu(gate) * up``: the rows of ``up`` (and its bias);
* the o projection's input (attention output): the rows of ``v`` (and its bias); with
  grouped-query attention one ``v`` row feeds several heads, so those channels share
  one scale.

Consumers get ``W' = W diag(s)``, the producer ``p' = p / s``; exact in real arithmetic.
AWQ chooses ``s = mean|x|^alpha`` (normalised) per site, ``alpha`` on a grid, minimising
the consumers' output error ``sum tr(dW H dW^T)`` after quantizing ``W'`` with each
consumer's chosen encoding (``dW = Q(W diag(s)) diag(s)^-1 - W``); ``alpha = 0`` is the
identity, so the calibration objective never gets worse. Errors are measured on a row
sample of each consumer (rows quantize independently).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..encode import EncodingChoice
from .rtn import rtn_quantize

__all__ = ["ScaleSite", "Transforms", "awq_scales", "scale_sites"]

_F32 = np.float32
_GRID = tuple(i / 10 for i in range(11))
_ROWS = 256


@dataclass(frozen=True)
class ScaleSite:
    site: str  # calibration site (the first consumer's name)
    consumers: tuple[str, ...]  # weights whose columns take s
    producer: str  # a 1-D norm weight, or a weight whose rows take 1/s
    producer_rows: bool  # producer is a weight (rows scaled), else a vector
    producer_bias: str | None = None  # the producer's bias (scaled with its rows)
    expand: tuple[int, int, int] | None = None  # (kv_heads, group, head_dim): o <- v


@dataclass
class Transforms:
    """Per-tensor scalings accumulated by AWQ / SmoothQuant (all float32)."""

    cols: dict[str, np.ndarray] = field(default_factory=dict)  # W[:, j] *= s[j]
    rows: dict[str, np.ndarray] = field(default_factory=dict)  # W[i, :] *= r[i]
    vecs: dict[str, np.ndarray] = field(default_factory=dict)  # v[i] *= r[i]

    def __bool__(self) -> bool:
        return bool(self.cols or self.rows or self.vecs)

    def apply(self, name: str, w: np.ndarray) -> np.ndarray:
        if name in self.vecs:
            return (w.reshape(-1) * self.vecs[name]).reshape(w.shape).astype(_F32)
        out = w
        if name in self.cols:
            out = (out.reshape(out.shape[0], -1) * self.cols[name]).reshape(w.shape)
        if name in self.rows:
            r = self.rows[name].reshape(-1, *([1] * (w.ndim - 1)))
            out = out * r
        return np.ascontiguousarray(out, _F32)

    def fold(self, site: ScaleSite, s: np.ndarray) -> None:
        """Record ``s`` at ``site``: consumers' columns times ``s``, producer over ``s``."""
        s = np.asarray(s, _F32)
        for c in site.consumers:
            self.cols[c] = self.cols.get(c, np.ones_like(s)) * s
        ps = _producer_scale(site, s)
        inv = (_F32(1) / ps).astype(_F32)
        target = self.rows if site.producer_rows else self.vecs
        target[site.producer] = target.get(site.producer, np.ones_like(inv)) * inv
        if site.producer_bias:
            self.vecs[site.producer_bias] = (
                self.vecs.get(site.producer_bias, np.ones_like(inv)) * inv
            )


def _producer_scale(site: ScaleSite, s: np.ndarray) -> np.ndarray:
    """The producer's per-output scale for the consumers' per-input ``s``."""
    if site.expand is None:
        return s
    kv, group, hd = site.expand
    # o's input channel (h * hd + d) comes from v's row (h // group * hd + d): tied
    return s.reshape(kv, group, hd)[:, 0, :].reshape(-1)


def _tie(site: ScaleSite, s: np.ndarray) -> np.ndarray:
    """Make ``s`` equal over channels that share a producer row (mean in log space)."""
    if site.expand is None:
        return s
    kv, group, hd = site.expand
    t = np.exp(np.log(s).reshape(kv, group, hd).mean(axis=1, keepdims=True))
    return np.broadcast_to(t, (kv, group, hd)).reshape(-1).astype(_F32)


def scale_sites(names: Sequence[str], config: Mapping[str, object]) -> list[ScaleSite]:
    """The foldable sites of a Llama-family model (names as the importers canonicalise)."""
    have = set(names)
    layers = int(config.get("num_hidden_layers", 0) or 0)
    nh = int(config.get("num_attention_heads", 0) or 0)
    nkv = int(config.get("num_key_value_heads", nh) or nh)
    hidden = int(config.get("hidden_size", 0) or 0)
    hd = int(config.get("head_dim", 0) or (hidden // nh if nh else 0))
    out = []
    for i in range(layers):
        p = f"layers.{i}."

        def n(x: str, p: str = p) -> str:
            return p + x

        if {
            n("attn_q.weight"),
            n("attn_k.weight"),
            n("attn_v.weight"),
            n("attn_norm.weight"),
        } <= have:
            out.append(
                ScaleSite(
                    n("attn_q.weight"),
                    (n("attn_q.weight"), n("attn_k.weight"), n("attn_v.weight")),
                    n("attn_norm.weight"),
                    False,
                )
            )
        if {n("ffn_gate.weight"), n("ffn_up.weight"), n("ffn_norm.weight")} <= have:
            out.append(
                ScaleSite(
                    n("ffn_gate.weight"),
                    (n("ffn_gate.weight"), n("ffn_up.weight")),
                    n("ffn_norm.weight"),
                    False,
                )
            )
        if {n("ffn_down.weight"), n("ffn_up.weight")} <= have:
            bias = n("ffn_up.bias") if n("ffn_up.bias") in have else None
            out.append(
                ScaleSite(
                    n("ffn_down.weight"), (n("ffn_down.weight"),), n("ffn_up.weight"), True, bias
                )
            )
        if {n("attn_o.weight"), n("attn_v.weight")} <= have and nh and nkv and hd:
            bias = n("attn_v.bias") if n("attn_v.bias") in have else None
            out.append(
                ScaleSite(
                    n("attn_o.weight"),
                    (n("attn_o.weight"),),
                    n("attn_v.weight"),
                    True,
                    bias,
                    (nkv, nh // nkv, hd),
                )
            )
    return out


def _normalise(s: np.ndarray) -> np.ndarray:
    s = np.maximum(s, 1e-8)
    s = s / np.sqrt(float(s.max()) * float(s.min()))
    return np.clip(s, 1e-4, 1e4).astype(_F32)


def awq_scales(
    site: ScaleSite,
    weights: Mapping[str, np.ndarray],
    choices: Mapping[str, EncodingChoice],
    hessian: np.ndarray,
    mean_abs: np.ndarray,
    *,
    grid: Sequence[float] = _GRID,
    rng: np.random.Generator | None = None,
    quantize: Callable[[np.ndarray, EncodingChoice], np.ndarray] | None = None,
) -> tuple[np.ndarray, float, float]:
    """Best ``s`` for ``site``; returns ``(s, error at s, error without scaling)``."""
    rng = rng or np.random.default_rng(0)
    h = np.asarray(hessian, _F32)
    quantize = quantize or (lambda w, c: rtn_quantize(w, c)[1])
    samples = {}
    for c in site.consumers:
        w = np.asarray(weights[c], _F32).reshape(weights[c].shape[0], -1)
        if w.shape[0] > _ROWS:
            w = np.ascontiguousarray(w[np.sort(rng.choice(w.shape[0], _ROWS, replace=False))])
        samples[c] = w
    base_x = np.maximum(np.asarray(mean_abs, np.float64), 1e-12)

    def error(s: np.ndarray) -> float:
        total = 0.0
        for c, w in samples.items():
            if choices[c].encoding.is_float:
                continue
            dw = quantize(w * s, choices[c]) / s - w
            total += float(np.einsum("ij,ij->", dw @ h, dw))
        return total

    best_s = np.ones(h.shape[0], _F32)
    base = best = error(best_s)
    for alpha in grid:
        if alpha == 0:
            continue
        s = _tie(site, _normalise(base_x**alpha))
        e = error(s)
        if e < best:
            best, best_s = e, s
    return best_s, best, base

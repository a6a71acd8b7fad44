"""Numerical consistency between two packages of the same model (``edgepack compare``).

Both run the same token ids; hidden states after the embedding, every layer and the
final norm, and the logits are compared as whole ``[T, ...]`` tensors: cosine
similarity and signal-to-noise ratio ``10 log10(sum(a^2) / sum((a - b)^2))`` dB with
package A as the reference, plus the worst per-token cosine.

By default both run with float activations and a float KV cache, so the figures measure
what differs between the packages (their weights); ``kv_b="int8", activations_b="auto"``
add what a device's runtime approximates on top. ``isolated=True`` feeds every layer of
B the reference input from A: each layer's own error, without the accumulation through
the layers before it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import InvalidRequestError
from .model import open as open_model

__all__ = ["CompareReport", "TensorComparison", "compare_arrays", "compare_packages"]


@dataclass(frozen=True)
class TensorComparison:
    name: str
    cosine: float
    snr_db: float
    min_token_cosine: float
    max_abs: float


@dataclass(frozen=True)
class CompareReport:
    rows: list[TensorComparison]
    tokens: int

    def row(self, name: str) -> TensorComparison:
        return next(r for r in self.rows if r.name == name)

    @property
    def layers(self) -> list[TensorComparison]:
        return [r for r in self.rows if r.name.startswith("layers.")]

    def worst(self) -> tuple[TensorComparison, TensorComparison]:
        """(lowest cosine, lowest SNR) over hidden states and logits."""
        return min(self.rows, key=lambda r: r.cosine), min(self.rows, key=lambda r: r.snr_db)

    def format(self) -> str:
        lines = [
            f"{'tensor':<12} {'cosine':>10} {'SNR dB':>8} {'min tok cos':>12} {'max |diff|':>11}"
        ]
        for r in self.rows:
            lines.append(
                f"{r.name:<12} {r.cosine:>10.6f} {r.snr_db:>8.2f} "
                f"{r.min_token_cosine:>12.6f} {r.max_abs:>11.4g}"
            )
        lo_cos, lo_snr = self.worst()
        lines.append(
            f"{self.tokens} tokens; worst cosine {lo_cos.cosine:.6f} ({lo_cos.name}), "
            f"worst SNR {lo_snr.snr_db:.2f} dB ({lo_snr.name})"
        )
        return "\n".join(lines)


def compare_arrays(name: str, ref: np.ndarray, other: np.ndarray) -> TensorComparison:
    a = np.asarray(ref, np.float64).reshape(ref.shape[0], -1)
    b = np.asarray(other, np.float64).reshape(other.shape[0], -1)
    num = float((a * b).sum())
    den = math.sqrt(float((a * a).sum()) * float((b * b).sum()))
    cos = num / den if den else float(num == 0)
    noise = float(((a - b) ** 2).sum())
    signal = float((a * a).sum())
    snr = 10 * math.log10(signal / noise) if noise > 0 else math.inf
    na = np.linalg.norm(a, axis=1)
    nb = np.linalg.norm(b, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        tok = (a * b).sum(1) / (na * nb)
    tok = np.where((na == 0) & (nb == 0), 1.0, tok)
    return TensorComparison(name, cos, snr, float(np.nanmin(tok)), float(np.abs(a - b).max()))


def compare_packages(
    path_a: str | Path,
    path_b: str | Path,
    text: str | Sequence[int],
    *,
    max_tokens: int = 256,
    kv_a: str = "float",
    kv_b: str = "float",
    activations_a: str = "float",
    activations_b: str = "float",
    kernels: str | None = None,
    threads: int | None = None,
    isolated: bool = False,
) -> CompareReport:
    """Run both packages on ``text`` (tokenized with A's tokenizer, first ``max_tokens``)."""
    # a developer's measurement of two packages, not a device loading one: nothing to warn
    opts = {"kernels": kernels, "threads": threads, "verify": "none"}
    with open_model(path_a, kv=kv_a, activations=activations_a, **opts) as a:
        ids = a.tokenizer.encode(text) if isinstance(text, str) else [int(i) for i in text]
        ids = ids[:max_tokens]
        if not ids:
            raise InvalidRequestError("the text has no tokens to compare")
        ref = a.session().hidden_states(ids)
    with open_model(path_b, kv=kv_b, activations=activations_b, **opts) as b:
        layers_a = len([k for k in ref if k.startswith("layers.")])
        if b.config.num_layers != layers_a:
            raise InvalidRequestError(
                f"the packages have different numbers of layers ({layers_a} and "
                f"{b.config.num_layers}): compare builds of the same model"
            )
        other = b.session().hidden_states(ids, teacher=ref if isolated else None)
    rows = [compare_arrays(name, ref[name], other[name]) for name in ref]
    return CompareReport(rows, len(ids))

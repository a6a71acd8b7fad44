"""Next-token choice: greedy, or temperature with top-k / top-p, seeded and reproducible."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Sampler", "SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax, lowest id on ties)
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    repetition_penalty: float = 1.0  # 1: off (CTRL-style: divide positive logits)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng: np.random.Generator | None = None

    @property
    def rng(self) -> np.random.Generator:
        """Made at the first draw: greedy decoding never loads ``numpy.random`` (~2 MiB
        of resident memory)."""
        if self._rng is None:
            self._rng = np.random.default_rng(self.params.seed)
        return self._rng

    @property
    def greedy(self) -> bool:
        """Whether a choice is the float32 argmax of the logits alone (the forward pass
        can then hand over its rows' argmax: ``Model.forward(logits="argmax")``)."""
        return self.params.temperature == 0.0 and self.params.repetition_penalty == 1.0

    @property
    def uses_history(self) -> bool:
        """Whether a choice depends on the tokens so far (the repetition penalty): callers
        build that list only then."""
        return self.params.repetition_penalty != 1.0

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        p = self.params
        if self.greedy:
            # float32 argmax picks what the float64 copy would (ties, NaN), ~10x sooner:
            # prompt lookup calls this once per row of a verify pass
            return int(np.asarray(logits).argmax())
        z = np.asarray(logits, np.float64).copy()
        if p.repetition_penalty != 1.0 and len(history):
            seen = np.unique(np.asarray(history, np.int64))
            vals = z[seen]
            z[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.temperature == 0.0:
            return int(np.argmax(z))
        z /= p.temperature
        if p.top_k and p.top_k < z.size:
            kth = np.partition(z, -p.top_k)[-p.top_k]
            z[z < kth] = -np.inf
        z -= z.max()
        probs = np.exp(z)
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            keep = cum - probs[order] < p.top_p  # keep tokens until the mass reaches top_p
            mask = np.zeros_like(probs, dtype=bool)
            mask[order[keep]] = True
            probs = np.where(mask, probs, 0.0)
            probs /= probs.sum()
        cdf = np.cumsum(probs)
        r = self.rng.random() * cdf[-1]
        return int(min(np.searchsorted(cdf, r, side="right"), probs.size - 1))

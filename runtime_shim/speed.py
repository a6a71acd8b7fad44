"""How fast a model runs, measured the way llama-bench measures llama.cpp.

Two tests: ``pp<N>`` prefills N tokens into an empty sequence (tokens/s of the prefill);
``tg<N>`` generates N tokens one at a time after a single token (tokens/s of the decode
steps, greedy, EOS ignored). Token ids are fixed pseudo-random ones: speed does not
depend on the text. Each test runs once untimed (warm-up), then ``repetitions`` times.
``edgepack bench`` prints these; ``bench/runtime.py`` uses the same two measurements.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["SpeedTest", "bench_ids", "decode_rate", "measure", "prefill_rate"]


@dataclass(frozen=True)
class SpeedTest:
    """One test's tokens/s over its repetitions."""

    name: str  # pp512, tg128
    n_prompt: int
    n_gen: int
    samples: tuple[float, ...]  # tokens/s of each repetition

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)

    @property
    def stddev(self) -> float:
        return statistics.stdev(self.samples) if len(self.samples) > 1 else 0.0


def prefill_rate(model, prompt: Sequence[int]) -> float:
    """Tokens/s of prefilling ``prompt`` into a new sequence."""
    seq = model.new_sequence()
    try:
        t0 = time.perf_counter()
        model.forward(seq, prompt)
        return len(prompt) / (time.perf_counter() - t0)
    finally:
        seq.release()


def decode_rate(model, prompt: Sequence[int], n: int) -> float:
    """Tokens/s of ``n`` greedy decode steps after prefilling ``prompt`` (EOS ignored)."""
    seq = model.new_sequence()
    try:
        logits = model.forward(seq, prompt)
        tok = int(np.argmax(logits))
        t0 = time.perf_counter()
        for _ in range(n):
            logits = model.forward(seq, [tok])
            tok = int(np.argmax(logits))
        return n / (time.perf_counter() - t0)
    finally:
        seq.release()


def bench_ids(vocab_size: int, n: int) -> list[int]:
    """``n`` fixed pseudo-random token ids below ``vocab_size``."""
    return np.random.default_rng(0).integers(0, vocab_size, n).tolist()


def measure(model, n_prompt: int, n_gen: int, repetitions: int) -> list[SpeedTest]:
    """The ``pp{n_prompt}`` and ``tg{n_gen}`` tests (a count of 0 skips its test)."""
    ids = bench_ids(model.config.vocab_size, max(n_prompt, 1))
    runs = []
    if n_prompt > 0:
        runs.append((f"pp{n_prompt}", n_prompt, 0, lambda: prefill_rate(model, ids)))
    if n_gen > 0:
        runs.append((f"tg{n_gen}", 0, n_gen, lambda: decode_rate(model, ids[:1], n_gen)))
    results = []
    for name, pp, tg, run in runs:
        run()  # warm-up: caches, lazily built kernels, the KV pool
        samples = tuple(run() for _ in range(repetitions))
        results.append(SpeedTest(name, pp, tg, samples))
    return results

"""Greedy choice: the float32 argmax the sampler takes without a repetition penalty is the
id the float64 path picks (lowest id on ties, the first NaN), so skipping the copy
changes no output."""

from __future__ import annotations

import numpy as np
import pytest

from edgepack.runtime_shim.sampling import Sampler, SamplingParams


def _float64_argmax(logits: np.ndarray) -> int:
    return int(np.argmax(np.asarray(logits, np.float64)))


@pytest.mark.parametrize("seed", range(5))
def test_greedy_picks_the_float64_argmax(seed: int) -> None:
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(4096).astype(np.float32)
    logits[rng.integers(0, 4096, 3)] = logits.max()  # ties: the lowest id
    assert Sampler(SamplingParams())(logits, [1, 2, 3]) == _float64_argmax(logits)


def test_greedy_on_non_finite_logits() -> None:
    logits = np.array([1.0, np.inf, 3.0, np.inf, np.nan, 2.0], np.float32)
    assert Sampler(SamplingParams())(logits) == _float64_argmax(logits) == 4
    logits[4] = -np.inf
    assert Sampler(SamplingParams())(logits) == _float64_argmax(logits) == 1


def test_a_repetition_penalty_still_applies_when_greedy() -> None:
    logits = np.array([0.0, 4.0, 3.0], np.float32)
    assert Sampler(SamplingParams(repetition_penalty=2.0))(logits, [1]) == 2
    assert Sampler(SamplingParams())(logits, [1]) == 1

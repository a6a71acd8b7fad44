"""Issue 14's memory budget: what `edgepack run` adds to the resident set of a process that
has imported edgepack stays within weights mapped + KV in use + arena + 40 MiB, and the
statistics report those four figures. RSS from /proc (the peak reset by clear_refs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgepack.cli import main
from edgepack.format import Package
from edgepack.packager.importers.synthetic import (
    TinyLlamaSpec,
    tiny_llama_weights,
    write_gguf_llama,
)

SLACK = 40 * 2**20

# Imports first (the interpreter and libraries are no part of the budget), then the peak
# is reset and `edgepack run` runs in this process.
_SCRIPT = """
import sys
import numpy, tokenizers
import edgepack.cli, edgepack.runtime_shim, edgepack.runtime_shim.stats as stats
if sys.platform != "linux":
    raise SystemExit(3)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = stats.peak_rss_bytes()
code = edgepack.cli.main(sys.argv[1:])
with open(sys.argv[sys.argv.index("--stats-json") + 1] + ".base", "w") as f:
    f.write(str(base))
raise SystemExit(code)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/clear_refs")
def test_run_stays_within_the_memory_budget(tmp_path: Path) -> None:
    spec = TinyLlamaSpec(num_hidden_layers=2, max_position_embeddings=512)
    write_gguf_llama(tmp_path / "m.gguf", spec, tiny_llama_weights(spec))
    pkg = tmp_path / "m.epk"
    assert main(["convert", str(tmp_path / "m.gguf"), "-o", str(pkg), "-q"]) == 0
    stats_file = tmp_path / "stats.json"
    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)
    args = [str(pkg), "-p", prompt, "--max-tokens", "16", "--verify", "none", "-q"]
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, "run", *args, "--stats-json", str(stats_file)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    st = json.loads(stats_file.read_text())
    base = int(Path(f"{stats_file}.base").read_text())
    assert st["kv_bytes"] > 0 and st["arena_bytes"] > 0
    with Package.open(pkg) as opened:  # the tensors' bytes, not the file's
        tensor_bytes = sum(t.nbytes for t in opened.header.tensors)
    assert st["weights_mapped_bytes"] == tensor_bytes < pkg.stat().st_size
    assert 0 < st["rss_before_open_bytes"] <= st["peak_rss_bytes"]
    budget = st["weights_mapped_bytes"] + st["kv_bytes"] + st["arena_bytes"] + SLACK
    assert st["peak_rss_bytes"] - base <= budget, (st, base)

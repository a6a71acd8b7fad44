"""The build's float reference (issue 11 item 13, issue 16): the build says where it
writes it and how big it is, removes it when done, and the next build of the same output
clears the one a killed build left (in RAM or beside the output)."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
from crashkit import kill_at, run_cli

from edgepack.packager.build import Progress, build
from edgepack.packager.build.source import remove_stale_scratch
from edgepack.packager.importers.synthetic import (
    TinyLlamaSpec,
    tiny_llama_weights,
    write_gguf_llama,
)
from edgepack.packager.recipe import load_recipe

_SHM = Path("/dev/shm")
_RECIPE = (
    '[quantize]\nencodings = ["int4", "int8"]\ngroup_sizes = [32]\n'
    "[calibration]\nsamples = 8\nmax_tokens = 32\n"
)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("scratch") / "tiny.gguf"
    spec = TinyLlamaSpec(hidden_size=64, intermediate_size=128, vocab_size=288)
    write_gguf_llama(path, spec, tiny_llama_weights(spec))
    return path


def _scratch(out: Path) -> list[Path]:
    """Every float-reference scratch directory of ``out``, wherever the build put it."""
    places = [out.parent, _SHM] if _SHM.is_dir() else [out.parent]
    return sorted(p for where in places for p in where.glob(f".{out.name}.*.verify"))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


class _Log(Progress):
    def __init__(self) -> None:
        self.lines: list[str] = []

    def log(self, message: str) -> None:
        self.lines.append(message)


def test_float_reference_is_announced_and_removed(gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "m.epk"
    (tmp_path / "r.toml").write_text(_RECIPE)
    recipe = load_recipe(tmp_path / "r.toml")
    log = _Log()
    build(gguf, out, recipe.with_budget(12, None, None, None), progress=log, report=False)
    said = [line for line in log.lines if line.startswith("float reference:")]
    assert len(said) == 1, log.lines
    size = int(said[0].split()[2].replace(",", ""))
    assert size > 4 * 64 * 288  # at least the embedding as float32
    assert "removed when the build ends" in said[0]
    assert _scratch(out) == []


def test_stale_scratch_is_cleared_and_a_live_one_kept(tmp_path: Path) -> None:
    out = tmp_path / "m.epk"
    stale = tmp_path / f".m.epk.{_dead_pid()}-abc123.verify"
    live = tmp_path / ".m.epk.1-abc123.verify"  # pid 1 always runs
    other = tmp_path / f".n.epk.{_dead_pid()}-abc123.verify"  # another output's
    for d in (stale, live, other):
        d.mkdir()
        (d / "float.epk").write_bytes(b"float")
    assert remove_stale_scratch(out) == [stale]
    assert not stale.exists() and live.exists() and other.exists()


def test_killed_build_leaves_scratch_that_the_next_build_clears(
    gguf: Path, tmp_path: Path
) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text(_RECIPE)
    out = tmp_path / f"killed-{tmp_path.name}.epk"  # a unique name: /dev/shm is shared
    args = ["build", str(gguf), "-o", str(out), "--recipe", str(recipe), "--target-bpw", "12",
            "--no-report", "--force"]  # fmt: skip
    killed, lines = kill_at(args, "log:float reference:", random.Random(1))
    assert killed is None, "".join(lines)
    left = _scratch(out)
    assert len(left) == 1, left  # what a kill -9 leaves: the test's premise
    rc, lines = run_cli(args)
    assert rc == 0, "".join(lines)
    assert out.exists()
    assert _scratch(out) == []


def test_a_report_that_fails_halfway_leaves_nothing_under_its_name(
    gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report goes through a scratch directory renamed into place: a build killed or
    failing while writing it leaves no torn OUT.report.md / .png."""
    from edgepack.packager import report

    def torn(*args: object) -> str:
        raise RuntimeError("killed while writing the report")

    monkeypatch.setattr(report, "_markdown", torn)
    (tmp_path / "r.toml").write_text(_RECIPE)
    recipe = load_recipe(tmp_path / "r.toml").with_budget(12, None, None, None)
    out = tmp_path / "m.epk"
    with pytest.raises(RuntimeError, match="killed"):
        build(gguf, out, recipe)
    assert not out.with_suffix(".report.md").exists()
    assert not out.with_suffix(".report.png").exists()
    assert _scratch(out) == []

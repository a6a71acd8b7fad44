"""Issue 16: progress of long jobs. Without a terminal (CI logs) exactly one plain line
per phase, no ``\\r`` and nothing left of a phase that failed; on a terminal at 80
columns a live line with the phase counter and its numbers; ``-q``/``--json`` silence it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgepack.cli import main
from edgepack.cli.progress import PhaseProgress, format_bytes, format_count
from edgepack.format import Package
from edgepack.packager.importers.synthetic import (
    TinyLlamaSpec,
    tiny_llama_weights,
    write_gguf_llama,
)

PHASE_LINE = re.compile(r"^phase (\d+)/(\d+) (.+): (.+) in \d+\.\d s$")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("progress")
    spec = TinyLlamaSpec(num_hidden_layers=1, max_position_embeddings=64)
    write_gguf_llama(d / "m.gguf", spec, tiny_llama_weights(spec))
    (d / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 8)
    for args in (
        ["convert", str(d / "m.gguf"), "-o", str(d / "a.epk")],
        ["convert", str(d / "m.gguf"), "-o", str(d / "b.epk"), "--encoding", "int8"],
        ["diff", str(d / "a.epk"), str(d / "b.epk"), "-o", str(d / "d.epkd")],
    ):
        assert main([*args, "-q"]) == 0, args
    return d


def _run(capsys: pytest.CaptureFixture[str], args: list[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def _phase_lines(err: str) -> list[re.Match[str]]:
    return [m for m in map(PHASE_LINE.match, err.splitlines()) if m]


def test_build_prints_one_numbered_line_per_phase(
    work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["build", str(work / "m.gguf"), "-o", str(tmp_path / "x.epk"),
            "--calib", str(work / "text.txt"), "--no-report"]
    code, _, err = _run(capsys, args)
    assert code == 0, err
    assert "\r" not in err and "━" not in err  # no bar remnants in a log
    lines = _phase_lines(err)
    numbers = [int(m.group(1)) for m in lines]
    totals = {int(m.group(2)) for m in lines}
    names = [m.group(3) for m in lines]
    assert len(totals) == 1 and len(lines) >= 5, err
    assert numbers == sorted(numbers) and len(set(names)) == len(names), err  # once each
    assert {"sensitivity", "search", "quantize", "write"} <= set(names), names
    assert all(re.fullmatch(r"[\d,.]+[MG]?/[\d,.]+[MG]?", m.group(4)) for m in lines), err


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("convert", r"^converting: 71,872/71,872 weights in \d+\.\d s$"),
        ("verify", r"^verifying: \d+\.\d kB in \d+\.\d s$"),
        ("patch", r"^patching: 83\.\d kB in \d+\.\d s$"),
        ("diff", r"^phase 2/2 code and write, verify: done in \d+\.\d s$"),
        ("eval", r"^PPL: 2/2 chunks in \d+\.\d s$"),
    ],
)
def test_other_long_jobs_print_one_plain_line_per_phase(
    command: str, expected: str, work: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = {
        "convert": ["convert", str(work / "m.gguf"), "-o", str(tmp_path / "x.epk")],
        "verify": ["verify", str(work / "a.epk")],
        "patch": ["patch", str(work / "a.epk"), str(work / "d.epkd"), "-o", str(tmp_path / "p")],
        "diff": ["diff", str(work / "a.epk"), str(work / "b.epk"), "-o", str(tmp_path / "d")],
        "eval": ["eval", str(work / "b.epk"), "--text", str(work / "text.txt"), "--ctx", "16",
                 "--chunks", "2"],
    }[command]
    code, _, err = _run(capsys, args)
    assert code == 0, err
    assert "\r" not in err
    assert sum(bool(re.match(expected, line)) for line in err.splitlines()) == 1, err


def _corrupt_tensor(src: Path, dst: Path) -> None:
    """``src`` with one byte of its last tensor flipped: it opens, verify fails midway."""
    raw = bytearray(src.read_bytes())
    with Package.open(src) as pkg:
        codes = pkg.header.tensors[-1].codes  # offsets are from the start of the file
    raw[codes.offset + codes.length // 2] ^= 0xFF
    dst.write_bytes(bytes(raw))


def test_failed_phase_leaves_nothing_before_the_error(
    work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.epk"
    _corrupt_tensor(work / "a.epk", bad)
    code, _, err = _run(capsys, ["verify", str(bad)])
    assert code != 0
    assert "verifying" not in err and "%" not in err and "\r" not in err, err
    assert err.strip().splitlines()[-1].startswith("error:"), err


@pytest.mark.parametrize("flag", ["-q", "--json"])
def test_quiet_and_json_silence_progress(
    flag: str, work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["diff", str(work / "a.epk"), str(work / "b.epk"), "-o", str(tmp_path / "d"), flag]
    code, out, err = _run(capsys, args)
    assert code == 0, err
    assert not _phase_lines(err) and "plan tensors" not in err + out, err
    if flag == "--json":
        assert json.loads(out)["result"]["path"] == str(tmp_path / "d")  # stdout: only it


def test_phase_counter_and_total_eta_follow_the_plan() -> None:
    job = PhaseProgress(enabled=True)
    job.plan(["a", "b", "c"])
    job.phase("b", 10)
    job.advance(5)
    assert job.current is not None and job.label(job.current) == "phase 2/3 b"
    assert job.total_remaining() is not None  # 1.5 of 3 phases done
    job.phase("unplanned", 1)
    assert job.label(job.current) == "unplanned"
    assert format_bytes(83_776) == "83.8 kB" and format_count(134_515_008) == "134.5M"


def _script_available() -> bool:
    return shutil.which("script") is not None and sys.platform.startswith("linux")


@pytest.mark.skipif(not _script_available(), reason="needs util-linux script(1)")
def test_terminal_shows_phase_counter_and_numbers_at_80_columns(
    work: Path, tmp_path: Path
) -> None:
    out = tmp_path / "x.epk"
    argv = [sys.executable, "-m", "edgepack.cli", "build", str(work / "m.gguf"), "-o",
            str(out), "--calib", str(work / "text.txt"), "--no-report"]
    env = {**os.environ, "COLUMNS": "80", "TERM": "xterm"}
    env.pop("NO_COLOR", None)
    proc = subprocess.run(
        ["script", "-q", "-e", "-c", subprocess.list2cmdline(argv), "/dev/null"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    frames = [ANSI.sub("", f) for f in re.split(r"[\r\n]+", proc.stdout)]
    live = [f for f in frames if "━" in f]  # the redrawn bar lines
    assert live, proc.stdout
    assert all(len(f.rstrip()) <= 80 for f in live), max(live, key=len)
    assert any(re.match(r"phase 3/\d+ sensitivity .*━.* \d+/\d+ ", f) for f in live), live
    assert any("total " in f for f in live), live  # the whole job's ETA
    assert out.is_file()


def test_publish_prints_its_phases_with_counts(
    work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Verify, store, deltas (counted per base release), sign: one numbered line each."""
    store, keys = tmp_path / "store", tmp_path / "keys"
    assert main(["repo", "init", "--store", str(store), "--keys-dir", str(keys), "-q"]) == 0
    common = ["--store", str(store), "--keys-dir", str(keys), "--channel", "beta",
              "--model", "tiny"]
    v2 = tmp_path / "v2.epk"
    assert main(["convert", str(work / "m.gguf"), "-o", str(v2), "--encoding", "int8",
                 "--model-version", "1.1.0", "-q"]) == 0
    assert main(["publish", str(work / "a.epk"), *common, "-q"]) == 0
    code, _, err = _run(capsys, ["publish", str(v2), *common])
    assert code == 0, err
    assert "\r" not in err and "━" not in err
    lines = _phase_lines(err)
    assert [m.group(3) for m in lines] == ["verify", "store package", "deltas",
                                           "sign metadata"], err
    assert {int(m.group(2)) for m in lines} == {4}
    assert lines[2].group(4) == "1/1", err  # one delta, from 1.0.0

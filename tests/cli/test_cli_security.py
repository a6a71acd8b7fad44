"""Issue 11 items 1-2 on the command line: `run --trusted-key` refuses tampered weights,
`--threshold` below 1 is a usage error for verify/patch/run, and with no trusted key
verify/patch say so in one line or (`--require-signature`) exit 4."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from deltafactory import mutate, random_spec, write_spec
from test_delta_cli import run
from tinymodel import write_tiny_llama

from edgepack.format import Package


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cli-security")
    write_tiny_llama(d / "model")
    assert run("keygen", str(d / "rel")).returncode == 0
    pkg = d / "signed.epk"
    r = run("convert", str(d / "model"), "-o", str(pkg), "--encoding", "int4-g32",
            "--sign-key", str(d / "rel.key"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    with Package.open(pkg) as p:
        span = p.entry("embed.weight").codes
    data = bytearray(pkg.read_bytes())
    data[span.offset : span.offset + 64] = bytes(64)
    (d / "tampered.epk").write_bytes(bytes(data))
    rng = np.random.default_rng(5)
    spec = random_spec(rng, 4)
    write_spec(d / "old.epk", spec)
    write_spec(d / "new.epk", mutate(spec, rng))
    r = run("diff", str(d / "old.epk"), str(d / "new.epk"), "-o", str(d / "d.epkd"),
            "--sign-key", str(d / "rel.key"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    return d


def test_run_with_a_trusted_key_refuses_tampered_weights(work: Path) -> None:
    r = run("run", str(work / "tampered.epk"), "-p", "hi", "--max-tokens", "1",
            "--trusted-key", str(work / "rel.pub"), "--kernels", "numpy")  # fmt: skip
    assert r.returncode == 3, r.stderr
    assert "embed.weight" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("threshold", ["0", "-1"])
def test_a_threshold_below_one_is_a_usage_error(work: Path, threshold: str) -> None:
    key = ["--trusted-key", str(work / "rel.pub"), "--threshold", threshold]
    commands = [
        ["verify", str(work / "signed.epk")],
        ["patch", str(work / "old.epk"), str(work / "d.epkd"), "-o", str(work / "x.epk")],
        ["run", str(work / "signed.epk"), "-p", "hi", "--max-tokens", "1"],
    ]
    for args in commands:
        r = run(*args, *key)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert "threshold" in r.stderr.lower()
    assert not (work / "x.epk").exists()


def test_no_trusted_key_warns_once_or_fails_when_a_signature_is_required(work: Path) -> None:
    r = run("verify", str(work / "signed.epk"))
    assert r.returncode == 0, r.stderr
    warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "no trusted key" in warnings[0]
    out = work / "p.epk"
    r = run("patch", str(work / "old.epk"), str(work / "d.epkd"), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.startswith("warning:")]) == 1
    out.unlink()
    for args in (
        ["verify", str(work / "signed.epk")],
        ["patch", str(work / "old.epk"), str(work / "d.epkd"), "-o", str(out)],
        ["run", str(work / "signed.epk"), "-p", "hi", "--max-tokens", "1"],
    ):
        r = run(*args, "--require-signature")
        assert r.returncode == 4, (args, r.stderr)
        assert "Traceback" not in r.stderr
    assert not out.exists()

"""`edgepack diff` / `edgepack patch`: output and the documented exit codes
(0 ok, 2 usage, 3 corrupt delta or wrong base, 4 signature, 5 newer delta format)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from deltafactory import mutate, random_spec, write_spec


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgepack.cli", *args], capture_output=True, text=True
    )


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("delta-cli")
    rng = np.random.default_rng(21)
    spec = random_spec(rng, 6)
    write_spec(d / "old.epk", spec)
    write_spec(d / "new.epk", mutate(spec, rng))
    write_spec(d / "other.epk", random_spec(np.random.default_rng(22), 3))
    assert run("keygen", str(d / "rel")).returncode == 0
    assert run("keygen", str(d / "stranger")).returncode == 0
    r = run(
        "diff",
        str(d / "old.epk"),
        str(d / "new.epk"),
        "-o",
        str(d / "d.epkd"),
        "--sign-key",
        str(d / "rel.key"),
    )
    assert r.returncode == 0, r.stderr
    assert "signed by 1 key" in r.stdout
    return d


def test_patch_ok_with_trusted_key(work: Path) -> None:
    out = work / "out.epk"
    r = run(
        "patch",
        str(work / "old.epk"),
        str(work / "d.epkd"),
        "-o",
        str(out),
        "--trusted-key",
        str(work / "rel.pub"),
    )
    assert r.returncode == 0, r.stderr
    assert "verified" in r.stdout and "signed by trusted key" in r.stdout
    assert out.read_bytes() == (work / "new.epk").read_bytes()
    r = run("verify", str(out))
    assert r.returncode == 0, r.stderr


def test_wrong_base_exit_3(work: Path) -> None:
    r = run("patch", str(work / "other.epk"), str(work / "d.epkd"), "-o", str(work / "x.epk"))
    assert r.returncode == 3
    assert r.stderr.startswith("error: base is") and "Traceback" not in r.stderr
    assert not (work / "x.epk").exists()


def test_corrupt_delta_exit_3(work: Path) -> None:
    raw = bytearray((work / "d.epkd").read_bytes())
    raw[len(raw) // 2] ^= 0x40
    (work / "bad.epkd").write_bytes(bytes(raw))
    r = run("patch", str(work / "old.epk"), str(work / "bad.epkd"), "-o", str(work / "x.epk"))
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr
    assert not (work / "x.epk").exists()


def test_untrusted_signature_exit_4(work: Path) -> None:
    r = run(
        "patch",
        str(work / "old.epk"),
        str(work / "d.epkd"),
        "-o",
        str(work / "x.epk"),
        "--trusted-key",
        str(work / "stranger.pub"),
    )
    assert r.returncode == 4
    assert "not by a trusted key" in r.stderr
    assert not (work / "x.epk").exists()


def test_newer_delta_major_exit_5(work: Path) -> None:
    raw = bytearray((work / "d.epkd").read_bytes())
    raw[8:10] = (7).to_bytes(2, "little")
    (work / "v7.epkd").write_bytes(bytes(raw))
    r = run("patch", str(work / "old.epk"), str(work / "v7.epkd"), "-o", str(work / "x.epk"))
    assert r.returncode == 5
    assert "update the app" in r.stderr


def test_usage_errors_exit_2(work: Path) -> None:
    assert run("patch", str(work / "old.epk"), str(work / "d.epkd")).returncode == 2  # no -o
    assert run("patch", str(work / "missing.epk"), str(work / "d.epkd"), "-o", "x").returncode == 2
    assert run("diff", str(work / "old.epk")).returncode == 2
    r = run(
        "diff",
        str(work / "old.epk"),
        str(work / "new.epk"),
        "-o",
        str(work / "y.epkd"),
        "--level",
        "99",
    )
    assert r.returncode == 2


def test_diff_of_a_non_package_exit_3(work: Path) -> None:
    junk = work / "junk.epk"
    junk.write_bytes(b"junk" * 100)
    r = run("diff", str(work / "old.epk"), str(junk), "-o", str(work / "j.epkd"))
    assert r.returncode == 3
    assert not (work / "j.epkd").exists()

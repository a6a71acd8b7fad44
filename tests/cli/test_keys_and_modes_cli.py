"""Friction from issue 16: keygen names, key files of the wrong kind, output modes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from edgepack.cli import main


@pytest.mark.parametrize("given", ["k1", "k1.key", "k1.pub"])
def test_keygen_drops_a_key_suffix(tmp_path: Path, given: str) -> None:
    assert main(["keygen", str(tmp_path / given)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k1.key", "k1.pub"]
    assert (tmp_path / "k1.key").stat().st_mode & 0o777 == 0o600


def _openssh_key(tmp_path: Path) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = tmp_path / "id_ed25519"
    raw = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    path.write_bytes(raw)
    return path


def _rsa_key(tmp_path: Path) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    path = tmp_path / "rsa.pem"
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


@pytest.mark.parametrize(
    ("make", "what"),
    [
        (lambda d: (main(["keygen", str(d / "k")]), d / "k.pub")[1], "an Ed25519 public key"),
        (_openssh_key, "an OpenSSH private key"),
        (_rsa_key, "an RSA private key"),
    ],
)
def test_wrong_sign_key_says_what_it_is(
    tmp_path: Path, make, what: str, capsys: pytest.CaptureFixture
) -> None:
    from pkgfactory import build_package

    key = make(tmp_path)
    capsys.readouterr()
    pkg = build_package(tmp_path / "p.epk").path
    args = ["resign", str(pkg), "-o", str(tmp_path / "o.epk"), "--sign-key", str(key)]
    assert main(args) == 4
    err = capsys.readouterr().err
    assert f"is {what}; an Ed25519 private key in PEM is needed" in err, err
    assert "Could not deserialize" not in err


def test_wrong_trusted_key_says_what_it_is(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from pkgfactory import build_package

    assert main(["keygen", str(tmp_path / "k")]) == 0
    pkg = build_package(tmp_path / "p.epk").path
    assert main(["verify", str(pkg), "--trusted-key", str(tmp_path / "k.key")]) == 4
    assert "is an Ed25519 private key; an Ed25519 public key" in capsys.readouterr().err


def test_packages_honour_the_umask(tmp_path: Path) -> None:
    """A package is written mode 0666 minus the umask (keys stay 0600)."""
    from tinymodel import write_tiny_llama

    write_tiny_llama(tmp_path / "m")
    script = (
        "import os, sys; os.umask(0o022); from edgepack.cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    out = tmp_path / "m.epk"
    cmd = [sys.executable, "-c", script, "convert", str(tmp_path / "m"), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert out.stat().st_mode & 0o777 == 0o644


def test_inspect_describes_a_delta(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import json

    from pkgfactory import build_package

    old = build_package(tmp_path / "old.epk", seed=0).path
    new = build_package(tmp_path / "new.epk", seed=1).path
    delta = tmp_path / "u.epkd"
    assert main(["diff", str(old), str(new), "-o", str(delta)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(delta)]) == 0
    text = capsys.readouterr().out
    assert "edgepack delta" in text and "unsigned" in text
    assert f"{new.stat().st_size:,} bytes" in text
    assert main(["inspect", str(delta), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "delta" and doc["target"]["file_size"] == new.stat().st_size
    assert doc["file_size"] == delta.stat().st_size

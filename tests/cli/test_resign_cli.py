"""`edgepack resign`: new name/version and signature, data bytes unchanged, input never
written; the data region moves only when the new header outgrows its pages."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from edgepack.cli import main
from edgepack.format import (
    Encoding,
    ModelIdentity,
    Package,
    PackageWriter,
    SignatureError,
    load_public_key,
)
from edgepack.format.constants import PREAMBLE_SIZE
from edgepack.format.resign import resign


def _package(path: Path, padding: int = 0) -> Path:
    identity = ModelIdentity("tiny", "1.0.0", "llama", {"pad": "x" * padding})
    with PackageWriter(path, identity) as w:
        w.add_tensor("w", Encoding.F32, np.arange(2048, dtype=np.float32))
    return path


def _slack(path: Path) -> int:
    """Bytes free between the header's end and the data region."""
    with Package.open(path) as pkg:
        return pkg.preamble.data_offset - PREAMBLE_SIZE - pkg.preamble.header_length


def _data(pkg_path: Path) -> bytes:
    with Package.open(pkg_path) as pkg:
        pre = pkg.preamble
    return pkg_path.read_bytes()[pre.data_offset : pre.data_end]


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    assert main(["keygen", str(tmp_path / "k1")]) == 0
    assert main(["keygen", str(tmp_path / "k2")]) == 0
    return tmp_path


def test_resign_rewrites_header_and_signature_only(keys: Path, tmp_path: Path) -> None:
    src = _package(tmp_path / "a.epk")
    before = hashlib.sha256(src.read_bytes()).digest()
    out = tmp_path / "b.epk"
    args = ["resign", str(src), "-o", str(out), "--model-version", "1.3.0"]
    assert main([*args, "--model-name", "tiny-2", "--sign-key", str(keys / "k2.key")]) == 0
    assert hashlib.sha256(src.read_bytes()).digest() == before  # input untouched
    with Package.open(out) as pkg, Package.open(src) as old:
        assert (pkg.header.identity.name, pkg.header.identity.version) == ("tiny-2", "1.3.0")
        assert pkg.preamble.data_offset == old.preamble.data_offset
        pkg.verify([load_public_key(keys / "k2.pub")])
        with pytest.raises(SignatureError):
            pkg.verify([load_public_key(keys / "k1.pub")])
        assert np.array_equal(pkg.tensor("w"), old.tensor("w"))
    assert _data(out) == _data(src)


def test_resign_moves_data_when_the_header_outgrows_its_page(keys: Path, tmp_path: Path) -> None:
    # config padding that leaves the header a few bytes short of the page boundary
    padding = max(0, _slack(_package(tmp_path / "a.epk")) - 8)
    while _slack(src := _package(tmp_path / "a.epk", padding)) >= 16:
        padding += 4
    from edgepack.format import load_private_key

    out = tmp_path / "b.epk"
    key = load_private_key(keys / "k1.key")
    result = resign(src, out, signing_keys=[key], version="1.0.0-rc.1+build.20261201")
    assert result.data_moved
    with Package.open(out) as pkg, Package.open(src) as old:
        assert pkg.preamble.data_offset > old.preamble.data_offset
        pkg.verify([load_public_key(keys / "k1.pub")])
        assert np.array_equal(pkg.tensor("w"), old.tensor("w"))
    assert _data(out) == _data(src)


def test_resign_refuses_its_input_and_bad_fields(keys: Path, tmp_path: Path) -> None:
    src = _package(tmp_path / "a.epk")
    before = src.read_bytes()
    key = ["--sign-key", str(keys / "k1.key")]
    assert main(["resign", str(src), "-o", str(src), *key]) == 2
    assert main(["resign", str(src), "-o", str(tmp_path / "b.epk"), "--model-version", "2"]) == 2
    bad_name = ["--model-name", "a/b", *key]
    assert main(["resign", str(src), "-o", str(tmp_path / "b.epk"), *bad_name]) == 2
    assert main(["resign", str(src), "-o", str(tmp_path / "b.epk")]) == 2  # no key
    assert src.read_bytes() == before and not (tmp_path / "b.epk").exists()


def test_resign_refuses_a_corrupt_package(keys: Path, tmp_path: Path) -> None:
    src = _package(tmp_path / "a.epk")
    raw = bytearray(src.read_bytes())
    with Package.open(src) as pkg:
        raw[pkg.preamble.data_offset + 10] ^= 0xFF
    src.write_bytes(bytes(raw))
    out = tmp_path / "b.epk"
    assert main(["resign", str(src), "-o", str(out), "--sign-key", str(keys / "k1.key")]) == 3
    assert not out.exists()

"""Issue 11 items 1-2 at the API: a trusted signature means trusted weights (tensors are
hashed before use, or a verified-install record of the unchanged file stands in), one
warning when nothing is checked, and no threshold below 1."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from runtime_fixtures import tiny_model_dir

import edgepack.runtime_shim as rt
from edgepack.format import (
    CorruptPackageError,
    Package,
    SignatureError,
    generate_keypair,
    load_private_key,
)


@pytest.fixture(scope="module")
def integrity():
    """The module under test, imported here so each test fails on its own before it."""
    from edgepack.runtime_shim import integrity

    return integrity


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a signed int4 tiny Llama, the trusted .pub)."""
    from edgepack.packager.convert import convert

    root = tmp_path_factory.mktemp("integrity")
    key, pub = generate_keypair(root / "release")
    out = root / "signed.epk"
    convert(tiny_model_dir(root), out, encoding="int4-g32", signing_keys=[load_private_key(key)])
    return out, pub


def _tampered_copy(src: Path, dest: Path, tensor: str = "embed.weight") -> Path:
    """``src`` with bytes of ``tensor``'s codes overwritten after signing."""
    with Package.open(src) as pkg:
        span = pkg.entry(tensor).codes
    data = bytearray(src.read_bytes())
    data[span.offset : span.offset + 16] = bytes(16)
    dest.write_bytes(bytes(data))
    return dest


def test_tampered_weights_are_refused_in_the_default_mode(signed, tmp_path: Path) -> None:
    pkg, pub = signed
    bad = _tampered_copy(pkg, tmp_path / "bad.epk")
    with rt.open(pkg, trusted_keys=[pub], kernels="numpy"):
        pass  # the untouched package opens
    with pytest.raises(CorruptPackageError, match=r"embed\.weight"):
        rt.open(bad, trusted_keys=[pub], kernels="numpy")


def test_verify_weights_hashes_every_tensor_on_several_threads(integrity, signed) -> None:
    pkg, _ = signed
    with Package.open(pkg) as p:
        total = sum(t.nbytes for t in p.header.tensors)
        assert integrity.verify_weights(p, threads=2) == total
        assert integrity.verify_weights(p, threads=1) == total


def test_a_record_skips_rehashing_only_while_the_file_is_unchanged(
    integrity, signed, tmp_path: Path
) -> None:
    src, pub = signed
    pkg = tmp_path / "installed.epk"
    pkg.write_bytes(src.read_bytes())
    records = tmp_path / "records"
    record = integrity.record_verified(pkg, [pub], records)
    assert oct(records.stat().st_mode & 0o777) == oct(0o700)
    with Package.open(pkg) as p:
        assert integrity.find_record(p, records) == record
        assert integrity.check_weights(p, records) == "record"
    # overwrite the weights in place (same inode, same size): ctime moves, the record dies
    _tampered_copy(pkg, pkg)
    with Package.open(pkg) as p:
        assert integrity.find_record(p, records) is None
    with pytest.raises(CorruptPackageError):
        rt.open(pkg, trusted_keys=[pub], kernels="numpy", integrity_records=records)


def test_a_record_others_can_write_is_ignored(integrity, signed, tmp_path: Path) -> None:
    src, pub = signed
    records = tmp_path / "records"
    integrity.record_verified(src, [pub], records)
    with Package.open(src) as p:
        assert integrity.find_record(p, records) is not None
        os.chmod(records, 0o777)
        assert integrity.find_record(p, records) is None
        assert integrity.check_weights(p, records) == "hashed"


def test_a_record_needs_a_verified_signature(integrity, signed, tmp_path: Path) -> None:
    src, _ = signed
    _, other = generate_keypair(tmp_path / "other")
    with pytest.raises(SignatureError):
        integrity.record_verified(src, [other], tmp_path / "records")
    assert not list((tmp_path / "records").glob("*.json"))


def test_no_trusted_key_logs_one_warning_or_fails_when_required(signed, caplog) -> None:
    pkg, _ = signed
    with caplog.at_level(logging.WARNING, logger="edgepack"):
        rt.open(pkg, kernels="numpy").close()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "no trusted key" in warnings[0].getMessage()
    with pytest.raises(SignatureError, match="required"):
        rt.open(pkg, kernels="numpy", require_signature=True)


@pytest.mark.parametrize("threshold", [0, -1])
def test_a_threshold_below_one_is_a_typed_error(signed, threshold: int) -> None:
    from edgepack.format.errors import InvalidThresholdError

    pkg, pub = signed
    with pytest.raises(InvalidThresholdError):
        rt.open(pkg, trusted_keys=[pub], threshold=threshold, kernels="numpy")
    with pytest.raises(InvalidThresholdError), Package.open(pkg) as p:
        p.verify([], threshold=threshold)

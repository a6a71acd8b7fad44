"""The checked-in generated code is what Debian's flatc makes of spec/edgepack.fbs, and the
Python constants agree with the schema's enums."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
from pathlib import Path

import pytest

from edgepack.format import constants
from edgepack.format.schema import (
    Compression,
    Encoding,
    HashAlgorithm,
    SectionKind,
    SignatureAlgorithm,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("flatc") is None, reason="flatc (flatbuffers-compiler) missing")
def test_generated_code_matches_flatc(tmp_path: Path) -> None:
    subprocess.run(
        ["flatc", "--python", "-o", str(tmp_path), str(ROOT / "spec" / "edgepack.fbs")],
        check=True,
    )
    generated = tmp_path / "edgepack" / "format" / "schema"
    checked_in = ROOT / "format" / "schema"
    names = sorted(p.name for p in generated.glob("*.py"))
    assert names == sorted(p.name for p in checked_in.glob("*.py"))
    _match, mismatch, errors = filecmp.cmpfiles(generated, checked_in, names, shallow=False)
    assert not mismatch and not errors, f"regenerate format/schema: {mismatch + errors}"


@pytest.mark.parametrize(
    ("ours", "generated"),
    [
        (constants.Encoding, Encoding.Encoding),
        (constants.SectionKind, SectionKind.SectionKind),
        (constants.Compression, Compression.Compression),
        (constants.HashAlgorithm, HashAlgorithm.HashAlgorithm),
        (constants.SignatureAlgorithm, SignatureAlgorithm.SignatureAlgorithm),
    ],
)
def test_enums_agree_with_schema(ours, generated) -> None:
    schema_values = {
        name: value for name, value in vars(generated).items() if not name.startswith("_")
    }
    assert schema_values == {m.name: m.value for m in ours}

"""Found by bench/fuzz.py (package mutant #228969, seed 0xED6E): a bit flip in the
signature block's flatbuffer vtable-size field decodes to the same signatures, so the
package still verified although its bytes changed. Readers now require the block's
canonical encoding (spec/FORMAT.md section 7), so a signed file's bytes are unique.
"""

from __future__ import annotations

import pytest
from pkgfactory import build_package, file_parts, make_key

from edgepack.format import Package, SignatureError


def test_a_non_canonical_signature_block_is_refused(tmp_path):
    built = build_package(tmp_path / "a.epk", seed=1)
    raw = bytearray(built.path.read_bytes())
    start = file_parts(bytes(raw)).preamble.data_end
    assert raw[start + 4 : start + 8] == b"EPKS"
    raw[start + 11] ^= 0x08  # the vtable's size: 6 -> 2054 bytes, same decoded fields
    mutated = tmp_path / "b.epk"
    mutated.write_bytes(bytes(raw))
    with Package.open(mutated) as pkg, pytest.raises(SignatureError, match="canonically"):
        pkg.verify(trusted_keys=[make_key(0).public_key()])


def test_the_canonical_block_still_verifies(tmp_path):
    built = build_package(tmp_path / "a.epk", seed=1)
    with Package.open(built.path) as pkg:
        assert pkg.verify(trusted_keys=[make_key(0).public_key()]).signed

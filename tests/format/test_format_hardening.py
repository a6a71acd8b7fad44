"""Targeted hostile-input cases for the reader, each naming the typed error it must raise.

Organised like spec/FORMAT.md: preamble and layout (sections 1-2), header semantics
(3-5), integrity (6), signatures (7), compatibility (8), plus golden bytes, writer
determinism and a field-by-field header round trip. Cases that the current reader gets
wrong are ``xfail(strict=True)`` with the reason: they start failing (XPASS) once fixed.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import zstandard
from pkgfactory import (
    KEEP_SIGNATURE,
    BuiltPackage,
    build_package,
    file_parts,
    make_key,
    replace_header,
)

from edgepack.cli.exit_codes import (
    EXIT_CORRUPT,
    EXIT_INCOMPATIBLE,
    EXIT_SIGNATURE,
    exit_code_for,
)
from edgepack.format import (
    CorruptPackageError,
    EdgepackError,
    Encoding,
    Header,
    IncompatiblePackageError,
    ModelIdentity,
    Package,
    PackageWriter,
    Provenance,
    RuntimeCapabilities,
    SectionKind,
    SignatureError,
    Span,
    TruncatedPackageError,
    UnsupportedFeatureError,
    check_compatibility,
)

SIGNED_CONTEXT = b"edgepack/v1/signature\x00"  # spec section 7
Writer = Callable[[bytes], Path]  # writes bytes to a scratch .epk, returns its path
ALL_OPERATORS = {
    "llama.decoder": 1,
    "matmul.int4_group_sym": 1,
    "matmul.int4_group_asym": 1,
    "matmul.int8_channel": 1,
    "matmul.low_rank": 1,
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> BuiltPackage:
    return build_package(tmp_path_factory.mktemp("hardening") / "tiny.epk")


@pytest.fixture(scope="module")
def raw(built: BuiltPackage) -> bytes:
    return built.read_bytes()


@pytest.fixture(scope="module")
def header(built: BuiltPackage) -> Header:
    with Package.open(built.path) as pkg:
        return pkg.header


@pytest.fixture
def write(tmp_path: Path) -> Writer:
    def _write(data: bytes) -> Path:
        path = tmp_path / "case.epk"
        path.write_bytes(data)
        return path

    return _write


def open_and_verify(path: Path, built: BuiltPackage) -> None:
    with Package.open(path) as pkg:
        pkg.verify(trusted_keys=[built.public_key])


def with_tensor(h: Header, target: str, **changes: object) -> Header:
    return replace(
        h, tensors=tuple(replace(t, **changes) if t.name == target else t for t in h.tensors)
    )


def with_section(h: Header, target: str, **changes: object) -> Header:
    return replace(
        h, sections=tuple(replace(s, **changes) if s.name == target else s for s in h.sections)
    )


def set_u16(data: bytes, pos: int, value: int) -> bytes:
    return data[:pos] + struct.pack("<H", value) + data[pos + 2 :]


# --------------------------------------------------------------- preamble and layout


def test_bad_magic(raw: bytes, write: Writer) -> None:
    with pytest.raises(CorruptPackageError, match="bad magic") as err:
        Package.open(write(b"GGUF" + raw[4:]))
    assert exit_code_for(err.value) == EXIT_CORRUPT


def test_text_mode_mangled_magic(raw: bytes, write: Writer) -> None:
    mangled = raw[:4] + b"\n" + raw[6:]  # CRLF -> LF, as a text-mode transfer would
    with pytest.raises(CorruptPackageError, match="not an edgepack package"):
        Package.open(write(mangled))


def test_newer_format_major_is_incompatible(raw: bytes, write: Writer) -> None:
    with pytest.raises(IncompatiblePackageError, match=r"format version 2.*update the app") as err:
        Package.open(write(set_u16(raw, 8, 2)))
    assert exit_code_for(err.value) == EXIT_INCOMPATIBLE


def test_newer_format_minor_is_readable(built: BuiltPackage, raw: bytes, write: Writer) -> None:
    open_and_verify(write(set_u16(raw, 10, 7)), built)


@pytest.mark.parametrize("where", ["data", "signature", "header", "preamble"])
def test_truncated_file(raw: bytes, write: Writer, where: str) -> None:
    cut = {"data": len(raw) // 2, "signature": len(raw) - 1, "header": 300, "preamble": 50}
    with pytest.raises(TruncatedPackageError, match=r"truncated|shorter than") as err:
        Package.open(write(raw[: cut[where]]))
    assert "bytes" in str(err.value)


def test_empty_file_is_not_a_package(write: Writer) -> None:
    with pytest.raises(CorruptPackageError, match="not an edgepack package") as err:
        Package.open(write(b""))
    assert not isinstance(err.value, TruncatedPackageError)


def test_trailing_bytes(raw: bytes, write: Writer) -> None:
    with pytest.raises(CorruptPackageError, match="3 unexpected trailing bytes") as err:
        Package.open(write(raw + b"\0\0\0"))
    assert not isinstance(err.value, TruncatedPackageError)


def test_header_digest_mismatch(raw: bytes, write: Writer) -> None:
    pos = 128 + raw[128:].index(b"tiny-llama")  # a byte inside the header
    tampered = raw[:pos] + b"T" + raw[pos + 1 :]
    with pytest.raises(CorruptPackageError, match="header digest mismatch"):
        Package.open(write(tampered))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (32, 4096 + 64, "not page aligned"),  # data_offset
        (24, 0, "header length 0"),  # header_length
        (16, 64, "header overlaps the preamble"),  # header_offset
        (16, 8000, "header overlaps the data region"),
        (48, 12345, "signature block is not right after the data region"),
    ],
)
def test_preamble_layout_errors(
    raw: bytes, write: Writer, field: int, value: int, message: str
) -> None:
    mutated = raw[:field] + struct.pack("<Q", value) + raw[field + 8 :]
    with pytest.raises(CorruptPackageError, match=message):
        Package.open(write(mutated))


# --------------------------------------------------------------- header semantics


def forged(raw: bytes, h: Header, built: BuiltPackage) -> bytes:
    """Re-signed by the trusted key: only the semantic validator stands in the way."""
    return replace_header(raw, h, sign_with=built.key)


def test_overlapping_tensors(
    raw: bytes, header: Header, built: BuiltPackage, write: Writer
) -> None:
    a, b = header.tensors[0], header.tensors[1]
    h = with_tensor(header, b.name, codes=Span(a.codes.offset + 64, b.codes.length))
    with pytest.raises(
        CorruptPackageError, match=re.escape(f"'{b.name}': data overlaps tensor '{a.name}'")
    ):
        Package.open(write(forged(raw, h, built)))


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("past_end", "runs past the end of the data region"),
        ("in_header", "overlaps the start of the data region"),
        ("overflow", "runs past the end of the data region"),
    ],
)
def test_span_outside_data_region(
    raw: bytes, header: Header, built: BuiltPackage, write: Writer, where: str, message: str
) -> None:
    t = header.tensors[-1]
    data_end = file_parts(raw).preamble.data_end
    offset = {"past_end": data_end, "in_header": 128, "overflow": (1 << 64) - 64}[where]
    h = with_tensor(header, t.name, codes=Span(offset, t.codes.length))
    with pytest.raises(CorruptPackageError, match=message) as err:
        Package.open(write(forged(raw, h, built)))
    assert t.name in str(err.value)


def test_misaligned_span(raw: bytes, header: Header, built: BuiltPackage, write: Writer) -> None:
    t = header.tensors[0]
    h = with_tensor(header, t.name, codes=Span(t.codes.offset + 8, t.codes.length))
    with pytest.raises(CorruptPackageError, match="not 64-byte aligned"):
        Package.open(write(forged(raw, h, built)))


@pytest.mark.parametrize("part", ["codes", "scales"])
def test_wrong_span_length_for_shape(
    raw: bytes, header: Header, built: BuiltPackage, write: Writer, part: str
) -> None:
    t = next(t for t in header.tensors if t.encoding == Encoding.INT4_GROUP_SYM)
    span = getattr(t, part)
    h = with_tensor(header, t.name, **{part: Span(span.offset, span.length - 2)})
    want = f"{part} span is {span.length - 2} bytes, shape {t.shape} and encoding INT4_GROUP_SYM"
    with pytest.raises(CorruptPackageError, match=re.escape(f"{want} need {span.length}")):
        Package.open(write(forged(raw, h, built)))


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((1 << 40, 1), "absurd shape"),
        ((1 << 24, 1 << 24), "absurd shape"),
        ((1,) * 9, "9 dimensions"),
        ((2, 3), "codes span is"),
    ],
)
def test_absurd_shape(
    raw: bytes,
    header: Header,
    built: BuiltPackage,
    write: Writer,
    shape: tuple[int, ...],
    message: str,
) -> None:
    t = header.tensors[0]
    with pytest.raises(CorruptPackageError, match=message):
        Package.open(write(forged(raw, with_tensor(header, t.name, shape=shape), built)))


def test_unknown_encoding(raw: bytes, header: Header, built: BuiltPackage, write: Writer) -> None:
    t = header.tensors[0]
    h = with_tensor(header, t.name, encoding=99)
    with pytest.raises(
        UnsupportedFeatureError, match=re.escape(f"'{t.name}' uses encoding 99")
    ) as err:
        Package.open(write(forged(raw, h, built)))
    assert "update edgepack" in str(err.value) and exit_code_for(err.value) == EXIT_CORRUPT


@pytest.mark.parametrize("group", [0, 12, 4104])
def test_bad_group_size(
    raw: bytes, header: Header, built: BuiltPackage, write: Writer, group: int
) -> None:
    t = next(t for t in header.tensors if t.encoding.is_group)
    with pytest.raises(CorruptPackageError, match=f"group size {group}"):
        Package.open(write(forged(raw, with_tensor(header, t.name, group_size=group), built)))


def test_duplicate_tensor_names(
    raw: bytes, header: Header, built: BuiltPackage, write: Writer
) -> None:
    h = with_tensor(header, header.tensors[1].name, name=header.tensors[0].name)
    with pytest.raises(CorruptPackageError, match="two tensors are named"):
        Package.open(write(forged(raw, h, built)))


@pytest.mark.parametrize(
    ("factors", "rank", "message"),
    [
        (("missing", "x"), 8, "missing"),
        (("self",), 8, "needs 2 factors"),
        (None, 7, "do not make"),
        (None, 0, "needs 2 factors"),
    ],
)
def test_bad_low_rank(
    raw: bytes,
    header: Header,
    built: BuiltPackage,
    write: Writer,
    factors: tuple[str, ...] | None,
    rank: int,
    message: str,
) -> None:
    t = next(t for t in header.tensors if t.encoding == Encoding.LOW_RANK)
    factors = t.factors if factors is None else (t.name,) if factors == ("self",) else factors
    h = with_tensor(header, t.name, factors=factors, rank=rank)
    with pytest.raises(CorruptPackageError, match=message) as err:
        Package.open(write(forged(raw, h, built)))
    assert t.name in str(err.value)


def test_unknown_required_feature(
    raw: bytes, header: Header, built: BuiltPackage, write: Writer
) -> None:
    h = replace(header, required_features=("sparse-blocks", "tensor-parallel"))
    with pytest.raises(UnsupportedFeatureError, match="sparse-blocks, tensor-parallel"):
        Package.open(write(forged(raw, h, built)))


def test_unknown_required_section_kind_refused(
    raw: bytes, header: Header, built: BuiltPackage, write: Writer
) -> None:
    h = with_section(header, "default", kind=200, required=True)
    with pytest.raises(UnsupportedFeatureError, match="required section of unknown kind 200"):
        Package.open(write(forged(raw, h, built)))


def test_unknown_optional_section_kind_ignored(tmp_path: Path) -> None:
    extra = [(200, "future", b"from a newer writer", False)]
    pkg_built = build_package(tmp_path / "p.epk", extra_sections=extra)
    with Package.open(pkg_built.path) as pkg:
        report = pkg.verify(trusted_keys=[pkg_built.public_key])
        assert report.sections_checked == len(pkg_built.sections)
        (unknown,) = pkg.sections(200)
        assert unknown.kind_name == "unknown(200)"
        assert pkg.section(200, "future") == b"from a newer writer"  # readable, just not used
        assert pkg.section(SectionKind.CHAT_TEMPLATE) is not None


def test_required_known_section_kind_is_fine(
    raw: bytes, header: Header, built: BuiltPackage, write: Writer
) -> None:
    h = with_section(header, "default", required=True)
    open_and_verify(write(forged(raw, h, built)), built)


def test_duplicate_section(raw: bytes, header: Header, built: BuiltPackage, write: Writer) -> None:
    h = replace(header, sections=(*header.sections, header.sections[1]))
    with pytest.raises(CorruptPackageError, match="chat_template/'default' appears twice"):
        Package.open(write(forged(raw, h, built)))


def test_bad_json_in_identity(
    raw: bytes, header: Header, built: BuiltPackage, write: Writer
) -> None:
    # encode_header always writes valid JSON, so patch the bytes and fix the digest
    h = replace(header, identity=replace(header.identity, config={"k": "[]"}))
    data = bytearray(forged(raw, h, built))
    pos = data.index(b'{"k": "[]"}')
    data[pos : pos + 11] = b'["k", "[]"]'  # same length, a JSON array
    header_len = struct.unpack_from("<Q", data, 24)[0]
    data[64:96] = hashlib.sha256(bytes(data[128 : 128 + header_len])).digest()
    with pytest.raises(CorruptPackageError, match="config_json must be a JSON object"):
        Package.open(write(bytes(data)))


# --------------------------------------------------------------- integrity


def test_flipped_tensor_byte(
    built: BuiltPackage, raw: bytes, header: Header, write: Writer
) -> None:
    target = next(t for t in header.tensors if t.encoding == Encoding.INT8_CHANNEL)
    data = bytearray(raw)
    data[target.scales.offset + 1] ^= 0x01  # one bit of one scale
    path = write(bytes(data))
    with Package.open(path) as pkg:  # opening does not read data: still opens
        with pytest.raises(
            CorruptPackageError, match=re.escape(f"tensor '{target.name}' hash mismatch")
        ):
            pkg.verify(trusted_keys=[built.public_key])
        with pytest.raises(CorruptPackageError, match=re.escape(target.name)):
            pkg.verify_tensor(target.name)
        for name in pkg.tensor_names:
            if name != target.name:
                pkg.verify_tensor(name)
        others = [n for n in pkg.tensor_names if n != target.name]
        report = pkg.verify(trusted_keys=[built.public_key], tensors=others)
        assert report.tensors_checked == len(others)


def test_flipped_factor_byte_fails_the_low_rank_tensor(
    built: BuiltPackage, raw: bytes, header: Header, write: Writer
) -> None:
    low = next(t for t in header.tensors if t.encoding == Encoding.LOW_RANK)
    u = header.tensor_index[low.factors[0]]
    data = bytearray(raw)
    data[u.codes.offset] ^= 0x80
    with Package.open(write(bytes(data))) as pkg:
        with pytest.raises(CorruptPackageError, match=re.escape(u.name)):
            pkg.verify_tensor(low.name)


def test_flipped_section_byte(
    built: BuiltPackage, raw: bytes, header: Header, write: Writer
) -> None:
    sec = next(s for s in header.sections if s.name == "default")
    data = bytearray(raw)
    data[sec.data.offset] ^= 0x01
    with Package.open(write(bytes(data))) as pkg:
        with pytest.raises(CorruptPackageError, match="chat_template/'default' hash mismatch"):
            pkg.section(SectionKind.CHAT_TEMPLATE)
        with pytest.raises(CorruptPackageError, match="hash mismatch"):
            pkg.verify(trusted_keys=[built.public_key])


def _restored_section(
    raw: bytes, header: Header, name: str, stored: bytes, **changes: object
) -> tuple[bytes, Header]:
    """Data and header where section ``name`` holds ``stored`` at its old offset, with a
    correct hash: what a buggy but trusted writer could produce."""
    sec = next(s for s in header.sections if s.name == name)
    assert len(stored) <= sec.data.length
    data = bytearray(raw)
    data[sec.data.offset : sec.data.end] = stored.ljust(sec.data.length, b"\0")
    h = with_section(
        header,
        name,
        data=Span(sec.data.offset, len(stored)),
        hash=hashlib.sha256(stored).digest(),
        **changes,
    )
    return bytes(data), h


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        ("garbage", "does not decompress"),
        ("cut", "does not decompress|wrong size"),
        ("content_size", "compressed size header mismatch"),
    ],
)
def test_bad_zstd_section(
    built: BuiltPackage, raw: bytes, header: Header, write: Writer, mangle: str, message: str
) -> None:
    sec = next(s for s in header.sections if s.name == "tokenizer.json")
    frame = bytearray(raw[sec.data.offset : sec.data.end])
    length = sec.uncompressed_length
    if mangle == "garbage":
        frame = bytearray(b"definitely not zstd".ljust(len(frame), b"!"))
    elif mangle == "cut":
        del frame[-8:]  # (a flipped literal byte would decompress: frames carry no checksum)
    else:
        length += 1
    data, h = _restored_section(raw, header, sec.name, bytes(frame), uncompressed_length=length)
    with Package.open(write(forged(data, h, built))) as pkg:
        with pytest.raises(CorruptPackageError, match=message) as err:
            pkg.section(SectionKind.TOKENIZER)
        assert "tokenizer.json" in str(err.value)


@pytest.mark.parametrize("lie", ["unknown_size", "small_size"])
def test_zstd_frame_inflating_beyond_declared_size(
    built: BuiltPackage, raw: bytes, header: Header, write: Writer, lie: str
) -> None:
    sec = next(s for s in header.sections if s.name == "tokenizer.json")
    if lie == "unknown_size":  # frame header without a content size
        frame = zstandard.ZstdCompressor(level=19, write_content_size=False).compress(bytes(50_000))
    else:  # frame header claims the declared length, the blocks inflate to 10,000 bytes
        frame = bytearray(zstandard.ZstdCompressor(level=19).compress(bytes(10_000)))
        assert frame[4] == 0x60  # single segment, 2-byte content size (value - 256)
        frame[5:7] = struct.pack("<H", sec.uncompressed_length - 256)
        frame = bytes(frame)
    data, h = _restored_section(raw, header, sec.name, frame)
    with Package.open(write(forged(data, h, built))) as pkg:
        with pytest.raises(CorruptPackageError, match=re.escape("tokenizer.json")) as err:
            pkg.section(SectionKind.TOKENIZER)
    assert "size header mismatch" in str(err.value) or "does not decompress" in str(err.value)


def test_uncompressed_section_length_mismatch_refused_at_open(
    built: BuiltPackage, raw: bytes, header: Header, write: Writer
) -> None:
    h = with_section(header, "default", uncompressed_length=10_000)
    with pytest.raises(CorruptPackageError, match="default"):
        open_and_verify(write(forged(raw, h, built)), built)


# --------------------------------------------------------------- signatures


def test_signed_by_another_key(tmp_path: Path) -> None:
    other = build_package(tmp_path / "other.epk", key=make_key(1))
    with Package.open(other.path) as pkg:
        with pytest.raises(SignatureError, match="not by a trusted key") as err:
            pkg.verify(trusted_keys=[make_key(0).public_key()])
        assert exit_code_for(err.value) == EXIT_SIGNATURE
        assert pkg.verify(trusted_keys=[make_key(0).public_key(), other.public_key]).signed


def test_unsigned_with_trusted_keys(tmp_path: Path) -> None:
    unsigned = build_package(tmp_path / "unsigned.epk", key=None)
    with Package.open(unsigned.path) as pkg:
        with pytest.raises(SignatureError, match="not signed"):
            pkg.verify(trusted_keys=[make_key(0).public_key()])
        assert not pkg.verify().signed  # hashes only, no trust asked for


def test_tampered_signature_bytes(built: BuiltPackage, raw: bytes, write: Writer) -> None:
    signature = built.key.sign(SIGNED_CONTEXT + raw[64:96])  # Ed25519 is deterministic
    pos = raw.rindex(signature)
    data = bytearray(raw)
    data[pos + 10] ^= 0x01
    with Package.open(write(bytes(data))) as pkg:
        with pytest.raises(SignatureError, match="does not verify"):
            pkg.verify(trusted_keys=[built.public_key])


def test_garbage_signature_block(built: BuiltPackage, raw: bytes, write: Writer) -> None:
    sig_len = struct.unpack_from("<Q", raw, 56)[0]
    data = raw[:-sig_len] + b"\xff" * sig_len
    with Package.open(write(data)) as pkg:
        with pytest.raises(SignatureError, match="malformed"):
            pkg.verify(trusted_keys=[built.public_key])
        with pytest.raises(SignatureError, match="malformed"):
            pkg.verify()  # a malformed block is an error even when trust is not asked


def test_stale_signature_after_header_change(
    raw: bytes, header: Header, built: BuiltPackage, write: Writer
) -> None:
    h = replace(header, min_runtime_version="0.0.1")
    with Package.open(write(replace_header(raw, h, sign_with=KEEP_SIGNATURE))) as pkg:
        with pytest.raises(SignatureError, match="does not verify"):
            pkg.verify(trusted_keys=[built.public_key])


# --------------------------------------------------------------- compatibility


def caps(version: str = "1.0.0", **kw: object) -> RuntimeCapabilities:
    return RuntimeCapabilities(version, operators=kw.pop("operators", ALL_OPERATORS), **kw)


def test_runtime_too_old(tmp_path: Path) -> None:
    pkg_built = build_package(tmp_path / "new.epk", min_runtime_version="2.1.0")
    with Package.open(pkg_built.path) as pkg:
        verdict = pkg.check_compatibility(caps("2.0.9"))
    assert not verdict
    (problem,) = verdict.problems
    assert problem.code == "runtime_too_old"
    assert "2.1.0" in problem.message and "2.0.9" in problem.message
    assert "update the app" in problem.remedy
    with pytest.raises(IncompatiblePackageError, match=re.escape("runtime >= 2.1.0")) as err:
        Package.open(pkg_built.path, capabilities=caps("2.0.9"))
    assert err.value.verdict == verdict and exit_code_for(err.value) == EXIT_INCOMPATIBLE
    Package.open(pkg_built.path, capabilities=caps("2.1.0")).close()
    assert not check_compatibility(pkg.header, caps("2.1.0-rc.1"))  # pre-release is older


def test_missing_and_old_operators(built: BuiltPackage) -> None:
    operators = dict(ALL_OPERATORS)
    del operators["matmul.int4_group_asym"]
    operators["llama.decoder"] = 0
    with Package.open(built.path) as pkg:
        verdict = pkg.check_compatibility(caps(operators=operators))
    codes = {p.code: p for p in verdict.problems}
    assert set(codes) == {"missing_operator", "operator_too_old"}
    assert "matmul.int4_group_asym@1" in codes["missing_operator"].message
    assert "llama.decoder@0" in codes["operator_too_old"].message
    with pytest.raises(IncompatiblePackageError, match=re.escape("matmul.int4_group_asym@1")):
        Package.open(built.path, capabilities=caps(operators=operators))


def test_verdict_lists_every_problem(
    raw: bytes, header: Header, built: BuiltPackage, write: Writer
) -> None:
    h = replace(header, quantization_schema_version=2, operator_set_version=3)
    verdict = check_compatibility(h, caps(encodings=frozenset({0, 1})))
    assert {p.code for p in verdict.problems} == {"quantization_schema", "operator_set", "encoding"}


def test_newer_quantization_schema_refused_by_reader(
    raw: bytes, header: Header, built: BuiltPackage, write: Writer
) -> None:
    h = replace(header, quantization_schema_version=2)
    with pytest.raises(IncompatiblePackageError, match="quantization schema 2"):
        Package.open(write(forged(raw, h, built)))


# --------------------------------------------------------------- golden bytes, determinism


def _tiny(path: Path, config: dict | None = None, sign: bool = False) -> bytes:
    identity = ModelIdentity("tiny", "1.0.0", "llama", config or {})
    with PackageWriter(path, identity) as w:
        w.add_tensor("w", Encoding.F32, np.array([[1, 2], [3, 4]], np.float32))
        w.finish(signing_keys=[make_key(0)] if sign else ())
    return path.read_bytes()


# A change to any of these is a change of the file format: make it deliberately.
GOLDEN_PREAMBLE_FIELDS = bytes.fromhex(
    "8945504b0d0a1a0a"  # magic
    "0100"
    "0000"
    "80000000"  # format 1.0, preamble_size 128
    "8000000000000000"  # header_offset 128
    "9001000000000000"  # header_length 400
    "0010000000000000"  # data_offset 4096
    "4000000000000000"  # data_length 64
    "0000000000000000"
    "0000000000000000"  # unsigned
)
GOLDEN_SHA256 = "899c3dbdb4dc19cbfba6cc08d69c9b40c088c88abb0b1249510710967b09a318"


def test_golden_preamble_of_tiny_package(tmp_path: Path) -> None:
    data = _tiny(tmp_path / "tiny.epk")
    assert data[:64] == GOLDEN_PREAMBLE_FIELDS
    fields = struct.unpack_from("<8sHHIQQQQQQ32s", data)
    _, major, minor, psize, h_off, h_len, d_off, d_len, s_off, s_len, digest = fields
    assert (major, minor, psize, h_off) == (1, 0, 128, 128)
    assert digest == hashlib.sha256(data[h_off : h_off + h_len]).digest()
    assert data[h_off + 4 : h_off + 8] == b"EPK1"  # flatbuffer file identifier
    assert data[96:128] == bytes(32)  # reserved
    assert data[h_off + h_len : d_off] == bytes(d_off - h_off - h_len)  # zero padding
    assert d_off % 4096 == 0 and len(data) == d_off + d_len + s_len and s_off == 0
    assert data[d_off : d_off + 16] == np.array([1, 2, 3, 4], "<f4").tobytes()
    assert data[d_off + 16 : d_off + d_len] == bytes(d_len - 16)
    assert hashlib.sha256(data).hexdigest() == GOLDEN_SHA256


def test_golden_signed_layout(tmp_path: Path) -> None:
    data = _tiny(tmp_path / "signed.epk", sign=True)
    unsigned = _tiny(tmp_path / "unsigned.epk")
    _, _, _, _, _, _, d_off, d_len, s_off, s_len, digest = struct.unpack_from(
        "<8sHHIQQQQQQ32s", data
    )
    assert s_off == d_off + d_len and len(data) == s_off + s_len
    assert data[64:s_off] == unsigned[64:s_off]  # signing only adds the block
    block = data[s_off:]
    assert block[4:8] == b"EPKS" and len(block) == s_len <= 64 * 1024
    public = make_key(0).public_key()
    assert hashlib.sha256(public.public_bytes_raw()).digest() in block  # key_id
    signature = make_key(0).sign(SIGNED_CONTEXT + digest)
    assert signature in block
    public.verify(signature, SIGNED_CONTEXT + digest)  # the documented 54-byte message


def test_writer_is_deterministic(tmp_path: Path) -> None:
    a = build_package(tmp_path / "a.epk").read_bytes()
    b = build_package(tmp_path / "b.epk").read_bytes()
    assert a == b
    c1 = _tiny(tmp_path / "c1.epk", {"a": 1, "b": [1, 2]})
    c2 = _tiny(tmp_path / "c2.epk", {"b": [1, 2], "a": 1})  # key order does not matter
    assert c1 == c2


def test_signature_is_over_the_documented_message(built: BuiltPackage, raw: bytes) -> None:
    digest = raw[64:96]
    expected = built.key.sign(SIGNED_CONTEXT + digest)  # Ed25519: deterministic
    assert expected in raw[-struct.unpack_from("<Q", raw, 56)[0] :]


# --------------------------------------------------------------- round trip of the header


def test_every_header_field_round_trips(tmp_path: Path) -> None:
    config = {"hidden_size": 64, "rope": {"theta": 10000.0, "scaling": None}, "tied": True}
    recipe = {"plan": {"attn": "int4_group_sym"}, "calibration": ["wiki", 128]}
    identity = ModelIdentity("rt-model", "3.2.1-beta.2+build.7", "llama", config)
    provenance = Provenance(
        "edgepack", "0.9.0", "hf:some/model", "ab" * 32, recipe, "2024-05-01T12:00:00Z"
    )
    operators = (("llama.decoder", 3), ("matmul.int8_channel", 1))
    w = np.arange(64, dtype=np.float32).reshape(4, 16) / 64
    with PackageWriter(
        tmp_path / "rt.epk",
        identity,
        min_runtime_version="1.4.0-rc.1",
        required_operators=operators,
        provenance=provenance,
    ) as pw:
        pw.add_tensor("f32", Encoding.F32, w)
        pw.add_tensor("bf16", Encoding.BF16, (w.view(np.uint32) >> 16).astype(np.uint16))
        pw.add_tensor("i8", Encoding.INT8_CHANNEL, w.astype(np.int8), np.ones(4, np.float32))
        pw.add_tensor(
            "i4",
            Encoding.INT4_GROUP_ASYM,
            np.zeros((4, 8), np.uint8),
            np.ones((4, 2), np.float16),
            np.zeros((4, 2), np.float16),
            shape=(4, 16),
            group_size=8,
        )
        pw.add_tensor("u", Encoding.F16, np.ones((4, 2), np.float16))
        pw.add_tensor("v", Encoding.F32, np.ones((2, 16), np.float32))
        pw.add_low_rank("lr", (4, 4, 4), ("u", "v"), 2)
        tokenizer = b'{"t": "' + b"t" * 5000 + b'"}'  # JSON, as a tokenizer must be
        pw.add_section(SectionKind.TOKENIZER, tokenizer, name="tok", media_type="a/b")
        pw.add_section(
            SectionKind.METADATA_JSON, b"{}", media_type="application/json", required=True
        )
        pw.add_section(SectionKind.PREFIX_KV_CACHE, b"", name="empty")
    with Package.open(tmp_path / "rt.epk") as pkg:
        h = pkg.header
        assert h.identity == identity and h.identity.config == config
        assert h.provenance == provenance and h.provenance.recipe == recipe
        assert h.min_runtime_version == "1.4.0-rc.1"
        assert h.required_operators == operators and h.required_features == ()
        assert (h.format_version, h.quantization_schema_version, h.operator_set_version) == (
            1,
            1,
            1,
        )
        assert (h.hash_algorithm, h.data_alignment) == (0, 64)
        got = {t.name: (t.shape, t.encoding, t.group_size, t.factors, t.rank) for t in h.tensors}
        assert got == {
            "f32": ((4, 16), Encoding.F32, 0, (), 0),
            "bf16": ((4, 16), Encoding.BF16, 0, (), 0),
            "i8": ((4, 16), Encoding.INT8_CHANNEL, 0, (), 0),
            "i4": ((4, 16), Encoding.INT4_GROUP_ASYM, 8, (), 0),
            "u": ((4, 2), Encoding.F16, 0, (), 0),
            "v": ((2, 16), Encoding.F32, 0, (), 0),
            "lr": ((4, 4, 4), Encoding.LOW_RANK, 0, ("u", "v"), 2),
        }
        assert [t.name for t in h.tensors] == ["f32", "bf16", "i8", "i4", "u", "v", "lr"]
        secs = [
            (
                s.kind,
                s.name,
                s.media_type,
                int(s.compression),
                s.uncompressed_length,
                s.required,
                s.data.length > 0,
            )
            for s in h.sections
        ]
        assert secs == [
            (SectionKind.TOKENIZER, "tok", "a/b", 1, 5009, False, True),
            (SectionKind.METADATA_JSON, "", "application/json", 0, 2, True, True),
            (SectionKind.PREFIX_KV_CACHE, "empty", "application/octet-stream", 0, 0, False, False),
        ]
        assert pkg.section(SectionKind.TOKENIZER) == b'{"t": "' + b"t" * 5000 + b'"}'
        assert pkg.section(SectionKind.PREFIX_KV_CACHE, "empty") == b""
        np.testing.assert_array_equal(pkg.dequantize("lr"), np.full((4, 4, 4), 2, np.float32))
        pkg.verify()


def test_forged_identical_header_is_byte_identical(
    raw: bytes, header: Header, built: BuiltPackage
) -> None:
    """The forging helper every case above relies on must itself be exact."""
    assert replace_header(raw, header, sign_with=built.key) == raw


def test_every_error_is_an_edgepack_error() -> None:
    for cls in (
        CorruptPackageError,
        TruncatedPackageError,
        UnsupportedFeatureError,
        SignatureError,
        IncompatiblePackageError,
    ):
        assert issubclass(cls, EdgepackError)

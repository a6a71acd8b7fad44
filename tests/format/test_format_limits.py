"""Bombs a small file could be: the reader refuses them at open, before allocating, and
the writer refuses to make them (issue 11 items 5 and 6; spec/FORMAT.md sections 3-6).

Each bomb is forged from a real package: its bytes are stored as an uncompressed
section the writer accepts, then the header is rewritten to call them what they are.
"""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import zstandard
from pkgfactory import replace_header

from edgepack.cli.exit_codes import EXIT_CORRUPT, exit_code_for
from edgepack.format import (
    CorruptPackageError,
    Encoding,
    ModelIdentity,
    Package,
    PackageWriter,
    SectionKind,
    TensorEntry,
)
from edgepack.format.constants import MAX_LOW_RANK_RATIO, PREAMBLE_SIZE, SECTION_LIMITS
from edgepack.format.delta import CorruptDeltaError
from edgepack.format.delta.container import DeltaHeader
from edgepack.format.delta.container import decode_header as decode_delta_header
from edgepack.format.delta.container import encode_header as encode_delta_header
from edgepack.format.preamble import Preamble

GiB = 1 << 30


def forge_section(
    tmp_path: Path, kind: SectionKind, content: bytes, *, compressed: bool, declared: int
) -> Path:
    """A package holding ``content`` (a zstd frame when ``compressed``) as a section of
    ``kind`` that declares ``declared`` bytes."""
    path = tmp_path / "carrier.epk"
    with PackageWriter(path, ModelIdentity("m", "1.0.0", "llama")) as w:
        w.add_tensor("w", Encoding.F32, np.ones(4, np.float32))
        w.add_section(SectionKind.PREFIX_KV_CACHE, content, name="bomb", compress=False)
    with Package.open(path) as pkg:
        header = pkg.header
    sec = replace(
        header.sections[0],
        kind=int(kind),
        compression=int(compressed),
        uncompressed_length=declared,
    )
    out = tmp_path / "bomb.epk"
    out.write_bytes(replace_header(path.read_bytes(), replace(header, sections=(sec,))))
    return out


def zeros_frame(n: int) -> bytes:
    return zstandard.ZstdCompressor(level=1, write_content_size=True).compress(bytes(n))


# ------------------------------------------------------------------ item 5: low rank
def test_low_rank_expansion_refused_at_open(tmp_path: Path) -> None:
    """Two 32 KiB factors claiming a 16384 x 16384 product: 1 GiB to dequantize."""
    side = 1 << 14
    path = tmp_path / "factors.epk"
    with PackageWriter(path, ModelIdentity("m", "1.0.0", "llama")) as w:
        w.add_tensor("u", Encoding.F16, np.ones((side, 1), np.float16))
        w.add_tensor("v", Encoding.F16, np.ones((1, side), np.float16))
    with Package.open(path) as pkg:
        header = pkg.header
    bomb = TensorEntry("bomb.weight", (side, side), Encoding.LOW_RANK, factors=("u", "v"), rank=1)
    forged = tmp_path / "lr.epk"
    forged.write_bytes(
        replace_header(path.read_bytes(), replace(header, tensors=(*header.tensors, bomb)))
    )
    assert forged.stat().st_size < 128 * 1024
    with pytest.raises(CorruptPackageError, match=r"'bomb\.weight'.*4096x"):
        Package.open(forged)


def test_low_rank_ratio_is_the_specs(tmp_path: Path) -> None:
    """The bound lets through exactly R*C <= 4096 * r * (R + C), checked at open."""
    rank, rows = 1, 8192
    limit_cols = next(c for c in range(8192, 1 << 16) if rows * c > MAX_LOW_RANK_RATIO * (rows + c))
    path = tmp_path / "ok.epk"
    with PackageWriter(path, ModelIdentity("m", "1.0.0", "llama")) as w:
        w.add_tensor("u", Encoding.F16, np.ones((rows, rank), np.float16))
        w.add_tensor("v", Encoding.F16, np.ones((rank, limit_cols - 1), np.float16))
        w.add_low_rank("lr", (rows, limit_cols - 1), ("u", "v"), rank)
    Package.open(path).close()


def test_writer_refuses_low_rank_bomb(tmp_path: Path) -> None:
    path = tmp_path / "never.epk"
    with pytest.raises(ValueError, match=r"'lr'.*4096x"):
        with PackageWriter(path, ModelIdentity("m", "1.0.0", "llama")) as w:
            w.add_tensor("u", Encoding.F16, np.ones((1 << 16, 1), np.float16))
            w.add_tensor("v", Encoding.F16, np.ones((1, 1 << 16), np.float16))
            w.add_low_rank("lr", (1 << 16, 1 << 16), ("u", "v"), 1)
    assert not path.exists()


# ------------------------------------------------------------------ item 6: section bombs
@pytest.mark.parametrize(
    "kind", [SectionKind.TOKENIZER, SectionKind.MODEL_CONFIG, SectionKind.CHAT_TEMPLATE]
)
def test_small_kinds_refuse_a_gigabyte_at_open(tmp_path: Path, kind: SectionKind) -> None:
    declared = SECTION_LIMITS[kind] + 1
    assert declared <= GiB  # within the old all-kinds limit: accepted before
    path = forge_section(tmp_path, kind, zeros_frame(declared), compressed=True, declared=declared)
    with pytest.raises(CorruptPackageError, match=f"{kind.name.lower()}.*{declared}"):
        Package.open(path)


def test_writer_refuses_oversized_section(tmp_path: Path) -> None:
    with PackageWriter(tmp_path / "never.epk", ModelIdentity("m", "1.0.0", "llama")) as w:
        limit = SECTION_LIMITS[SectionKind.CHAT_TEMPLATE]
        with pytest.raises(ValueError, match="chat_template"):
            w.add_section(SectionKind.CHAT_TEMPLATE, b" " * (limit + 1))
        w.add_section(SectionKind.CHAT_TEMPLATE, b" " * limit)


def test_verify_streams_a_large_kv_cache(tmp_path: Path) -> None:
    """A 1 GiB section (the limit of kinds large by nature) verifies in bounded memory."""
    path = forge_section(
        tmp_path, SectionKind.PREFIX_KV_CACHE, zeros_frame(GiB), compressed=True, declared=GiB
    )
    script = textwrap.dedent(
        f"""
        import re
        from edgepack.format import Package
        with Package.open({str(path)!r}) as pkg:
            pkg.verify()
        # VmHWM: this process's peak (ru_maxrss would carry over the parent's)
        print(int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read())[1]) // 1024)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) < 256, f"verify peaked at {out.stdout.strip()} MiB"


def test_frame_longer_than_declared_refused(tmp_path: Path) -> None:
    """A frame without a content size cannot talk the reader into more than declared."""
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(1 << 20))
    path = forge_section(tmp_path, SectionKind.PREFIX_KV_CACHE, frame, compressed=True, declared=10)
    with Package.open(path) as pkg, pytest.raises(CorruptPackageError, match="size"):
        pkg.verify()


@pytest.mark.parametrize(
    "content",
    [bytes(4096), b"\xff\xfe{}", b"[1, 2]", b'{"a": ', b"", b"   \n"],
    ids=["zeros", "not-utf8", "array", "truncated", "empty", "blank"],
)
@pytest.mark.parametrize(
    "kind", [SectionKind.TOKENIZER, SectionKind.MODEL_CONFIG, SectionKind.METADATA_JSON]
)
def test_json_kinds_must_hold_a_json_object(
    tmp_path: Path, kind: SectionKind, content: bytes
) -> None:
    path = forge_section(tmp_path, kind, content, compressed=False, declared=len(content))
    with Package.open(path) as pkg:
        with pytest.raises(CorruptPackageError, match="JSON") as err:
            pkg.section(kind)
        assert exit_code_for(err.value) == EXIT_CORRUPT


def test_json_section_round_trips(tmp_path: Path) -> None:
    doc = json.dumps({"model": {"vocab": {"a": 0}}}).encode()
    path = forge_section(tmp_path, SectionKind.TOKENIZER, doc, compressed=False, declared=len(doc))
    with Package.open(path) as pkg:
        assert pkg.section(SectionKind.TOKENIZER) == doc


# ------------------------------------------------------------------ item 7: header and op counts
SIXTEEN_MIB = 16 << 20  # what real packages need with a large margin (spec section 3)


def test_header_over_16_mib_refused_before_reading(tmp_path: Path) -> None:
    """A header a little over the limit is refused from the preamble alone."""
    kind = SectionKind.PREFIX_KV_CACHE
    raw = forge_section(tmp_path, kind, b"x", compressed=False, declared=1).read_bytes()
    pre = Preamble.unpack(raw[:PREAMBLE_SIZE], len(raw))
    length = SIXTEEN_MIB + 4096
    data_offset = PREAMBLE_SIZE + length + (-(PREAMBLE_SIZE + length) % 4096)
    big = replace(pre, header_length=length, data_offset=data_offset)
    path = tmp_path / "big-header.epk"
    with open(path, "wb") as f:
        f.write(big.pack())
        f.truncate(data_offset + pre.data_length)
    with pytest.raises(CorruptPackageError, match=f"header length {length} is outside"):
        Package.open(path)


def test_delta_op_count_over_the_limit_refused_before_decoding() -> None:
    h = DeltaHeader(1, bytes(32), bytes(32), 1, bytes(32), bytes(32), bytes(32))
    fixed = bytearray(encode_delta_header(h))
    n_ops = (1 << 19) + 1  # 4 ops per tensor of the largest package, plus one
    struct.pack_into("<I", fixed, len(fixed) - 8, n_ops)  # fixed part: ..., streams, ops, features
    with pytest.raises(CorruptDeltaError, match=f"claims 0 streams and {n_ops} ops"):
        decode_delta_header(bytes(fixed) + bytes(2 * n_ops))


def test_chat_template_must_be_utf8(tmp_path: Path) -> None:
    content = b"{{ messages }}\xff"
    kind = SectionKind.CHAT_TEMPLATE
    path = forge_section(tmp_path, kind, content, compressed=False, declared=len(content))
    with Package.open(path) as pkg, pytest.raises(CorruptPackageError, match="UTF-8"):
        pkg.section(kind)


@pytest.fixture(scope="module")
def runnable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from runtime_fixtures import tiny_package

    return tiny_package(tmp_path_factory, "int8")


@pytest.mark.parametrize("content", [b"\x00", b"[]", b"\xff"], ids=["zeros", "array", "binary"])
def test_run_with_a_tokenizer_that_is_not_json_exits_corrupt(
    runnable: Path, tmp_path: Path, content: bytes
) -> None:
    """`edgepack run` on a package whose tokenizer section is not JSON: exit 3, not an
    internal error (issue 11 items 6 and 8)."""
    raw = bytearray(runnable.read_bytes())
    with Package.open(runnable) as pkg:
        header = pkg.header
    assert not any(s.kind == SectionKind.TOKENIZER for s in header.sections)
    sec = next(s for s in header.sections if s.kind == SectionKind.PRECISION_PLAN)  # a carrier
    fill = (content * sec.data.length)[: sec.data.length]
    raw[sec.data.offset : sec.data.end] = fill
    forged_sec = replace(
        sec,
        kind=SectionKind.TOKENIZER,
        compression=0,
        uncompressed_length=len(fill),
        hash=hashlib.sha256(fill).digest(),
    )
    sections = tuple(forged_sec if s is sec else s for s in header.sections)
    path = tmp_path / "bad-tokenizer.epk"
    path.write_bytes(replace_header(bytes(raw), replace(header, sections=sections)))
    argv = [sys.executable, "-m", "edgepack.cli", "run", str(path), "-p", "hi", "--max-tokens", "1"]
    result = subprocess.run(argv, capture_output=True, text=True)
    assert result.returncode == EXIT_CORRUPT, result.stderr
    assert "tokenizer" in result.stderr and "internal error" not in result.stderr

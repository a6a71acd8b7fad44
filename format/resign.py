"""Re-version, rename and re-sign a finished package without re-encoding a byte of data.

The signature covers the header digest and the header binds every span by its hash, so
a new identity (name, version) is a new header and a new signature block; the data
region is copied verbatim. It starts on a page boundary after the header: when the new
header still fits before it (the usual case, a version grows by a few bytes) the data
keeps its offset and the output is a copy of the input with a new front and tail;
otherwise every span moves by whole pages and the data is streamed to its new offset.
The output goes through a temporary file renamed into place; the input is only read.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from .compat import parse_semver
from .constants import DATA_REGION_ALIGNMENT, PREAMBLE_SIZE
from .digests import sha256
from .errors import TruncatedPackageError
from .file_layout import align, shift_spans
from .file_mode import seal_output
from .header import Header, ModelIdentity, encode_header
from .header_decode import decode_header
from .names import check_name
from .output_file import check_output_path, create_partial, remove_stale_partials
from .preamble import Preamble
from .reader import Package
from .signing import build_signature_block
from .validate import validate_header

__all__ = ["ResignResult", "resign"]

_COPY_CHUNK = 16 * 1024 * 1024


@dataclass(frozen=True)
class ResignResult:
    path: Path
    identity: ModelIdentity
    data_moved: bool  # the header outgrew its pages: the data region starts later
    signatures: int


def resign(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    signing_keys: Sequence[object],
    name: str | None = None,
    version: str | None = None,
) -> ResignResult:
    """Write ``out``: ``src`` with a new name and/or version, signed by ``signing_keys``
    (the old signatures are dropped: they sign the old header). Every hash of ``src`` is
    checked first, so a corrupt package is never signed. ValueError for a bad name or
    version; OutputPathError when ``out`` is ``src`` (under any spelling)."""
    src, out = Path(src), Path(out)
    if name is not None:
        check_name("model", name)
    if version is not None:
        parse_semver(version)
    out = check_output_path(out, (src,), overwrite=True)
    with Package.open(src) as pkg:
        pkg.verify()
        old_pre, old = pkg.preamble, pkg.header
    identity = replace(
        old.identity,
        name=old.identity.name if name is None else name,
        version=old.identity.version if version is None else version,
    )
    header_bytes, data_offset = _encode_before_data(replace(old, identity=identity), old_pre)
    digest = sha256(header_bytes).digest()
    signature = build_signature_block(digest, signing_keys) if signing_keys else b""
    pre = Preamble(
        header_offset=PREAMBLE_SIZE,
        header_length=len(header_bytes),
        data_offset=data_offset,
        data_length=old_pre.data_length,
        header_digest=digest,
        signature_offset=data_offset + old_pre.data_length if signature else 0,
        signature_length=len(signature),
    )
    validate_header(decode_header(header_bytes), pre)  # never write what we would refuse
    moved = data_offset != old_pre.data_offset
    _write(src, out, old_pre, pre, header_bytes, signature)
    return ResignResult(out, identity, moved, len(signing_keys))


def _encode_before_data(header: Header, old: Preamble) -> tuple[bytes, int]:
    """The header's bytes and the data offset: the old one while the header fits before
    it, else the first page after it (spans shifted by the difference)."""
    offset = old.data_offset
    for _ in range(4):
        shifted = shift_spans(header, offset - old.data_offset)
        encoded = encode_header(shifted)
        needed = align(PREAMBLE_SIZE + len(encoded), DATA_REGION_ALIGNMENT)
        if needed <= offset:
            return encoded, offset
        offset = needed
    raise RuntimeError("header size did not converge")  # pragma: no cover


def _write(
    src: Path, out: Path, old: Preamble, pre: Preamble, header_bytes: bytes, signature: bytes
) -> None:
    remove_stale_partials(out)  # what a killed resign of this path left
    fd, tmp = create_partial(out)
    os.close(fd)
    try:
        same_place = pre.data_offset == old.data_offset
        if same_place:  # the kernel copies the file (sendfile); front and tail rewritten
            shutil.copyfile(src, tmp)
        with open(tmp, "r+b") as f:
            if not same_place:
                f.seek(pre.data_offset)
                _copy_range(src, f, old.data_offset, old.data_length)
            f.truncate(pre.data_end)
            f.seek(0)
            f.write(pre.pack())
            f.write(header_bytes)
            f.write(bytes(pre.data_offset - PREAMBLE_SIZE - len(header_bytes)))
            f.seek(pre.data_end)
            f.write(signature)
            seal_output(f)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _copy_range(src: Path, dst, offset: int, length: int) -> None:
    """Stream ``length`` bytes of ``src`` from ``offset`` to ``dst``'s position."""
    with open(src, "rb") as s:
        s.seek(offset)
        left = length
        while left:
            chunk = s.read(min(_COPY_CHUNK, left))
            if not chunk:
                raise TruncatedPackageError(f"{src} ended {left} bytes before its data's end")
            dst.write(chunk)
            left -= len(chunk)

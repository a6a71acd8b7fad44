"""The fixed 128-byte preamble (spec/FORMAT.md section 2): pack, unpack, check layout."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .constants import (
    DATA_REGION_ALIGNMENT,
    DIGEST_SIZE,
    FORMAT_MAJOR,
    MAGIC,
    MAX_HEADER_LENGTH,
    MAX_SIGNATURE_BLOCK,
    PREAMBLE_SIZE,
)
from .errors import CorruptPackageError, IncompatiblePackageError, TruncatedPackageError

__all__ = ["Preamble"]

_FIELDS = struct.Struct("<8sHHIQQQQQQ32s")  # 96 bytes; the rest is reserved
assert _FIELDS.size == 96


@dataclass(frozen=True)
class Preamble:
    header_offset: int
    header_length: int
    data_offset: int
    data_length: int
    header_digest: bytes
    signature_offset: int = 0
    signature_length: int = 0
    format_major: int = FORMAT_MAJOR
    format_minor: int = 0
    preamble_size: int = PREAMBLE_SIZE

    @property
    def data_end(self) -> int:
        return self.data_offset + self.data_length

    @property
    def signed(self) -> bool:
        return self.signature_length > 0

    def pack(self) -> bytes:
        fields = _FIELDS.pack(
            MAGIC,
            self.format_major,
            self.format_minor,
            PREAMBLE_SIZE,
            self.header_offset,
            self.header_length,
            self.data_offset,
            self.data_length,
            self.signature_offset,
            self.signature_length,
            self.header_digest,
        )
        return fields + bytes(PREAMBLE_SIZE - len(fields))

    @classmethod
    def unpack(cls, raw: bytes, file_size: int) -> Preamble:
        """Parse and check the preamble against the real file size."""
        if len(raw) < PREAMBLE_SIZE:
            if raw[: len(MAGIC)] == MAGIC[: len(raw)] and raw:
                raise TruncatedPackageError(
                    f"file is {file_size} bytes, shorter than the {PREAMBLE_SIZE}-byte preamble"
                )
            raise CorruptPackageError("not an edgepack package (file too short)")
        (magic, major, minor, psize, h_off, h_len, d_off, d_len, s_off, s_len, digest) = (
            _FIELDS.unpack_from(raw)
        )
        if magic != MAGIC:
            raise CorruptPackageError("not an edgepack package (bad magic bytes)")
        if major != FORMAT_MAJOR:
            raise IncompatiblePackageError(
                f"package format version {major} is not readable by this edgepack (reads "
                f"version {FORMAT_MAJOR}); update the app, or fetch a package built for it"
            )
        p = cls(h_off, h_len, d_off, d_len, digest, s_off, s_len, major, minor, psize)
        p._check_layout(file_size)
        return p

    def _check_layout(self, file_size: int) -> None:
        if self.preamble_size < PREAMBLE_SIZE or self.preamble_size > DATA_REGION_ALIGNMENT:
            raise CorruptPackageError(f"preamble size {self.preamble_size} is invalid")
        if not 0 < self.header_length <= MAX_HEADER_LENGTH:
            raise CorruptPackageError(
                f"header length {self.header_length} is outside 1..{MAX_HEADER_LENGTH}"
            )
        if self.header_offset < self.preamble_size:
            raise CorruptPackageError("header overlaps the preamble")
        if self.data_offset % DATA_REGION_ALIGNMENT:
            raise CorruptPackageError(f"data offset {self.data_offset} is not page aligned")
        if self.header_offset + self.header_length > self.data_offset:
            raise CorruptPackageError("header overlaps the data region")
        if len(self.header_digest) != DIGEST_SIZE:
            raise CorruptPackageError("header digest has the wrong size")
        if self.signature_length:
            if self.signature_offset != self.data_end:
                raise CorruptPackageError("signature block is not right after the data region")
            if self.signature_length > MAX_SIGNATURE_BLOCK:
                raise CorruptPackageError(f"signature block of {self.signature_length} bytes")
        elif self.signature_offset:
            raise CorruptPackageError("signature offset set without a signature block")
        expected = self.data_end + self.signature_length
        if file_size < expected:
            raise TruncatedPackageError(
                f"file is truncated: {file_size} bytes, the header promises {expected}"
            )
        if file_size > expected:
            raise CorruptPackageError(
                f"file has {file_size - expected} unexpected trailing bytes after the package"
            )

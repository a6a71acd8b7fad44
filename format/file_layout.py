"""Where every byte of a package goes, known from its metadata alone.

A span's offset follows from the order and byte counts of the parts before it; the
header's length does not depend on the hashes (fixed-size digests) nor on the span
values (fixed-size structs); the signature block's length depends only on the keys. So
the exact file size, and where the data region starts, are known before any tensor byte
is written: :class:`~.writer.PackageWriter` puts every span in place at once, and a build
checks its size target without writing (:class:`~.writer.PackageSizer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from .constants import (
    DATA_REGION_ALIGNMENT,
    DIGEST_SIZE,
    PAGE_ALIGN_THRESHOLD,
    PAGE_SIZE,
    PREAMBLE_SIZE,
    SPAN_ALIGNMENT,
)
from .header import (
    Header,
    ModelIdentity,
    Provenance,
    SectionEntry,
    Span,
    TensorEntry,
    encode_header,
)
from .signing import build_signature_block

__all__ = ["DIGEST_PLACEHOLDER", "FileLayout", "align", "shift_spans", "signature_length"]

DIGEST_PLACEHOLDER = bytes(DIGEST_SIZE)  # same length as the real digest: same header size


def align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def signature_length(keys: Sequence[object]) -> int:
    """Bytes of the signature block for ``keys`` (Ed25519 signatures are fixed-size)."""
    return len(build_signature_block(DIGEST_PLACEHOLDER, keys)) if keys else 0


def shift_spans(header: Header, delta: int) -> Header:
    """``header`` with every non-empty span moved by ``delta`` bytes (the data region
    placed, or moved, that far)."""
    if not delta:
        return header

    def move(span: Span) -> Span:
        return Span(span.offset + delta, span.length) if span.length else span

    tensors = tuple(
        replace(t, codes=move(t.codes), scales=move(t.scales), zeros=move(t.zeros))
        for t in header.tensors
    )
    sections = tuple(replace(s, data=move(s.data)) for s in header.sections)
    return replace(header, tensors=tensors, sections=sections)


class FileLayout:
    """Tensor and section entries with spans relative to the data region, in file order."""

    def __init__(
        self,
        identity: ModelIdentity,
        min_runtime_version: str,
        required_operators: tuple[tuple[str, int], ...],
        provenance: Provenance,
    ) -> None:
        self.identity = identity
        self.min_runtime_version = min_runtime_version
        self.required_operators = required_operators
        self.provenance = provenance
        self.position = 0  # next free byte of the data region, relative to its start
        self.tensors: list[TensorEntry] = []
        self.sections: list[SectionEntry] = []

    def place(self, nbytes: int, *, page: bool = False) -> Span:
        """The span of the next ``nbytes`` part: page-aligned when large (or ``page``), so
        the runtime maps it without copying; empty parts take no span."""
        if not nbytes:
            return Span()
        alignment = PAGE_SIZE if page or nbytes >= PAGE_ALIGN_THRESHOLD else SPAN_ALIGNMENT
        start = align(self.position, alignment)
        self.position = start + nbytes
        return Span(start, nbytes)

    @property
    def data_length(self) -> int:
        return align(self.position, SPAN_ALIGNMENT)

    def header(self, base: int) -> Header:
        """The header with spans made absolute (``base``: the data region's offset)."""
        relative = Header(
            identity=self.identity,
            min_runtime_version=self.min_runtime_version,
            tensors=tuple(self.tensors),
            sections=tuple(self.sections),
            required_operators=self.required_operators,
            provenance=self.provenance,
        )
        return shift_spans(relative, base)

    def encode(self) -> tuple[bytes, int]:
        """Header bytes with absolute offsets, and the data region's offset (the first
        page after preamble and header); spans are fixed-size so this converges."""
        data_offset = DATA_REGION_ALIGNMENT
        for _ in range(4):
            encoded = encode_header(self.header(data_offset))
            needed = align(PREAMBLE_SIZE + len(encoded), DATA_REGION_ALIGNMENT)
            if needed == data_offset:
                return encoded, data_offset
            data_offset = needed
        raise RuntimeError("header size did not converge")  # pragma: no cover

    def file_size(self, signing_keys: Sequence[object] = ()) -> int:
        """Bytes of the finished file: preamble and header, data region, signature block."""
        _, data_offset = self.encode()
        return data_offset + self.data_length + signature_length(signing_keys)

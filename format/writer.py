"""Streaming package writer.

Tensors are appended to a spool file as they arrive, so memory holds one tensor at a
time whatever the model size. ``finish`` writes preamble, header and data into a
temporary file next to the target, optionally signs it, fsyncs and renames: the
target path either keeps its old content or gets a complete package, never a torn one.
"""

from __future__ import annotations

import enum
import hashlib
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import zstandard

from .constants import (
    DATA_REGION_ALIGNMENT,
    PAGE_ALIGN_THRESHOLD,
    PAGE_SIZE,
    PREAMBLE_SIZE,
    SPAN_ALIGNMENT,
    Compression,
    Encoding,
    SectionKind,
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
from .header_decode import decode_header
from .layout import tensor_layout
from .preamble import Preamble
from .signing import build_signature_block
from .validate import validate_header

__all__ = ["PackageWriter"]

_COMPRESS_MIN = 1024


class _State(enum.Enum):
    OPEN = "open"
    FINISHED = "finished"
    ABORTED = "aborted"


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


class PackageWriter:
    """Write a package tensor by tensor; use as a context manager.

    >>> with PackageWriter("m.epk", ModelIdentity("m", "1.0.0", "llama")) as w:
    ...     w.add_tensor("norm.weight", Encoding.F32, np.ones(4, np.float32))
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        identity: ModelIdentity,
        *,
        min_runtime_version: str = "0.1.0",
        required_operators: Sequence[tuple[str, int]] = (),
        provenance: Provenance | None = None,
    ) -> None:
        from .compat import parse_semver

        parse_semver(min_runtime_version)  # ValueError early, not a broken file later
        parse_semver(identity.version)
        self.path = Path(path)
        self._identity = identity
        self._min_runtime_version = min_runtime_version
        self._required_operators = tuple(required_operators)
        self._provenance = provenance or Provenance()
        self._spool = tempfile.NamedTemporaryFile(
            dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".spool", delete=False
        )
        self._position = 0  # next free byte in the data region, relative to its start
        self._tensors: list[TensorEntry] = []
        self._sections: list[SectionEntry] = []
        self._names: set[str] = set()
        self._state = _State.OPEN

    # -- context manager ---------------------------------------------------
    def __enter__(self) -> PackageWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self._state is _State.OPEN:
            self.finish()

    # -- adding content ------------------------------------------------------
    def add_tensor(
        self,
        name: str,
        encoding: Encoding,
        codes: np.ndarray,
        scales: np.ndarray | None = None,
        zeros: np.ndarray | None = None,
        *,
        shape: Sequence[int] | None = None,
        group_size: int = 0,
    ) -> TensorEntry:
        """Append one tensor. ``shape`` is the logical shape (default: ``codes.shape``)."""
        self._require_open()
        encoding = Encoding(encoding)
        if encoding == Encoding.LOW_RANK:
            raise ValueError("use add_low_rank for low-rank tensors")
        self._claim_name(name)
        logical = tuple(int(d) for d in (codes.shape if shape is None else shape))
        layout = tensor_layout(encoding, logical, group_size)
        digest = hashlib.sha256()
        spans = []
        for part_name, array, part in zip(
            ("codes", "scales", "zeros"),
            (codes, scales, zeros),
            (layout.codes, layout.scales, layout.zeros),
            strict=True,
        ):
            if part is None:
                if array is not None:
                    raise ValueError(f"{name}: {encoding.name} has no {part_name}")
                spans.append(Span())
                continue
            if array is None:
                raise ValueError(f"{name}: {encoding.name} needs {part_name}")
            array = np.asarray(array)
            if array.dtype.kind != part.dtype.kind or array.dtype.itemsize != part.dtype.itemsize:
                raise ValueError(f"{name}: {part_name} must be {part.dtype}, got {array.dtype}")
            if array.size * array.dtype.itemsize != part.nbytes:
                raise ValueError(
                    f"{name}: {part_name} has {array.size} elements, layout needs "
                    f"{part.nbytes // part.dtype.itemsize}"
                )
            data = np.ascontiguousarray(array, dtype=part.dtype)
            spans.append(self._append(memoryview(data).cast("B"), digest))
        entry = TensorEntry(
            name=name,
            shape=logical,
            encoding=encoding,
            codes=spans[0],
            scales=spans[1],
            zeros=spans[2],
            hash=digest.digest(),
            group_size=group_size if encoding.is_group else 0,
        )
        self._tensors.append(entry)
        return entry

    def add_low_rank(
        self, name: str, shape: Sequence[int], factors: tuple[str, str], rank: int
    ) -> TensorEntry:
        """Declare ``name = U @ V`` where U and V were (or will be) added as tensors."""
        self._require_open()
        self._claim_name(name)
        entry = TensorEntry(
            name=name,
            shape=tuple(int(d) for d in shape),
            encoding=Encoding.LOW_RANK,
            factors=tuple(factors),
            rank=rank,
        )
        self._tensors.append(entry)
        return entry

    def add_section(
        self,
        kind: SectionKind | int,
        data: bytes,
        *,
        name: str = "",
        media_type: str = "application/octet-stream",
        compress: bool | None = None,
        required: bool = False,
    ) -> SectionEntry:
        """Append a typed section; compressed with zstd when that makes it smaller."""
        self._require_open()
        if any(s.kind == int(kind) and s.name == name for s in self._sections):
            raise ValueError(f"a section of kind {kind} named {name!r} already exists")
        stored, compression = bytes(data), Compression.NONE
        if compress or (compress is None and len(data) >= _COMPRESS_MIN):
            packed = zstandard.ZstdCompressor(level=19, write_content_size=True).compress(data)
            if len(packed) < len(data):
                stored, compression = packed, Compression.ZSTD
        digest = hashlib.sha256()
        span = self._append(memoryview(stored), digest)
        entry = SectionEntry(
            kind=int(kind),
            name=name,
            data=span,
            hash=digest.digest(),
            media_type=media_type,
            compression=compression,
            uncompressed_length=len(data),
            required=required,
        )
        self._sections.append(entry)
        return entry

    # -- finishing -------------------------------------------------------------
    def finish(self, signing_keys: Sequence[object] = ()) -> Path:
        """Assemble the package at ``path`` (atomically) and return the path."""
        self._require_open()
        try:
            self._spool.flush()
            data_length = _align(self._position, SPAN_ALIGNMENT)
            header_bytes, data_offset = self._encode_header()
            digest = hashlib.sha256(header_bytes).digest()
            signature = build_signature_block(digest, signing_keys) if signing_keys else b""
            preamble = Preamble(
                header_offset=PREAMBLE_SIZE,
                header_length=len(header_bytes),
                data_offset=data_offset,
                data_length=data_length,
                header_digest=digest,
                signature_offset=data_offset + data_length if signature else 0,
                signature_length=len(signature),
            )
            # Never write a file our own reader would refuse (bad factors, overlaps...).
            validate_header(decode_header(header_bytes), preamble)
            fd, tmp_name = tempfile.mkstemp(
                dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".partial"
            )
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(preamble.pack())
                    out.write(header_bytes)
                    out.write(bytes(data_offset - PREAMBLE_SIZE - len(header_bytes)))
                    self._spool.seek(0)
                    shutil.copyfileobj(self._spool, out, 16 * 1024 * 1024)
                    out.write(bytes(data_length - self._position))
                    out.write(signature)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp_name, self.path)
            except BaseException:
                Path(tmp_name).unlink(missing_ok=True)
                raise
        except BaseException:
            self.abort()
            raise
        self._close_spool()
        self._state = _State.FINISHED
        return self.path

    def abort(self) -> None:
        """Drop everything written so far; the target path is left untouched."""
        if self._state is _State.OPEN:
            self._close_spool()
            self._state = _State.ABORTED

    # -- internals ---------------------------------------------------------------
    def _require_open(self) -> None:
        if self._state is not _State.OPEN:
            raise ValueError(f"writer is {self._state.value}")

    def _claim_name(self, name: str) -> None:
        if not name or len(name.encode()) > 512:
            raise ValueError(f"invalid tensor name {name!r}")
        if name in self._names:
            raise ValueError(f"tensor {name!r} added twice")
        self._names.add(name)

    def _append(self, data: memoryview, digest) -> Span:
        if not data.nbytes:
            return Span()
        alignment = PAGE_SIZE if data.nbytes >= PAGE_ALIGN_THRESHOLD else SPAN_ALIGNMENT
        start = _align(self._position, alignment)
        if start > self._position:
            self._spool.write(bytes(start - self._position))
        self._spool.write(data)
        digest.update(data)
        self._position = start + data.nbytes
        return Span(start, data.nbytes)  # relative until _encode_header rebases it

    def _header(self, base: int) -> Header:
        def rebase(span: Span) -> Span:
            return Span(span.offset + base, span.length) if span.length else span

        tensors = tuple(
            TensorEntry(
                name=t.name,
                shape=t.shape,
                encoding=t.encoding,
                codes=rebase(t.codes),
                scales=rebase(t.scales),
                zeros=rebase(t.zeros),
                hash=t.hash,
                group_size=t.group_size,
                factors=t.factors,
                rank=t.rank,
            )
            for t in self._tensors
        )
        sections = tuple(
            SectionEntry(
                kind=s.kind,
                name=s.name,
                data=rebase(s.data),
                hash=s.hash,
                media_type=s.media_type,
                compression=s.compression,
                uncompressed_length=s.uncompressed_length,
                required=s.required,
            )
            for s in self._sections
        )
        return Header(
            identity=self._identity,
            min_runtime_version=self._min_runtime_version,
            tensors=tensors,
            sections=sections,
            required_operators=self._required_operators,
            provenance=self._provenance,
        )

    def _encode_header(self) -> tuple[bytes, int]:
        """Header bytes with absolute offsets; spans are fixed-size so this converges."""
        data_offset = DATA_REGION_ALIGNMENT
        for _ in range(4):
            encoded = encode_header(self._header(data_offset))
            needed = _align(PREAMBLE_SIZE + len(encoded), DATA_REGION_ALIGNMENT)
            if needed == data_offset:
                return encoded, data_offset
            data_offset = needed
        raise RuntimeError("header size did not converge")  # pragma: no cover

    def _close_spool(self) -> None:
        self._spool.close()
        Path(self._spool.name).unlink(missing_ok=True)

"""Package writer: every span written once, in place.

:class:`PackageSizer` lays the package out from metadata (:mod:`.file_layout`) and
answers its exact size without writing anything, so a caller with a size budget knows
before writing. :class:`PackageWriter` is the same layout plus the bytes: each part goes
straight to its final place in a temporary file next to the target (memory holds one
tensor at a time, hashes are computed as the parts stream in); ``finish`` writes
preamble and header in front, optionally signs, fsyncs and renames: the target path
either keeps its old content or gets a complete package, never a torn one.

The data region starts right after the header, whose length is known only once every
entry is: a caller that knows it up front (``data_offset``, from a :class:`PackageSizer`
of the same content) gets no copy at all; otherwise the writer guesses one page and, when
the header outgrows it, moves the data region once at ``finish``.
"""

from __future__ import annotations

import enum
import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import zstandard

from .constants import DATA_REGION_ALIGNMENT, PREAMBLE_SIZE, Compression, Encoding, SectionKind
from .digests import sha256
from .file_layout import DIGEST_PLACEHOLDER, FileLayout, signature_length
from .file_mode import seal_output
from .header import ModelIdentity, Provenance, SectionEntry, Span, TensorEntry
from .header_decode import decode_header
from .layout import tensor_layout
from .output_file import create_partial, remove_stale_partials
from .preamble import Preamble
from .signing import build_signature_block
from .validate import low_rank_excess, section_excess, validate_header

if TYPE_CHECKING:
    from .reader import Package

__all__ = ["PackageSizer", "PackageWriter"]

_COMPRESS_MIN = 1024
_MOVE_CHUNK = 16 * 1024 * 1024


@functools.lru_cache(maxsize=8)  # a build sizes, then writes, the same sections
def _stored(data: bytes, compress: bool | None) -> tuple[bytes, Compression]:
    """A section's bytes as stored: zstd-compressed when that makes them smaller."""
    if compress or (compress is None and len(data) >= _COMPRESS_MIN):
        packed = zstandard.ZstdCompressor(level=19, write_content_size=True).compress(data)
        if len(packed) < len(data):
            return packed, Compression.ZSTD
    return data, Compression.NONE


class _State(enum.Enum):
    OPEN = "open"
    FINISHED = "finished"
    ABORTED = "aborted"


class PackageSizer:
    """Lay a package out tensor by tensor, writing nothing: :meth:`file_size` is the exact
    size :class:`PackageWriter` produces from the same calls (same order, same data)."""

    def __init__(
        self,
        identity: ModelIdentity,
        *,
        min_runtime_version: str = "0.1.0",
        required_operators: Sequence[tuple[str, int]] = (),
        provenance: Provenance | None = None,
    ) -> None:
        from .compat import parse_semver

        parse_semver(min_runtime_version)  # ValueError early, not a broken file later
        parse_semver(identity.version)
        self._layout = FileLayout(
            identity, min_runtime_version, tuple(required_operators), provenance or Provenance()
        )
        self._names: set[str] = set()
        self._state = _State.OPEN

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
        encoding = self._begin_tensor(name, encoding)
        logical = tuple(int(d) for d in (codes.shape if shape is None else shape))
        layout = tensor_layout(encoding, logical, group_size)
        arrays: list[np.ndarray] = []
        for part_name, array, part in zip(
            ("codes", "scales", "zeros"),
            (codes, scales, zeros),
            (layout.codes, layout.scales, layout.zeros),
            strict=True,
        ):
            if part is None:
                if array is not None:
                    raise ValueError(f"{name}: {encoding.name} has no {part_name}")
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
            arrays.append(array)
        return self._place_tensor(name, encoding, logical, group_size, arrays)

    def declare_tensor(
        self, name: str, encoding: Encoding, shape: Sequence[int], group_size: int = 0
    ) -> TensorEntry:
        """Lay out a tensor from its metadata alone (sizing only: nothing is stored)."""
        encoding = self._begin_tensor(name, encoding)
        return self._place_tensor(name, encoding, tuple(int(d) for d in shape), group_size, None)

    def _place_tensor(
        self,
        name: str,
        encoding: Encoding,
        logical: tuple[int, ...],
        group_size: int,
        arrays: list[np.ndarray] | None,
    ) -> TensorEntry:
        """Spans for the parts in file order (codes, scales, zeros); stores ``arrays``."""
        layout = tensor_layout(encoding, logical, group_size)
        spans, parts = [], []
        for part in (layout.codes, layout.scales, layout.zeros):
            spans.append(self._layout.place(part.nbytes) if part is not None else Span())
            if part is not None:
                parts.append((spans[-1], arrays[len(parts)] if arrays else None, part.dtype))
        entry = TensorEntry(
            name=name,
            shape=logical,
            encoding=encoding,
            codes=spans[0],
            scales=spans[1],
            zeros=spans[2],
            hash=self._store(parts),
            group_size=group_size if encoding.is_group else 0,
        )
        self._layout.tensors.append(entry)
        return entry

    def add_low_rank(
        self, name: str, shape: Sequence[int], factors: tuple[str, str], rank: int
    ) -> TensorEntry:
        """Declare ``name = U @ V`` where U and V were (or will be) added as tensors."""
        self._require_open()
        shape = tuple(int(d) for d in shape)
        excess = low_rank_excess(shape, rank) if len(shape) >= 2 and rank >= 1 else None
        if excess:
            raise ValueError(f"low-rank tensor {name!r}: {excess}")
        self._claim_name(name)
        entry = TensorEntry(
            name=name,
            shape=shape,
            encoding=Encoding.LOW_RANK,
            factors=tuple(factors),
            rank=rank,
        )
        self._layout.tensors.append(entry)
        return entry

    def copy_tensor(self, pkg: Package, name: str) -> TensorEntry:
        """Add ``pkg``'s tensor ``name`` exactly as stored (codes, scales and zeros, no
        re-encoding: its hash, and so the weights digest, stay the same)."""
        t = pkg.entry(name)
        if t.encoding == Encoding.LOW_RANK:
            return self.add_low_rank(name, t.shape, t.factors, t.rank)
        stored = pkg.tensor(name)
        if isinstance(stored, np.ndarray):
            return self.add_tensor(name, t.encoding, stored, shape=t.shape)
        return self.add_tensor(
            name, t.encoding, stored.codes, stored.scales, stored.zeros,
            shape=t.shape, group_size=t.group_size,
        )  # fmt: skip

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
        if any(s.kind == int(kind) and s.name == name for s in self._layout.sections):
            raise ValueError(f"a section of kind {kind} named {name!r} already exists")
        excess = section_excess(int(kind), len(data))
        if excess:
            raise ValueError(f"section {name!r}: {excess}")
        stored, compression = _stored(bytes(data), compress)
        # a prefix KV cache's pages are mapped one by one from the file (spec section 6.1)
        paged = int(kind) == SectionKind.PREFIX_KV_CACHE and compression == Compression.NONE
        span = self._layout.place(len(stored), page=paged)
        array = np.frombuffer(stored, np.uint8)
        entry = SectionEntry(
            kind=int(kind),
            name=name,
            data=span,
            hash=self._store([(span, array, array.dtype)]),
            media_type=media_type,
            compression=compression,
            uncompressed_length=len(data),
            required=required,
        )
        self._layout.sections.append(entry)
        return entry

    # -- results -------------------------------------------------------------------
    @property
    def tensors(self) -> tuple[TensorEntry, ...]:
        """The tensor entries added so far (what a weights digest is computed over; a
        sizer's hashes are placeholders)."""
        return tuple(self._layout.tensors)

    @property
    def data_offset(self) -> int:
        """Where the data region starts: the first page after preamble and header."""
        return self._layout.encode()[1]

    def file_size(self, signing_keys: Sequence[object] = ()) -> int:
        """Exact bytes of the package once finished with ``signing_keys``."""
        return self._layout.file_size(signing_keys)

    # -- internals ---------------------------------------------------------------
    def _store(self, parts: list[tuple[Span, np.ndarray | None, np.dtype]]) -> bytes:
        """Put each (span, array, dtype) in place; returns their digest (here nothing is
        written and the digest is a placeholder of the same length)."""
        return DIGEST_PLACEHOLDER

    def _begin_tensor(self, name: str, encoding: Encoding) -> Encoding:
        self._require_open()
        encoding = Encoding(encoding)
        if encoding == Encoding.LOW_RANK:
            raise ValueError("use add_low_rank for low-rank tensors")
        self._claim_name(name)
        return encoding

    def _require_open(self) -> None:
        if self._state is not _State.OPEN:
            raise ValueError(f"writer is {self._state.value}")

    def _claim_name(self, name: str) -> None:
        if not name or len(name.encode()) > 512:
            raise ValueError(f"invalid tensor name {name!r}")
        if name in self._names:
            raise ValueError(f"tensor {name!r} added twice")
        self._names.add(name)


class PackageWriter(PackageSizer):
    """Write a package tensor by tensor; use as a context manager.

    >>> with PackageWriter("m.epk", ModelIdentity("m", "1.0.0", "llama")) as w:
    ...     w.add_tensor("norm.weight", Encoding.F32, np.ones(4, np.float32))

    ``data_offset``: where the data region will start, when known (from a
    :class:`PackageSizer` given the same content); then no byte is ever moved.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        identity: ModelIdentity,
        *,
        min_runtime_version: str = "0.1.0",
        required_operators: Sequence[tuple[str, int]] = (),
        provenance: Provenance | None = None,
        data_offset: int | None = None,
    ) -> None:
        super().__init__(
            identity,
            min_runtime_version=min_runtime_version,
            required_operators=required_operators,
            provenance=provenance,
        )
        self.path = Path(path)
        self._base = data_offset or DATA_REGION_ALIGNMENT
        if self._base % DATA_REGION_ALIGNMENT:
            raise ValueError(f"data offset {self._base} is not page aligned")
        remove_stale_partials(self.path)  # what a killed writer of this path left
        fd, self._tmp = create_partial(self.path)
        self._file = os.fdopen(fd, "r+b")

    # -- context manager ---------------------------------------------------
    def __enter__(self) -> PackageWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self._state is _State.OPEN:
            self.finish()

    # -- finishing -------------------------------------------------------------
    def finish(self, signing_keys: Sequence[object] = ()) -> Path:
        """Complete the package at ``path`` (atomically) and return the path."""
        self._require_open()
        try:
            data_length = self._layout.data_length
            header_bytes, data_offset = self._layout.encode()
            digest = sha256(header_bytes).digest()
            signature = build_signature_block(digest, signing_keys) if signing_keys else b""
            assert len(signature) == signature_length(signing_keys)
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
            out = self._file
            if data_offset != self._base:
                self._move_data(data_offset)
            # the gaps (header padding, span alignment, data tail) read as zeros
            out.truncate(data_offset + data_length)
            out.seek(0)
            out.write(preamble.pack())
            out.write(header_bytes)
            out.write(bytes(data_offset - PREAMBLE_SIZE - len(header_bytes)))
            out.seek(data_offset + self._layout.position)  # stale bytes after a move
            out.write(bytes(data_length - self._layout.position))
            out.write(signature)
            seal_output(out)  # mkstemp made it 0600: packages are shared
            out.close()
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        self._state = _State.FINISHED
        return self.path

    def abort(self) -> None:
        """Drop everything written so far; the target path is left untouched."""
        if self._state is _State.OPEN:
            self._file.close()
            self._tmp.unlink(missing_ok=True)
            self._state = _State.ABORTED

    # -- internals ---------------------------------------------------------------
    def _store(self, parts: list[tuple[Span, np.ndarray | None, np.dtype]]) -> bytes:
        digest = sha256(size=sum(span.length for span, _, _ in parts))
        for span, array, dtype in parts:
            if array is None:
                raise ValueError("declare_tensor only sizes a package; add_tensor writes one")
            if not span.length:
                continue
            data = memoryview(np.ascontiguousarray(array, dtype=dtype)).cast("B")
            self._file.seek(self._base + span.offset)
            self._file.write(data)
            digest.update(data)
        return digest.digest()

    def _move_data(self, data_offset: int) -> None:
        """Shift the data region to ``data_offset`` (the header outgrew the guess): one
        copy within the file, from the end when moving forward so nothing is overwritten
        before it is read."""
        f, length, old = self._file, self._layout.position, self._base
        starts = range(0, length, _MOVE_CHUNK)
        for start in reversed(starts) if data_offset > old else starts:
            n = min(_MOVE_CHUNK, length - start)
            f.seek(old + start)
            chunk = f.read(n)
            chunk += bytes(n - len(chunk))  # a trailing gap not written yet
            f.seek(data_offset + start)
            f.write(chunk)
        self._base = data_offset

"""Open packages lazily: O(header) to open, tensors are zero-copy views of a read-only mmap.

``Package.open`` reads the preamble and header (checking the header digest and every
span), and maps the file without touching the data. Hashes of tensors and sections
are checked on demand by :meth:`Package.verify`, for everything or per tensor.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zstandard

from .compat import CompatibilityVerdict, RuntimeCapabilities, check_compatibility
from .constants import (
    JSON_OBJECT_SECTIONS,
    MAX_SECTION_WINDOW,
    PREAMBLE_SIZE,
    TEXT_SECTIONS,
    Compression,
    Encoding,
    SectionKind,
)
from .digests import sha256
from .errors import CorruptPackageError, IncompatiblePackageError
from .header import Header, SectionEntry, Span, TensorEntry
from .header_decode import decode_header
from .layout import tensor_layout
from .preamble import Preamble
from .signing import check_threshold, parse_signature_block, verify_signature_block
from .validate import validate_header
from .weights_digest import weights_digest

__all__ = ["Package", "QuantizedTensor", "VerifyReport", "section_kind"]


@dataclass(frozen=True)
class QuantizedTensor:
    """Zero-copy views of a quantized tensor's parts."""

    entry: TensorEntry
    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None

    @property
    def encoding(self) -> Encoding:
        return self.entry.encoding

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    def group_values(self) -> tuple[np.ndarray, np.ndarray | None]:
        """float16 group ``(scales, mins)`` ``[R, C/g]`` (``*_S8`` parts expanded, a copy;
        binary16 parts are the zero-copy views)."""
        from . import codecs

        return codecs.group_values(self.encoding, self.scales, self.zeros)

    def dequantize(self) -> np.ndarray:
        from . import codecs

        out = codecs.dequantize(
            self.encoding, self.codes, self.scales, self.zeros, self.entry.group_size
        )
        return out.reshape(self.shape)


@dataclass(frozen=True)
class VerifyReport:
    tensors_checked: int
    sections_checked: int
    bytes_hashed: int
    signed: bool
    trusted_signers: tuple[str, ...]  # hex key ids that verified


class Package:
    """A read-only, memory-mapped package. Use :meth:`open`."""

    def __init__(
        self, path: Path, fileobj, mm: mmap.mmap, pre: Preamble, header: Header, header_bytes: bytes
    ) -> None:
        self.path = path
        self._file = fileobj
        self._mm = mm
        self.preamble = pre
        self.header = header
        self._header_bytes = header_bytes

    # -- opening ---------------------------------------------------------------
    @classmethod
    def open(
        cls, path: str | os.PathLike[str], *, capabilities: RuntimeCapabilities | None = None
    ) -> Package:
        """Open and check a package; with ``capabilities`` also refuse incompatible ones."""
        path = Path(path)
        f = open(path, "rb")
        try:
            size = os.fstat(f.fileno()).st_size
            pre = Preamble.unpack(f.read(PREAMBLE_SIZE), size)
            f.seek(pre.header_offset)
            header_bytes = f.read(pre.header_length)
            if sha256(header_bytes).digest() != pre.header_digest:
                raise CorruptPackageError("header digest mismatch: the header was modified")
            header = validate_header(decode_header(header_bytes), pre)
            if capabilities is not None:
                verdict = check_compatibility(header, capabilities)
                if not verdict:
                    raise IncompatiblePackageError(verdict.summary(), verdict)
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except BaseException:
            f.close()
            raise
        return cls(path, f, mm, pre, header, header_bytes)

    def close(self) -> None:
        """Release the mapping; views still alive keep it mapped until they die."""
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # numpy views are alive; the mapping goes with the last of them
            self._mm = None
        self._file.close()

    def release_resident_pages(self) -> None:
        """Drop this process's resident pages of the mapping: after a hash pass over the
        whole file they would count in its RSS before any is needed. The mapping is a
        read-only view of the file, so nothing is lost: the page cache keeps the pages
        and a read faults them back. A no-op where ``madvise`` is missing (Windows)."""
        if self._mm is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._mm.madvise(mmap.MADV_DONTNEED)

    def advise_huge_pages(self) -> bool:
        """Ask for the mapping in 2 MiB pages (``MADV_HUGEPAGE``): pages read in from now on
        come in huge page-cache folios, one TLB entry each instead of 512. Takes only
        before the data is first read; False where the platform has no such advice."""
        if self._mm is None or not hasattr(mmap, "MADV_HUGEPAGE"):
            return False
        try:
            self._mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without transparent huge pages
            return False
        return True

    def __enter__(self) -> Package:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- tensors -----------------------------------------------------------------
    @property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self.header.tensors]

    @property
    def weights_digest(self) -> bytes:
        """What adapters, prefix caches and saved sessions bind to (``weights_digest.py``)."""
        return weights_digest(self.header.tensors)

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.header.tensor_index[name]
        except KeyError:
            raise KeyError(f"package has no tensor {name!r}") from None

    def tensor(self, name: str) -> np.ndarray | QuantizedTensor:
        """The stored tensor without copying: an ndarray for float encodings
        (bf16 as raw uint16), a :class:`QuantizedTensor` of views for integer ones."""
        t = self.entry(name)
        if t.encoding == Encoding.LOW_RANK:
            raise ValueError(f"{name} is low-rank: read its factors {t.factors}")
        layout = tensor_layout(t.encoding, t.shape, t.group_size)
        codes = self._view(t.codes, layout.codes)
        if t.encoding.is_float:
            return codes
        scales = self._view(t.scales, layout.scales)
        zeros = self._view(t.zeros, layout.zeros) if layout.zeros else None
        return QuantizedTensor(t, codes, scales, zeros)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor's values as float32 (a copy), whatever its encoding."""
        t = self.entry(name)
        if t.encoding == Encoding.LOW_RANK:
            u, v = (self.dequantize(f) for f in t.factors)
            return (u @ v).reshape(t.shape)
        stored = self.tensor(name)
        if isinstance(stored, QuantizedTensor):
            return stored.dequantize()
        from . import codecs

        return codecs.dequantize(t.encoding, stored)

    def _view(self, span: Span, part) -> np.ndarray:
        if self._mm is None:
            raise ValueError("package is closed")
        count = span.length // part.dtype.itemsize
        return np.frombuffer(self._mm, part.dtype, count, span.offset).reshape(part.shape)

    # -- sections ----------------------------------------------------------------
    def sections(self, kind: SectionKind | int | str | None = None) -> list[SectionEntry]:
        """The sections of ``kind`` (a SectionKind, its number or name), or all of them."""
        if kind is None:
            return list(self.header.sections)
        wanted = section_kind(kind)
        return [s for s in self.header.sections if s.kind == wanted]

    def section(self, kind: SectionKind | int | str, name: str | None = None) -> bytes | None:
        """The section's content, hash-checked and decompressed; None if absent. ``kind``
        is a SectionKind, its number or its name (``"tokenizer"``). A kind that must hold a
        JSON object (tokenizer, config, metadata) or UTF-8 text (chat template) is checked
        too."""
        matches = [s for s in self.sections(kind) if name is None or s.name == name]
        if not matches:
            return None
        if len(matches) > 1:
            raise KeyError(f"several sections of kind {kind}; give a name")
        data = self._load_section(matches[0])
        if matches[0].kind in JSON_OBJECT_SECTIONS:
            _check_json_object(data, matches[0])
        elif matches[0].kind in TEXT_SECTIONS:
            _check_text(data, matches[0])
        return data

    def section_view(self, sec: SectionEntry) -> memoryview:
        """The content of section ``sec`` once it hash-checks: for an uncompressed one a
        view of the mapping (no copy: prefix KV pages are used in place), else a copy."""
        if sec.compression == Compression.ZSTD:
            return memoryview(self._load_section(sec))
        return self._stored_section(sec)

    def _load_section(self, sec: SectionEntry) -> bytes:
        """Hash-check and decode one section; typed errors for any inconsistency.
        Memory: the declared length once, which open bounded per kind."""
        stored = self._stored_section(sec)
        try:
            if sec.compression == Compression.ZSTD:
                data = _decompressor(stored, sec).decompress(
                    stored, max_output_size=sec.uncompressed_length
                )
                _check_decoded_length(len(data), sec)
            else:
                data = bytes(stored)
        except zstandard.ZstdError as exc:
            raise CorruptPackageError(f"{_where(sec)} does not decompress: {exc}") from None
        finally:
            stored.release()
        return data

    def _check_section_data(self, sec: SectionEntry) -> None:
        """What :meth:`_load_section` checks, holding one chunk at a time: kinds large
        by nature (KV caches, adapters) may declare 1 GiB."""
        stored = self._stored_section(sec)
        try:
            if sec.compression != Compression.ZSTD:
                return
            produced = 0
            limit = sec.uncompressed_length
            with _decompressor(stored, sec).stream_reader(stored) as reader:
                while chunk := reader.read(min(_CHUNK, limit - produced + 1)):
                    produced += len(chunk)
                    if produced > limit:
                        break
            _check_decoded_length(produced, sec)
        except zstandard.ZstdError as exc:
            raise CorruptPackageError(f"{_where(sec)} does not decompress: {exc}") from None
        finally:
            stored.release()

    def _stored_section(self, sec: SectionEntry) -> memoryview:
        """A view of the section's stored bytes once they hash-check (release it)."""
        if self._mm is None:
            raise ValueError("package is closed")
        digest = sha256(size=sec.data.length)
        self._hash_span(sec.data, digest)
        if digest.digest() != sec.hash:
            raise CorruptPackageError(f"{_where(sec)} hash mismatch")
        if sec.compression != Compression.ZSTD and sec.data.length != sec.uncompressed_length:
            raise CorruptPackageError(f"{_where(sec)} has the wrong length")
        return memoryview(self._mm)[sec.data.offset : sec.data.end]

    # -- integrity -----------------------------------------------------------------
    def verify_tensor(self, name: str) -> None:
        t = self.entry(name)
        if t.encoding == Encoding.LOW_RANK:
            for factor in t.factors:
                self.verify_tensor(factor)
            return
        digest = sha256(size=sum(span.length for span in t.spans))
        for span in t.spans:
            self._hash_span(span, digest)
        if digest.digest() != t.hash:
            raise CorruptPackageError(f"tensor {name!r} hash mismatch: its data is corrupt")

    def verify(
        self,
        trusted_keys: Sequence[object] | None = None,
        *,
        threshold: int = 1,
        tensors: Iterable[str] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> VerifyReport:
        """Check hashes (all tensors, or the named ones, and all sections) and, when
        ``trusted_keys`` is given, that enough trusted keys signed the header."""
        check_threshold(threshold)
        signers: list[bytes] = []
        block = self.signature_block()
        if trusted_keys is not None:
            signers = verify_signature_block(
                block, self.preamble.header_digest, list(trusted_keys), threshold
            )
        elif block:
            parse_signature_block(block)  # malformed blocks are an error even unchecked
        names = self.tensor_names if tensors is None else list(tensors)
        hashed = 0
        for name in names:
            self.verify_tensor(name)
            n = self.entry(name).nbytes
            hashed += n
            if progress:
                progress(n)
        known_kinds = {int(k) for k in SectionKind}
        for sec in self.header.sections:
            if sec.kind in known_kinds:
                self._check_section_data(sec)  # hash, and that it decodes as declared
            else:  # optional and unknown (validate refuses required ones): hash only
                digest = sha256(size=sec.data.length)
                self._hash_span(sec.data, digest)
                if digest.digest() != sec.hash:
                    raise CorruptPackageError(f"section {sec.kind_name}/{sec.name!r} hash mismatch")
            hashed += sec.data.length
        return VerifyReport(
            tensors_checked=len(names),
            sections_checked=len(self.header.sections),
            bytes_hashed=hashed,
            signed=bool(block),
            trusted_signers=tuple(k.hex() for k in signers),
        )

    def file_stat(self) -> os.stat_result:
        """``fstat`` of the open file (the one mapped), for integrity records."""
        return os.fstat(self._file.fileno())

    def fileno(self) -> int:
        """The open file's descriptor (the runtime maps prefix KV pages from it again)."""
        return self._file.fileno()

    def mapped_offset(self, a: np.ndarray) -> int | None:
        """The file offset of ``a``'s first byte when ``a`` views this package's mapping,
        else None (a copy, a decompressed section, a closed package)."""
        if self._mm is None:
            return None
        start = np.frombuffer(self._mm, np.uint8).__array_interface__["data"][0]
        off = a.__array_interface__["data"][0] - start
        return off if 0 <= off and off + a.nbytes <= len(self._mm) else None

    def signature_block(self) -> bytes:
        pre = self.preamble
        if not pre.signed or self._mm is None:
            return b""
        return bytes(self._mm[pre.signature_offset : pre.signature_offset + pre.signature_length])

    def check_compatibility(self, capabilities: RuntimeCapabilities) -> CompatibilityVerdict:
        return check_compatibility(self.header, capabilities)

    def _hash_span(self, span: Span, digest) -> None:
        if not span.length:
            return
        if self._mm is None:
            raise ValueError("package is closed")
        view = memoryview(self._mm)
        try:
            step = 64 * 1024 * 1024
            for start in range(span.offset, span.end, step):
                digest.update(view[start : min(start + step, span.end)])
        finally:
            view.release()


def section_kind(kind: SectionKind | int | str) -> int:
    """The number of a section kind given as SectionKind, int or name (``tokenizer``,
    ``chat-template``; case-insensitive); ValueError naming the kinds otherwise."""
    if isinstance(kind, str):
        try:
            return int(SectionKind[kind.strip().upper().replace("-", "_")])
        except KeyError:
            known = ", ".join(k.name.lower() for k in SectionKind)
            raise ValueError(f"unknown section kind {kind!r}; use one of {known}") from None
    return int(kind)


_CHUNK = 1 << 20


def _where(sec: SectionEntry) -> str:
    return f"section {sec.kind_name}/{sec.name!r}"


def _decompressor(stored: memoryview, sec: SectionEntry) -> zstandard.ZstdDecompressor:
    """A decompressor for the section's one zstd frame, once its frame header declares
    the header's size and a window under MAX_SECTION_WINDOW."""
    try:
        params = zstandard.get_frame_parameters(stored)
    except zstandard.ZstdError as exc:
        raise CorruptPackageError(f"{_where(sec)} does not decompress: {exc}") from None
    if params.content_size != sec.uncompressed_length:
        raise CorruptPackageError(f"{_where(sec)}: compressed size header mismatch")
    if params.window_size > MAX_SECTION_WINDOW:
        raise CorruptPackageError(f"{_where(sec)}: zstd window {params.window_size} too large")
    return zstandard.ZstdDecompressor(max_window_size=MAX_SECTION_WINDOW)


def _check_decoded_length(produced: int, sec: SectionEntry) -> None:
    if produced != sec.uncompressed_length:
        raise CorruptPackageError(f"{_where(sec)} decompressed to the wrong size")


def _check_text(data: bytes, sec: SectionEntry) -> None:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptPackageError(f"{_where(sec)} is not UTF-8 text: {exc}") from None


def _check_json_object(data: bytes, sec: SectionEntry) -> None:
    """A JSON section that is binary, not UTF-8 or not an object is corrupt: say so here
    rather than let its consumer crash on it."""
    where = _where(sec)
    if data[:4096].lstrip()[:1] not in (b"{", b""):  # cheap refusal of binary bombs
        raise CorruptPackageError(f"{where} is not a JSON object")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptPackageError(f"{where} is not UTF-8 JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise CorruptPackageError(f"{where} is not a JSON object")

"""Decode untrusted header bytes into :class:`~edgepack.format.header.Header`.

A small flatbuffer table reader of our own instead of the generated accessors: those
trust their input (a string whose length runs past the buffer is silently cut) and cost
~1 µs per field, which made opening a 300-tensor package take 18 ms. Here every read is
bounds-checked and any failure becomes :class:`CorruptPackageError`.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from .constants import MAX_SECTIONS, MAX_TENSORS, Compression, Encoding
from .errors import CorruptPackageError
from .header import (
    NO_SPAN,
    Header,
    ModelIdentity,
    Provenance,
    SectionEntry,
    Span,
    TensorEntry,
)

__all__ = ["decode_header", "offset_vectors"]

_I32 = struct.Struct("<i")
_U32 = struct.Struct("<I")
_SPAN = struct.Struct("<QQ")
_SCALAR = {
    1: struct.Struct("<B"),
    2: struct.Struct("<H"),
    4: struct.Struct("<I"),
    8: struct.Struct("<Q"),
}
_ENCODINGS = {int(e): e for e in Encoding}
_COMPRESSIONS = {int(c): c for c in Compression}
_MAX_VTABLE_FIELDS = 64


class _Table:
    """One flatbuffer table: field positions from its vtable, checked reads."""

    __slots__ = ("buf", "fields", "pos", "vtables")

    def __init__(self, buf: bytes, pos: int, vtables: dict[int, tuple[int, ...]]) -> None:
        """``vtables`` caches parsed vtables of this buffer: tables of one type share one."""
        size = len(buf)
        if pos < 0 or pos + 4 > size:
            raise CorruptPackageError("header table lies outside the header")
        vtable = pos - _I32.unpack_from(buf, pos)[0]
        self.buf, self.pos = buf, pos
        fields = vtables.get(vtable)
        if fields is None:
            if vtable < 0 or vtable + 4 > size:
                raise CorruptPackageError("header vtable lies outside the header")
            vt_size = struct.unpack_from("<H", buf, vtable)[0]
            n = min((vt_size - 4) // 2, _MAX_VTABLE_FIELDS) if vt_size >= 4 else 0
            if vtable + 4 + 2 * n > size:
                raise CorruptPackageError("header vtable runs past the header")
            fields = vtables[vtable] = struct.unpack_from(f"<{n}H", buf, vtable + 4)
        self.fields = fields
        self.vtables = vtables

    def _at(self, index: int) -> int:
        if index < len(self.fields) and self.fields[index]:
            return self.pos + self.fields[index]
        return 0

    def scalar(self, index: int, size: int, default: int = 0) -> int:
        at = self._at(index)
        if not at:
            return default
        if at + size > len(self.buf):
            raise CorruptPackageError("header scalar runs past the header")
        return _SCALAR[size].unpack_from(self.buf, at)[0]

    def vector(self, index: int, elem_size: int) -> tuple[int, int]:
        """(start of elements, count), checked to lie inside the buffer."""
        at = self._at(index)
        if not at:
            return 0, 0
        start = at + _U32.unpack_from(self.buf, at)[0]
        count = _U32.unpack_from(self.buf, start)[0]
        if start + 4 + count * elem_size > len(self.buf):
            raise CorruptPackageError("header vector runs past the end of the header")
        return start + 4, count

    def string(self, index: int, required: str = "") -> str:
        start, count = self.vector(index, 1)
        if not start:
            if required:
                raise CorruptPackageError(f"header is missing the required field {required}")
            return ""
        return self.buf[start : start + count].decode("utf-8")

    def raw(self, index: int) -> bytes:
        start, count = self.vector(index, 1)
        return self.buf[start : start + count] if start else b""

    def span(self, index: int) -> Span:
        at = self._at(index)
        if not at:
            return NO_SPAN
        if at + 16 > len(self.buf):
            raise CorruptPackageError("header span runs past the end of the header")
        offset, length = _SPAN.unpack_from(self.buf, at)
        return Span(offset, length) if (offset or length) else NO_SPAN

    def table(self, index: int) -> _Table | None:
        at = self._at(index)
        if not at:
            return None
        return _Table(self.buf, at + _U32.unpack_from(self.buf, at)[0], self.vtables)

    def item_positions(self, index: int, limit: int, what: str) -> list[int]:
        """Absolute positions of the items of a vector of tables or strings."""
        start, count = self.vector(index, 4)
        if count > limit:
            raise CorruptPackageError(f"header lists {count} {what}, more than {limit}")
        buf = self.buf
        return [start + 4 * i + _U32.unpack_from(buf, start + 4 * i)[0] for i in range(count)]

    def strings(self, index: int, limit: int, what: str) -> list[str]:
        out = []
        for pos in self.item_positions(index, limit, what):
            n = _U32.unpack_from(self.buf, pos)[0]
            if pos + 4 + n > len(self.buf):
                raise CorruptPackageError(f"a {what} string runs past the header")
            out.append(self.buf[pos + 4 : pos + 4 + n].decode("utf-8"))
        return out


# Field indices, fixed by the order of fields in spec/edgepack.fbs (append-only).
class _H:
    FORMAT, MIN_RT, QSCHEMA, OPSET, OPS, FEATURES, IDENTITY, PROVENANCE = range(8)
    HASH_ALG, ALIGN, TENSORS, SECTIONS = range(8, 12)


class _T:
    NAME, SHAPE, ENCODING, GROUP, CODES, SCALES, ZEROS, HASH, FACTORS, RANK = range(10)


class _S:
    KIND, NAME, MEDIA, DATA, COMPRESSION, UNCOMPRESSED, HASH, REQUIRED = range(8)


_FAILURES = (IndexError, struct.error, UnicodeDecodeError, ValueError, OverflowError)


def decode_header(buf: bytes) -> Header:
    """Parse flatbuffer bytes into a :class:`Header`; any malformation is typed."""
    if len(buf) < 8 or buf[4:8] != b"EPK1":
        raise CorruptPackageError("header does not carry the flatbuffer identifier EPK1")
    try:
        return _decode(buf)
    except CorruptPackageError:
        raise
    except _FAILURES as exc:
        raise CorruptPackageError(f"header is malformed ({type(exc).__name__}: {exc})") from None


def offset_vectors(buf: bytes) -> dict[str, tuple[int, int]]:
    """``{"tensors": (start, count), "sections": ...}``: where the header's vectors of
    table offsets lie in ``buf`` (start of the elements, 4 bytes each; ``(0, 0)`` when
    absent). They all shift together when anything before them grows, which a delta
    codes as a difference against the old header's vectors."""
    if len(buf) < 8 or buf[4:8] != b"EPK1":
        raise CorruptPackageError("header does not carry the flatbuffer identifier EPK1")
    try:
        root = _Table(buf, _U32.unpack_from(buf, 0)[0], {})
        return {"tensors": root.vector(_H.TENSORS, 4), "sections": root.vector(_H.SECTIONS, 4)}
    except _FAILURES as exc:
        raise CorruptPackageError(f"header is malformed ({type(exc).__name__}: {exc})") from None


def _decode(buf: bytes) -> Header:
    vtables: dict[int, tuple[int, ...]] = {}
    root = _Table(buf, _U32.unpack_from(buf, 0)[0], vtables)
    ident = root.table(_H.IDENTITY)
    if ident is None:
        raise CorruptPackageError("header has no model identity")
    identity = ModelIdentity(
        name=ident.string(0, "identity.name"),
        version=ident.string(1, "identity.version"),
        architecture=ident.string(2, "identity.architecture"),
        config=_json_object(ident.string(3), "identity.config_json") or {},
    )
    prov = root.table(_H.PROVENANCE)
    provenance = Provenance()
    if prov is not None:
        provenance = Provenance(
            tool=prov.string(0),
            tool_version=prov.string(1),
            source_name=prov.string(2),
            source_sha256=prov.string(3),
            recipe=_json_object(prov.string(4), "provenance.recipe_json"),
            created=prov.string(5),
        )
    ops = []
    for pos in root.item_positions(_H.OPS, 4096, "required operators"):
        op = _Table(buf, pos, vtables)
        ops.append((op.string(0, "operator name"), op.scalar(1, 4)))
    return Header(
        identity=identity,
        min_runtime_version=root.string(_H.MIN_RT, "min_runtime_version"),
        tensors=tuple(
            _tensor(_Table(buf, pos, vtables))
            for pos in root.item_positions(_H.TENSORS, MAX_TENSORS, "tensors")
        ),
        sections=tuple(
            _section(_Table(buf, pos, vtables))
            for pos in root.item_positions(_H.SECTIONS, MAX_SECTIONS, "sections")
        ),
        required_operators=tuple(ops),
        required_features=tuple(root.strings(_H.FEATURES, 4096, "required feature")),
        provenance=provenance,
        format_version=root.scalar(_H.FORMAT, 4),
        quantization_schema_version=root.scalar(_H.QSCHEMA, 4),
        operator_set_version=root.scalar(_H.OPSET, 4),
        hash_algorithm=root.scalar(_H.HASH_ALG, 1),
        data_alignment=root.scalar(_H.ALIGN, 4),
    )


def _tensor(t: _Table) -> TensorEntry:
    start, ndim = t.vector(_T.SHAPE, 8)
    if ndim > 64:
        raise CorruptPackageError(f"a tensor declares {ndim} dimensions")
    shape = struct.unpack_from(f"<{ndim}Q", t.buf, start) if ndim else ()
    factors = t.strings(_T.FACTORS, 2, "low-rank factor")
    code = t.scalar(_T.ENCODING, 2)
    return TensorEntry(
        name=t.string(_T.NAME, "tensor name"),
        shape=shape,
        encoding=_ENCODINGS.get(code, code),  # unknown values are refused in validate.py
        codes=t.span(_T.CODES),
        scales=t.span(_T.SCALES),
        zeros=t.span(_T.ZEROS),
        hash=t.raw(_T.HASH),
        group_size=t.scalar(_T.GROUP, 4),
        factors=tuple(factors),
        rank=t.scalar(_T.RANK, 4),
    )


def _section(s: _Table) -> SectionEntry:
    comp = s.scalar(_S.COMPRESSION, 1)
    return SectionEntry(
        kind=s.scalar(_S.KIND, 2),
        name=s.string(_S.NAME),
        media_type=s.string(_S.MEDIA),
        data=s.span(_S.DATA),
        hash=s.raw(_S.HASH),
        compression=_COMPRESSIONS.get(comp, comp),
        uncompressed_length=s.scalar(_S.UNCOMPRESSED, 8),
        required=bool(s.scalar(_S.REQUIRED, 1)),
    )


def _json_object(text: str, what: str) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise CorruptPackageError(f"{what} is not valid JSON: {type(exc).__name__}") from None
    if not isinstance(value, dict):
        raise CorruptPackageError(f"{what} must be a JSON object")
    return value

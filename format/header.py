"""The package header as plain Python values, and its flatbuffer encoding.

The generated accessors in ``schema/`` trust their input; everything here that reads
bytes converts any failure into :class:`CorruptPackageError` and checks every string
and vector length against the buffer, so a hostile header can only ever produce a
typed error. Semantic checks against the file live in ``validate.py``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import flatbuffers
import numpy as np

from .constants import (
    FORMAT_MAJOR,
    MAX_SECTIONS,
    MAX_TENSORS,
    OPERATOR_SET_VERSION,
    QUANTIZATION_SCHEMA_VERSION,
    SPAN_ALIGNMENT,
    Compression,
    Encoding,
    HashAlgorithm,
    SectionKind,
)
from .errors import CorruptPackageError
from .schema import (
    Header as fb_Header,
)
from .schema import (
    ModelIdentity as fb_Identity,
)
from .schema import (
    OperatorRequirement as fb_Op,
)
from .schema import (
    Provenance as fb_Provenance,
)
from .schema import (
    Section as fb_Section,
)
from .schema import (
    Span as fb_Span,
)
from .schema import (
    TensorInfo as fb_Tensor,
)

__all__ = [
    "Header",
    "ModelIdentity",
    "Provenance",
    "SectionEntry",
    "Span",
    "TensorEntry",
    "decode_header",
    "encode_header",
]


@dataclass(frozen=True)
class Span:
    offset: int = 0
    length: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.length


NO_SPAN = Span()


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    encoding: Encoding
    codes: Span = NO_SPAN
    scales: Span = NO_SPAN
    zeros: Span = NO_SPAN
    hash: bytes = b""
    group_size: int = 0
    factors: tuple[str, ...] = ()
    rank: int = 0

    @property
    def spans(self) -> tuple[Span, Span, Span]:
        return (self.codes, self.scales, self.zeros)

    @property
    def nbytes(self) -> int:
        return self.codes.length + self.scales.length + self.zeros.length


@dataclass(frozen=True)
class SectionEntry:
    kind: int  # a SectionKind, or an unknown value from a newer writer
    name: str
    data: Span
    hash: bytes
    media_type: str = "application/octet-stream"
    compression: Compression = Compression.NONE
    uncompressed_length: int = 0
    required: bool = False

    @property
    def kind_name(self) -> str:
        try:
            return SectionKind(self.kind).name.lower()
        except ValueError:
            return f"unknown({self.kind})"


@dataclass(frozen=True)
class ModelIdentity:
    name: str
    version: str
    architecture: str
    config: dict[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Provenance:
    tool: str = "edgepack"
    tool_version: str = ""
    source_name: str = ""
    source_sha256: str = ""
    recipe: dict[str, Any] | None = field(default=None, hash=False)
    created: str = ""


@dataclass(frozen=True)
class Header:
    identity: ModelIdentity
    min_runtime_version: str
    tensors: tuple[TensorEntry, ...] = ()
    sections: tuple[SectionEntry, ...] = ()
    required_operators: tuple[tuple[str, int], ...] = ()
    required_features: tuple[str, ...] = ()
    provenance: Provenance = field(default_factory=Provenance)
    format_version: int = FORMAT_MAJOR
    quantization_schema_version: int = QUANTIZATION_SCHEMA_VERSION
    operator_set_version: int = OPERATOR_SET_VERSION
    hash_algorithm: int = HashAlgorithm.SHA256
    data_alignment: int = SPAN_ALIGNMENT

    @cached_property
    def tensor_index(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}


# ---------------------------------------------------------------- encoding


def encode_header(header: Header) -> bytes:
    """Serialize ``header`` to flatbuffer bytes (identifier "EPK1")."""
    b = flatbuffers.Builder(4096)

    def s(text: str) -> int:
        return b.CreateString(text)

    def bytes_vec(data: bytes) -> int:
        return b.CreateByteVector(data)

    def offsets_vec(start_fn, items: list[int]) -> int:
        start_fn(b, len(items))
        for item in reversed(items):
            b.PrependUOffsetTRelative(item)
        return b.EndVector()

    tensor_offsets = [_encode_tensor(b, t, s, bytes_vec, offsets_vec) for t in header.tensors]
    section_offsets = [_encode_section(b, sec, s, bytes_vec) for sec in header.sections]
    op_offsets = []
    for name, version in header.required_operators:
        name_off = s(name)
        fb_Op.Start(b)
        fb_Op.AddName(b, name_off)
        fb_Op.AddVersion(b, version)
        op_offsets.append(fb_Op.End(b))
    feature_offsets = [s(f) for f in header.required_features]

    ident = header.identity
    id_name, id_version, id_arch = s(ident.name), s(ident.version), s(ident.architecture)
    id_config = s(json.dumps(ident.config, sort_keys=True))
    fb_Identity.Start(b)
    fb_Identity.AddName(b, id_name)
    fb_Identity.AddVersion(b, id_version)
    fb_Identity.AddArchitecture(b, id_arch)
    fb_Identity.AddConfigJson(b, id_config)
    identity_off = fb_Identity.End(b)

    prov = header.provenance
    p_fields = [s(prov.tool), s(prov.tool_version), s(prov.source_name), s(prov.source_sha256)]
    p_recipe = s(json.dumps(prov.recipe, sort_keys=True)) if prov.recipe is not None else 0
    p_created = s(prov.created) if prov.created else 0
    fb_Provenance.Start(b)
    fb_Provenance.AddTool(b, p_fields[0])
    fb_Provenance.AddToolVersion(b, p_fields[1])
    fb_Provenance.AddSourceName(b, p_fields[2])
    fb_Provenance.AddSourceSha256(b, p_fields[3])
    if p_recipe:
        fb_Provenance.AddRecipeJson(b, p_recipe)
    if p_created:
        fb_Provenance.AddCreated(b, p_created)
    provenance_off = fb_Provenance.End(b)

    min_rt = s(header.min_runtime_version)
    tensors_vec = offsets_vec(fb_Header.StartTensorsVector, tensor_offsets)
    sections_vec = offsets_vec(fb_Header.StartSectionsVector, section_offsets)
    ops_vec = offsets_vec(fb_Header.StartRequiredOperatorsVector, op_offsets)
    features_vec = offsets_vec(fb_Header.StartRequiredFeaturesVector, feature_offsets)

    fb_Header.Start(b)
    fb_Header.AddFormatVersion(b, header.format_version)
    fb_Header.AddMinRuntimeVersion(b, min_rt)
    fb_Header.AddQuantizationSchemaVersion(b, header.quantization_schema_version)
    fb_Header.AddOperatorSetVersion(b, header.operator_set_version)
    fb_Header.AddRequiredOperators(b, ops_vec)
    fb_Header.AddRequiredFeatures(b, features_vec)
    fb_Header.AddIdentity(b, identity_off)
    fb_Header.AddProvenance(b, provenance_off)
    fb_Header.AddHashAlgorithm(b, header.hash_algorithm)
    fb_Header.AddDataAlignment(b, header.data_alignment)
    fb_Header.AddTensors(b, tensors_vec)
    fb_Header.AddSections(b, sections_vec)
    root = fb_Header.End(b)
    b.Finish(root, file_identifier=b"EPK1")
    return bytes(b.Output())


def _encode_tensor(b, t: TensorEntry, s, bytes_vec, offsets_vec) -> int:
    name = s(t.name)
    fb_Tensor.StartShapeVector(b, len(t.shape))
    for dim in reversed(t.shape):
        b.PrependUint64(dim)
    shape = b.EndVector()
    digest = bytes_vec(t.hash)
    factors = offsets_vec(fb_Tensor.StartFactorsVector, [s(f) for f in t.factors]) if t.factors else 0
    fb_Tensor.Start(b)
    fb_Tensor.AddName(b, name)
    fb_Tensor.AddShape(b, shape)
    fb_Tensor.AddEncoding(b, int(t.encoding))
    fb_Tensor.AddGroupSize(b, t.group_size)
    fb_Tensor.AddCodes(b, fb_Span.CreateSpan(b, t.codes.offset, t.codes.length))
    fb_Tensor.AddScales(b, fb_Span.CreateSpan(b, t.scales.offset, t.scales.length))
    fb_Tensor.AddZeros(b, fb_Span.CreateSpan(b, t.zeros.offset, t.zeros.length))
    fb_Tensor.AddHash(b, digest)
    if factors:
        fb_Tensor.AddFactors(b, factors)
    fb_Tensor.AddRank(b, t.rank)
    return fb_Tensor.End(b)


def _encode_section(b, sec: SectionEntry, s, bytes_vec) -> int:
    name, media = s(sec.name), s(sec.media_type)
    digest = bytes_vec(sec.hash)
    fb_Section.Start(b)
    fb_Section.AddKind(b, sec.kind)
    fb_Section.AddName(b, name)
    fb_Section.AddMediaType(b, media)
    fb_Section.AddData(b, fb_Span.CreateSpan(b, sec.data.offset, sec.data.length))
    fb_Section.AddCompression(b, int(sec.compression))
    fb_Section.AddUncompressedLength(b, sec.uncompressed_length)
    fb_Section.AddHash(b, digest)
    fb_Section.AddRequired(b, sec.required)
    return fb_Section.End(b)


# ---------------------------------------------------------------- decoding

_U32 = struct.Struct("<I")
_SPAN = struct.Struct("<QQ")


class _Reader:
    """Bounds-checked access to fields of a generated table (strings, vectors, spans)."""

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.size = len(buf)

    def _field_pos(self, table, slot: int) -> int:
        off = table._tab.Offset(slot)
        return table._tab.Pos + off if off else 0

    def vector(self, table, slot: int, elem_size: int) -> tuple[int, int]:
        """Return (start, count) of a vector field, checked to lie in the buffer."""
        pos = self._field_pos(table, slot)
        if not pos:
            return 0, 0
        start = pos + _U32.unpack_from(self.buf, pos)[0]
        count = _U32.unpack_from(self.buf, start)[0]
        if start + 4 + count * elem_size > self.size:
            raise CorruptPackageError("header vector runs past the end of the header")
        return start + 4, count

    def string(self, table, slot: int, required: bool = False, what: str = "string") -> str:
        start, count = self.vector(table, slot, 1)
        if not start:
            if required:
                raise CorruptPackageError(f"header is missing the required field {what}")
            return ""
        return self.buf[start : start + count].decode("utf-8")

    def bytes_field(self, table, slot: int) -> bytes:
        start, count = self.vector(table, slot, 1)
        return self.buf[start : start + count] if start else b""

    def span(self, table, slot: int) -> Span:
        pos = self._field_pos(table, slot)
        if not pos:
            return NO_SPAN
        if pos + 16 > self.size:
            raise CorruptPackageError("header span runs past the end of the header")
        return Span(*_SPAN.unpack_from(self.buf, pos))

    def tables(self, table, slot: int, limit: int, what: str) -> list[int]:
        """Absolute positions of the tables in a vector-of-tables field."""
        start, count = self.vector(table, slot, 4)
        if count > limit:
            raise CorruptPackageError(f"header lists {count} {what}, more than the limit {limit}")
        positions = []
        for i in range(count):
            p = start + 4 * i
            positions.append(p + _U32.unpack_from(self.buf, p)[0])
        return positions


# vtable slots (4 + 2 * field index), fixed by the schema's field order
_H_MIN_RT, _H_OPS, _H_FEATURES, _H_IDENTITY, _H_PROVENANCE = 6, 12, 14, 16, 18
_H_TENSORS, _H_SECTIONS = 24, 26
_T_NAME, _T_SHAPE, _T_CODES, _T_SCALES, _T_ZEROS, _T_HASH, _T_FACTORS = 4, 6, 12, 14, 16, 18, 20
_S_NAME, _S_MEDIA, _S_DATA, _S_HASH = 6, 8, 10, 16
_I_NAME, _I_VERSION, _I_ARCH, _I_CONFIG = 4, 6, 8, 10
_P_TOOL, _P_TOOL_VERSION, _P_SOURCE, _P_SOURCE_SHA, _P_RECIPE, _P_CREATED = 4, 6, 8, 10, 12, 14
_O_NAME = 4

_DECODE_FAILURES = (
    IndexError,
    struct.error,
    UnicodeDecodeError,
    ValueError,
    TypeError,
    OverflowError,
    RecursionError,
)


def decode_header(buf: bytes) -> Header:
    """Parse flatbuffer bytes into a :class:`Header`; any malformation is typed."""
    if len(buf) < 8 or buf[4:8] != b"EPK1":
        raise CorruptPackageError("header does not carry the flatbuffer identifier EPK1")
    try:
        return _decode(buf)
    except CorruptPackageError:
        raise
    except _DECODE_FAILURES as exc:
        raise CorruptPackageError(f"header is malformed ({type(exc).__name__}: {exc})") from None


def _decode(buf: bytes) -> Header:
    r = _Reader(buf)
    h = fb_Header.Header.GetRootAs(buf, 0)

    ident_tab = h.Identity()
    if ident_tab is None:
        raise CorruptPackageError("header has no model identity")
    identity = ModelIdentity(
        name=r.string(ident_tab, _I_NAME, True, "identity.name"),
        version=r.string(ident_tab, _I_VERSION, True, "identity.version"),
        architecture=r.string(ident_tab, _I_ARCH, True, "identity.architecture"),
        config=_json_object(r.string(ident_tab, _I_CONFIG), "identity.config_json") or {},
    )
    prov_tab = h.Provenance()
    provenance = Provenance()
    if prov_tab is not None:
        provenance = Provenance(
            tool=r.string(prov_tab, _P_TOOL),
            tool_version=r.string(prov_tab, _P_TOOL_VERSION),
            source_name=r.string(prov_tab, _P_SOURCE),
            source_sha256=r.string(prov_tab, _P_SOURCE_SHA),
            recipe=_json_object(r.string(prov_tab, _P_RECIPE), "provenance.recipe_json"),
            created=r.string(prov_tab, _P_CREATED),
        )

    ops = []
    op = fb_Op.OperatorRequirement()
    for pos in r.tables(h, _H_OPS, 4096, "required operators"):
        op.Init(buf, pos)
        ops.append((r.string(op, _O_NAME, True, "operator name"), op.Version()))
    feat_start, feat_count = r.vector(h, _H_FEATURES, 4)
    if feat_count > 4096:
        raise CorruptPackageError(f"header lists {feat_count} required features")
    features = [_string_at(buf, feat_start + 4 * i) for i in range(feat_count)]

    tensors = []
    t = fb_Tensor.TensorInfo()
    for pos in r.tables(h, _H_TENSORS, MAX_TENSORS, "tensors"):
        t.Init(buf, pos)
        shape_start, ndim = r.vector(t, _T_SHAPE, 8)
        if ndim > 64:
            raise CorruptPackageError(f"a tensor declares {ndim} dimensions")
        shape = tuple(int(x) for x in np.frombuffer(buf, "<u8", ndim, shape_start)) if ndim else ()
        f_start, f_count = r.vector(t, _T_FACTORS, 4)
        if f_count > 2:
            raise CorruptPackageError(f"a tensor names {f_count} factors; low-rank has 2")
        factors = [_string_at(buf, f_start + 4 * i) for i in range(f_count)]
        tensors.append(
            TensorEntry(
                name=r.string(t, _T_NAME, True, "tensor name"),
                shape=shape,
                encoding=t.Encoding(),  # checked in validate.py
                codes=r.span(t, _T_CODES),
                scales=r.span(t, _T_SCALES),
                zeros=r.span(t, _T_ZEROS),
                hash=r.bytes_field(t, _T_HASH),
                group_size=t.GroupSize(),
                factors=tuple(factors),
                rank=t.Rank(),
            )
        )

    sections = []
    sec = fb_Section.Section()
    for pos in r.tables(h, _H_SECTIONS, MAX_SECTIONS, "sections"):
        sec.Init(buf, pos)
        sections.append(
            SectionEntry(
                kind=sec.Kind(),
                name=r.string(sec, _S_NAME),
                media_type=r.string(sec, _S_MEDIA),
                data=r.span(sec, _S_DATA),
                hash=r.bytes_field(sec, _S_HASH),
                compression=sec.Compression(),  # checked in validate.py
                uncompressed_length=sec.UncompressedLength(),
                required=bool(sec.Required()),
            )
        )

    return Header(
        identity=identity,
        min_runtime_version=r.string(h, _H_MIN_RT, True, "min_runtime_version"),
        tensors=tuple(tensors),
        sections=tuple(sections),
        required_operators=tuple(ops),
        required_features=tuple(features),
        provenance=provenance,
        format_version=h.FormatVersion(),
        quantization_schema_version=h.QuantizationSchemaVersion(),
        operator_set_version=h.OperatorSetVersion(),
        hash_algorithm=h.HashAlgorithm(),
        data_alignment=h.DataAlignment(),
    )


def _string_at(buf: bytes, slot_pos: int) -> str:
    """A string referenced by the uoffset stored at ``slot_pos`` (vector-of-strings item)."""
    start = slot_pos + _U32.unpack_from(buf, slot_pos)[0]
    n = _U32.unpack_from(buf, start)[0]
    if start + 4 + n > len(buf):
        raise CorruptPackageError("a header string runs past the end of the header")
    return buf[start + 4 : start + 4 + n].decode("utf-8")


def _json_object(text: str, what: str) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CorruptPackageError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise CorruptPackageError(f"{what} must be a JSON object")
    return value

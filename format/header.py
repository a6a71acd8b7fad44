"""The package header as plain Python values, and its flatbuffer encoding.

Encoding uses the generated builder functions in ``schema/``. Decoding untrusted bytes
lives in ``header_decode.py``; semantic checks against the file in ``validate.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import flatbuffers

from .constants import (
    FORMAT_MAJOR,
    OPERATOR_SET_VERSION,
    QUANTIZATION_SCHEMA_VERSION,
    SPAN_ALIGNMENT,
    Compression,
    Encoding,
    HashAlgorithm,
    SectionKind,
)
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
    "encode_header",
]


@dataclass(frozen=True, slots=True)
class Span:
    offset: int = 0
    length: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.length


NO_SPAN = Span()


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    name: str
    version: str
    architecture: str
    config: dict[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True, slots=True)
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
    factors = (
        offsets_vec(fb_Tensor.StartFactorsVector, [s(f) for f in t.factors]) if t.factors else 0
    )
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

"""Semantic checks of a decoded header against the file it came from (spec sections 3-5).

Runs at every open, costs O(header). After it passes, every span a view is made from
lies inside the data region, is aligned, does not overlap another, and has exactly
the length its shape and encoding imply, so numpy views can never read garbage.
"""

from __future__ import annotations

import math

from .constants import (
    DIGEST_SIZE,
    FORMAT_MAJOR,
    MAX_DIM,
    MAX_ELEMENTS,
    MAX_LOW_RANK_RATIO,
    MAX_NAME_BYTES,
    MAX_NDIM,
    PAGE_SIZE,
    QUANTIZATION_SCHEMA_VERSION,
    SECTION_LIMITS,
    SPAN_ALIGNMENT,
    Compression,
    Encoding,
    HashAlgorithm,
    SectionKind,
)
from .errors import (
    CorruptPackageError,
    IncompatiblePackageError,
    RequiredFeatureError,
    UnsupportedFeatureError,
)
from .header import Header, SectionEntry, Span, TensorEntry
from .layout import tensor_layout
from .preamble import Preamble

__all__ = ["KNOWN_FEATURES", "low_rank_excess", "section_excess", "validate_header"]

KNOWN_FEATURES: frozenset[str] = frozenset()
_KNOWN_KINDS = frozenset(int(k) for k in SectionKind)


def validate_header(header: Header, pre: Preamble) -> Header:
    """Check ``header`` against the preamble's data region; return it unchanged."""
    if header.format_version != FORMAT_MAJOR:
        raise CorruptPackageError(
            f"header format_version {header.format_version} disagrees with the preamble"
        )
    if header.hash_algorithm != HashAlgorithm.SHA256:
        raise UnsupportedFeatureError(f"unknown hash algorithm {header.hash_algorithm}")
    if header.quantization_schema_version != QUANTIZATION_SCHEMA_VERSION:
        raise IncompatiblePackageError(
            f"package uses quantization schema {header.quantization_schema_version}, this "
            f"reader knows {QUANTIZATION_SCHEMA_VERSION}; update the app, or fetch a package "
            "built for it"
        )
    alignment = header.data_alignment
    if not SPAN_ALIGNMENT <= alignment <= PAGE_SIZE or alignment & (alignment - 1):
        raise CorruptPackageError(f"data alignment {alignment} is not a power of 2 in 64..4096")
    unknown = [f for f in header.required_features if f not in KNOWN_FEATURES]
    if unknown:
        raise RequiredFeatureError(
            f"package requires features this reader does not know: {', '.join(unknown)}; "
            "update edgepack"
        )
    tensors = header.tensors
    for t in tensors:
        _check_tensor(t)
    by_name = {t.name: t for t in tensors}
    if len(by_name) != len(tensors):
        seen: set[str] = set()
        dup = next(t.name for t in tensors if t.name in seen or seen.add(t.name))
        raise CorruptPackageError(f"two tensors are named {dup!r}")
    for t in tensors:
        if t.encoding == Encoding.LOW_RANK:
            _check_factors(t, by_name)

    spans: list[tuple[Span, str]] = []
    for t in tensors:
        spans.extend((s, f"tensor {t.name!r}") for s in t.spans if s.length)
    seen_sections = set()
    for sec in header.sections:
        where = f"section {sec.kind_name}/{sec.name!r}"
        key = (sec.kind, sec.name)
        if key in seen_sections:
            raise CorruptPackageError(f"{where} appears twice")
        seen_sections.add(key)
        if sec.data.length:
            spans.append((sec.data, where))
        elif sec.data.offset:
            raise CorruptPackageError(f"{where}: empty span has an offset")
        if sec.kind not in _KNOWN_KINDS:
            if sec.required:
                raise UnsupportedFeatureError(
                    f"package has a required section of unknown kind {sec.kind}; update edgepack"
                )
            continue  # optional and unknown: ignored, only its span is checked
        _check_section(sec, where)
    _check_spans(spans, pre, alignment)
    return header


def _check_section(sec: SectionEntry, where: str) -> None:
    if not isinstance(sec.compression, Compression):
        raise UnsupportedFeatureError(f"{where}: unknown compression {int(sec.compression)}")
    if len(sec.hash) != DIGEST_SIZE:
        raise CorruptPackageError(f"{where}: no valid digest")
    excess = section_excess(sec.kind, sec.uncompressed_length)
    if excess:
        raise CorruptPackageError(f"{where}: {excess}")
    if sec.compression == Compression.NONE and sec.uncompressed_length != sec.data.length:
        raise CorruptPackageError(
            f"{where}: stored {sec.data.length} bytes but declares {sec.uncompressed_length}"
        )


def section_excess(kind: int, uncompressed_length: int) -> str | None:
    """Why a section of ``kind`` this large is refused, or None (reader and writer;
    unknown kinds are never decoded, so they have no limit)."""
    limit = SECTION_LIMITS.get(kind)
    if limit is not None and uncompressed_length > limit:
        name = SectionKind(kind).name.lower()
        return f"declares {uncompressed_length} bytes, a {name} section may have {limit}"
    return None


def low_rank_excess(shape: tuple[int, ...], rank: int) -> str | None:
    """Why ``shape`` at ``rank`` claims more expansion than the format allows, or None:
    a small file must not make ``dequantize`` allocate gigabytes (reader and writer)."""
    rows, cols = shape[0], math.prod(shape[1:])
    if rows * cols > MAX_LOW_RANK_RATIO * rank * (rows + cols):
        return (
            f"{rows}x{cols} from rank {rank} expands more than {MAX_LOW_RANK_RATIO}x "
            "its factors"
        )
    return None


def _check_tensor(t: TensorEntry) -> None:
    where = f"tensor {t.name!r}"
    if not t.name or len(t.name.encode()) > MAX_NAME_BYTES:
        raise CorruptPackageError(f"{where}: name is empty or longer than {MAX_NAME_BYTES} bytes")
    if not isinstance(t.encoding, Encoding):
        raise UnsupportedFeatureError(
            f"{where} uses encoding {int(t.encoding)}, unknown to this reader; update edgepack"
        )
    encoding = t.encoding
    if len(t.shape) > MAX_NDIM:
        raise CorruptPackageError(f"{where}: {len(t.shape)} dimensions (max {MAX_NDIM})")
    if any(d >= MAX_DIM for d in t.shape) or math.prod(t.shape) >= MAX_ELEMENTS:
        raise CorruptPackageError(f"{where}: absurd shape {t.shape}")
    try:
        layout = tensor_layout(encoding, t.shape, t.group_size)
    except ValueError as exc:
        raise CorruptPackageError(f"{where}: {exc}") from None
    for part_name, span, part in zip(
        ("codes", "scales", "zeros"),
        t.spans,
        (layout.codes, layout.scales, layout.zeros),
        strict=True,
    ):
        want = part.nbytes if part is not None else 0
        if span.length != want:
            raise CorruptPackageError(
                f"{where}: {part_name} span is {span.length} bytes, shape {t.shape} "
                f"and encoding {encoding.name} need {want}"
            )
        if not span.length and span.offset:
            raise CorruptPackageError(f"{where}: empty {part_name} span has an offset")
    if encoding == Encoding.LOW_RANK:
        if t.hash:
            raise CorruptPackageError(f"{where}: low-rank tensors carry no digest")
    elif len(t.hash) != DIGEST_SIZE:
        raise CorruptPackageError(f"{where}: digest is {len(t.hash)} bytes, not {DIGEST_SIZE}")
    if encoding != Encoding.LOW_RANK and (t.factors or t.rank):
        raise CorruptPackageError(f"{where}: factors given for a non-low-rank tensor")
    if not encoding.is_group and t.group_size:
        raise CorruptPackageError(f"{where}: group size given for {encoding.name}")


def _check_factors(t: TensorEntry, by_name: dict[str, TensorEntry]) -> None:
    where = f"low-rank tensor {t.name!r}"
    if len(t.factors) != 2 or t.rank < 1 or len(t.shape) < 2:
        raise CorruptPackageError(f"{where}: needs 2 factors, a rank and a 2-D+ shape")
    u, v = (by_name.get(n) for n in t.factors)
    if u is None or v is None:
        raise CorruptPackageError(f"{where}: factor tensors {t.factors} are missing")
    if Encoding.LOW_RANK in (u.encoding, v.encoding):
        raise CorruptPackageError(f"{where}: factors may not be low-rank themselves")
    excess = low_rank_excess(t.shape, t.rank)
    if excess:
        raise CorruptPackageError(f"{where}: {excess}")
    rows, cols = t.shape[0], math.prod(t.shape[1:])
    if u.shape != (rows, t.rank) or v.shape != (t.rank, cols):
        raise CorruptPackageError(
            f"{where}: factor shapes {u.shape} x {v.shape} do not make {t.shape} at rank {t.rank}"
        )


def _check_spans(spans: list[tuple[Span, str]], pre: Preamble, alignment: int) -> None:
    spans.sort(key=lambda item: item[0].offset)
    previous_end, previous_owner = pre.data_offset, "the start of the data region"
    for span, owner in spans:
        if span.offset % alignment:
            raise CorruptPackageError(
                f"{owner}: data at {span.offset} is not {alignment}-byte aligned"
            )
        if span.offset < previous_end:
            raise CorruptPackageError(f"{owner}: data overlaps {previous_owner}")
        if span.end > pre.data_end:
            raise CorruptPackageError(f"{owner}: data runs past the end of the data region")
        previous_end, previous_owner = span.end, owner

"""The encoding registry: every fact about a tensor encoding, in one record per encoding.

The numeric ids are the file format (spec/FORMAT.md section 5, ``spec/edgepack.fbs``)
and never change. Everything the rest of the code asks about an encoding - its label on
the command line (``int4-g32-asym-s8``), bits, symmetry, scale width, binary16 twin,
the operator a package requires to decode it (``decode.int4_group_sym``), how its parts
are stored and which native matmul kernel runs it - is read from :data:`REGISTRY`.
``native/src/encodings.h`` is generated from it (``python -m edgepack.native.gen_encodings``).
Adding an encoding is one record here plus its kernels; ``tests/test_format_encodings.py``
walks the registry and checks every record end to end.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "REGISTRY",
    "Encoding",
    "EncodingInfo",
    "Family",
    "by_kind",
    "by_label",
    "by_operator",
    "group_encoding",
    "info",
]


class Encoding(enum.IntEnum):
    """Tensor encoding ids as stored in a package; the facts are in :data:`REGISTRY`."""

    F32 = 0
    F16 = 1
    BF16 = 2
    INT8_CHANNEL = 10
    INT4_GROUP_SYM = 20
    INT4_GROUP_ASYM = 21
    INT3_GROUP_SYM = 22
    INT3_GROUP_ASYM = 23
    INT2_GROUP_SYM = 24
    INT2_GROUP_ASYM = 25
    INT4_GROUP_SYM_S8 = 26
    INT4_GROUP_ASYM_S8 = 27
    INT3_GROUP_SYM_S8 = 28
    INT3_GROUP_ASYM_S8 = 29
    INT2_GROUP_SYM_S8 = 30
    INT2_GROUP_ASYM_S8 = 31
    LOW_RANK = 40

    @property
    def info(self) -> EncodingInfo:
        return _BY_ID[self]

    @property
    def is_float(self) -> bool:
        return self.info.family is Family.FLOAT

    @property
    def is_group(self) -> bool:
        """Group-wise integer codes (int4, int3, int2), with float16 or 8-bit group scales."""
        return self.info.family is Family.GROUP

    @property
    def scale_bits(self) -> int:
        """Bits of one stored group scale (and min): 16 (binary16) or 8 (the ``*_S8``
        encodings: int8 per group times a float32 per row). 0 for other encodings."""
        return self.info.scale_bits

    @property
    def base(self) -> Encoding:
        """The binary16-scale encoding a ``*_S8`` one expands to (itself otherwise)."""
        return self.info.base

    @property
    def is_symmetric(self) -> bool:
        """Integer encodings without a stored min (``zeros``): int8 and the ``*_SYM`` groups."""
        return self.info.symmetric

    @property
    def bits(self) -> int:
        """Bits of one stored code (32/16 for floats, 0 for LOW_RANK: it stores no codes)."""
        return self.info.bits

    @classmethod
    def group(cls, bits: int, symmetric: bool, scale_bits: int = 16) -> Encoding:
        """The group encoding of ``bits`` (4, 3 or 2) bits, symmetric or not, with
        binary16 (``scale_bits=16``) or 8-bit (``scale_bits=8``) group scales."""
        return group_encoding(bits, symmetric, scale_bits)


class Family(enum.Enum):
    """How an encoding stores a tensor, which decides its codec and part layout."""

    FLOAT = "float"  # codes only: the values in a float format
    CHANNEL = "channel"  # int8 codes [R, C] and one float32 scale per row
    GROUP = "group"  # packed codes, a scale (and min) per group of g columns in a row
    LOW_RANK = "low_rank"  # no parts: two factor tensors named in the entry


@dataclass(frozen=True)
class EncodingInfo:
    """One encoding. ``stem`` + ``suffix`` is its kind (``int4-asym-s8``); a group label
    puts the group size between them (``int4-g32-asym-s8``)."""

    encoding: Encoding
    family: Family
    stem: str  # f32, int8, int4, low_rank
    bits: int  # of one stored code (0: no codes)
    code_dtype: str = ""  # numpy dtype of the stored codes ("<u2": bfloat16 as raw bits)
    symmetric: bool = False  # integer codes with no stored min
    scale_bits: int = 0  # group scales: 16 (binary16) or 8 (*_S8: int8 times a row float32)
    twin: Encoding | None = None  # *_S8: the binary16-scale encoding it expands to
    native: str = ""  # the native matmul kernel's name for it (WEnc in native/src/encodings.h)
    delta_target: bool = False  # spec/DELTA.md defines predictions of its parts from a base

    @property
    def id(self) -> int:
        return int(self.encoding)

    @property
    def name(self) -> str:
        return self.encoding.name

    @property
    def base(self) -> Encoding:
        return self.twin if self.twin is not None else self.encoding

    @property
    def is_float(self) -> bool:
        return self.family is Family.FLOAT

    @property
    def is_group(self) -> bool:
        return self.family is Family.GROUP

    @property
    def is_low_rank(self) -> bool:
        return self.family is Family.LOW_RANK

    @property
    def operator(self) -> str:
        """The ``decode.*`` operator a package using this encoding requires."""
        return f"decode.{self.name.lower()}"

    @property
    def suffix(self) -> str:
        if not self.is_group:
            return ""
        return ("" if self.symmetric else "-asym") + ("-s8" if self.scale_bits == 8 else "")

    @property
    def kind(self) -> str:
        """The label without a group size (recipes list kinds: ``int3-asym-s8``)."""
        return self.stem + self.suffix

    def label(self, group_size: int = 0) -> str:
        if self.is_group:
            return f"{self.stem}-g{group_size}{self.suffix}"
        return self.stem


def _float(encoding: Encoding, stem: str, bits: int, dtype: str, native: str) -> EncodingInfo:
    return EncodingInfo(encoding, Family.FLOAT, stem, bits, dtype, native=native)


def _group(encoding: Encoding, bits: int, symmetric: bool, native: str = "") -> EncodingInfo:
    return EncodingInfo(
        encoding,
        Family.GROUP,
        f"int{bits}",
        bits,
        "u1",
        symmetric,
        16,
        native=native,
        delta_target=bits == 4,
    )


def _s8(encoding: Encoding, twin: EncodingInfo) -> EncodingInfo:
    return EncodingInfo(
        encoding, Family.GROUP, twin.stem, twin.bits, "u1", twin.symmetric, 8, twin.encoding
    )


_E = Encoding
_INT4_SYM = _group(_E.INT4_GROUP_SYM, 4, True, "i4sym")
_INT4_ASYM = _group(_E.INT4_GROUP_ASYM, 4, False, "i4asym")
_INT3_SYM = _group(_E.INT3_GROUP_SYM, 3, True)
_INT3_ASYM = _group(_E.INT3_GROUP_ASYM, 3, False)
_INT2_SYM = _group(_E.INT2_GROUP_SYM, 2, True)
_INT2_ASYM = _group(_E.INT2_GROUP_ASYM, 2, False)

REGISTRY: tuple[EncodingInfo, ...] = (
    _float(_E.F32, "f32", 32, "<f4", "f32"),
    _float(_E.F16, "f16", 16, "<f2", "f16"),
    _float(_E.BF16, "bf16", 16, "<u2", "bf16"),
    EncodingInfo(
        _E.INT8_CHANNEL, Family.CHANNEL, "int8", 8, "i1", True, native="i8", delta_target=True
    ),
    _INT4_SYM,
    _INT4_ASYM,
    _INT3_SYM,
    _INT3_ASYM,
    _INT2_SYM,
    _INT2_ASYM,
    _s8(_E.INT4_GROUP_SYM_S8, _INT4_SYM),
    _s8(_E.INT4_GROUP_ASYM_S8, _INT4_ASYM),
    _s8(_E.INT3_GROUP_SYM_S8, _INT3_SYM),
    _s8(_E.INT3_GROUP_ASYM_S8, _INT3_ASYM),
    _s8(_E.INT2_GROUP_SYM_S8, _INT2_SYM),
    _s8(_E.INT2_GROUP_ASYM_S8, _INT2_ASYM),
    EncodingInfo(_E.LOW_RANK, Family.LOW_RANK, "low_rank", 0),
)

_BY_ID: dict[Encoding, EncodingInfo] = {r.encoding: r for r in REGISTRY}
_BY_KIND: dict[str, EncodingInfo] = {r.kind: r for r in REGISTRY}
_BY_OPERATOR: dict[str, EncodingInfo] = {r.operator: r for r in REGISTRY}
_GROUPS: dict[tuple[int, bool, int], Encoding] = {
    (r.bits, r.symmetric, r.scale_bits): r.encoding for r in REGISTRY if r.is_group
}
if len(_BY_ID) != len(Encoding) or len(_BY_KIND) != len(REGISTRY):  # pragma: no cover
    raise AssertionError("every Encoding needs exactly one registry record with its own kind")


def info(encoding: Encoding | int) -> EncodingInfo:
    """The record of ``encoding``; KeyError for an id no record has."""
    return _BY_ID[Encoding(encoding)]


def by_kind(kind: str) -> EncodingInfo | None:
    """The record whose kind (label without group size) is ``kind``, or None."""
    return _BY_KIND.get(kind)


def by_label(label: str) -> tuple[EncodingInfo, int] | None:
    """``(record, group size)`` of a canonical label (``int4-g32-asym``), or None."""
    found = _BY_KIND.get(label)
    if found is not None and not found.is_group:
        return found, 0
    stem, sep, rest = label.partition("-g")
    digits = rest.split("-", 1)[0]
    if not sep or not digits.isdigit():
        return None
    found = _BY_KIND.get(stem + rest[len(digits) :])
    if found is None or not found.is_group:
        return None
    return found, int(digits)


def by_operator(operator: str) -> EncodingInfo | None:
    """The record decoded by the ``decode.*`` operator ``operator``, or None."""
    return _BY_OPERATOR.get(operator)


def group_encoding(bits: int, symmetric: bool, scale_bits: int = 16) -> Encoding:
    """The group encoding of ``bits`` bits, symmetric or not, with binary16 or 8-bit scales."""
    try:
        return _GROUPS[(bits, symmetric, scale_bits)]
    except KeyError:
        raise ValueError(f"no group encoding has {bits} bits (4, 3 or 2)") from None

"""Format constants and reader limits, in one place (spec/FORMAT.md sections 2-4).

The enum values mirror `spec/edgepack.fbs`; `tests/test_schema.py` checks they agree
with the generated schema code so the two cannot drift.
"""

from __future__ import annotations

import enum

MAGIC = b"\x89EPK\r\n\x1a\n"
FORMAT_MAJOR = 1
FORMAT_MINOR = 0
PREAMBLE_SIZE = 128
QUANTIZATION_SCHEMA_VERSION = 1
OPERATOR_SET_VERSION = 1

DATA_REGION_ALIGNMENT = 4096  # data_offset is page aligned so mmap offsets work
SPAN_ALIGNMENT = 64  # every span: cache line / AVX-512 vector
PAGE_ALIGN_THRESHOLD = 64 * 1024  # spans this large start on a page of their own
PAGE_SIZE = 4096

SIGNATURE_CONTEXT = b"edgepack/v1/signature\x00"
DIGEST_SIZE = 32

# Reader limits (spec section 3): bound every allocation a hostile file could ask for.
MAX_HEADER_LENGTH = 64 * 1024 * 1024
MAX_SIGNATURE_BLOCK = 64 * 1024
MAX_TENSORS = 1_000_000
MAX_SECTIONS = 65_536
MAX_NDIM = 8
MAX_DIM = 1 << 40
MAX_ELEMENTS = 1 << 48
MAX_NAME_BYTES = 512
MAX_SECTION_UNCOMPRESSED = 1 << 30
MAX_LOW_RANK_RATIO = 4096  # dense elements / factor elements a low-rank tensor may claim
MIN_GROUP_SIZE = 8
MAX_GROUP_SIZE = 4096


class Encoding(enum.IntEnum):
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
    def is_float(self) -> bool:
        return self in (Encoding.F32, Encoding.F16, Encoding.BF16)

    @property
    def is_group(self) -> bool:
        """Group-wise integer codes (int4, int3, int2), with float16 or 8-bit group scales."""
        return self in _GROUP_BITS

    @property
    def scale_bits(self) -> int:
        """Bits of one stored group scale (and min): 16 (binary16) or 8 (the ``*_S8``
        encodings: int8 per group times a float32 per row). 0 for other encodings."""
        if self in _S8_BASE:
            return 8
        return 16 if self in _GROUP_BITS else 0

    @property
    def base(self) -> Encoding:
        """The binary16-scale encoding a ``*_S8`` one expands to (itself otherwise)."""
        return _S8_BASE.get(self, self)

    @property
    def is_symmetric(self) -> bool:
        """Integer encodings without a stored min (``zeros``): int8 and the ``*_SYM`` groups."""
        return self in (
            Encoding.INT8_CHANNEL,
            Encoding.INT4_GROUP_SYM,
            Encoding.INT3_GROUP_SYM,
            Encoding.INT2_GROUP_SYM,
            Encoding.INT4_GROUP_SYM_S8,
            Encoding.INT3_GROUP_SYM_S8,
            Encoding.INT2_GROUP_SYM_S8,
        )

    @property
    def bits(self) -> int:
        """Bits of one stored code (32/16 for floats, 0 for LOW_RANK: it stores no codes)."""
        if self in _GROUP_BITS:
            return _GROUP_BITS[self]
        return {
            Encoding.F32: 32,
            Encoding.F16: 16,
            Encoding.BF16: 16,
            Encoding.INT8_CHANNEL: 8,
        }.get(self, 0)

    @classmethod
    def group(cls, bits: int, symmetric: bool, scale_bits: int = 16) -> Encoding:
        """The group encoding of ``bits`` (4, 3 or 2) bits, symmetric or not, with
        binary16 (``scale_bits=16``) or 8-bit (``scale_bits=8``) group scales."""
        for enc, b in _GROUP_BITS.items():
            if b == bits and enc.is_symmetric == symmetric and enc.scale_bits == scale_bits:
                return enc
        raise ValueError(f"no group encoding has {bits} bits (4, 3 or 2)")


_GROUP_BITS = {
    Encoding.INT4_GROUP_SYM: 4,
    Encoding.INT4_GROUP_ASYM: 4,
    Encoding.INT3_GROUP_SYM: 3,
    Encoding.INT3_GROUP_ASYM: 3,
    Encoding.INT2_GROUP_SYM: 2,
    Encoding.INT2_GROUP_ASYM: 2,
}
_S8_BASE = {
    Encoding.INT4_GROUP_SYM_S8: Encoding.INT4_GROUP_SYM,
    Encoding.INT4_GROUP_ASYM_S8: Encoding.INT4_GROUP_ASYM,
    Encoding.INT3_GROUP_SYM_S8: Encoding.INT3_GROUP_SYM,
    Encoding.INT3_GROUP_ASYM_S8: Encoding.INT3_GROUP_ASYM,
    Encoding.INT2_GROUP_SYM_S8: Encoding.INT2_GROUP_SYM,
    Encoding.INT2_GROUP_ASYM_S8: Encoding.INT2_GROUP_ASYM,
}
_GROUP_BITS.update({s8: _GROUP_BITS[twin] for s8, twin in _S8_BASE.items()})


class SectionKind(enum.IntEnum):
    METADATA_JSON = 0
    TOKENIZER = 1
    CHAT_TEMPLATE = 2
    MODEL_CONFIG = 3
    PRECISION_PLAN = 4
    LORA_ADAPTER = 5
    PREFIX_KV_CACHE = 6
    PROVENANCE = 7
    CALIBRATION_REPORT = 8


class Compression(enum.IntEnum):
    NONE = 0
    ZSTD = 1


class HashAlgorithm(enum.IntEnum):
    SHA256 = 0


class SignatureAlgorithm(enum.IntEnum):
    ED25519 = 0

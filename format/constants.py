"""Format constants and reader limits, in one place (spec/FORMAT.md sections 2-4).

The enum values mirror `spec/edgepack.fbs`; `tests/test_schema.py` checks they agree
with the generated schema code so the two cannot drift. :class:`Encoding` and the facts
about each encoding live in :mod:`edgepack.format.encodings` (re-exported here).
"""

from __future__ import annotations

import enum

from .encodings import Encoding as Encoding  # re-exported: the ids are the format

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
# Header and tensor count: opening costs ~1.3 us and ~0.8 KiB per tensor entry, so the
# worst header is seconds and ~100 MiB (bench/limits.py); real packages are 300 (dense
# 8B) to 19,000 (Qwen3-30B-A3B MoE) tensors, headers under 4 MiB.
MAX_HEADER_LENGTH = 16 * 1024 * 1024
MAX_SIGNATURE_BLOCK = 64 * 1024
MAX_TENSORS = 131_072
MAX_SECTIONS = 65_536
MAX_NDIM = 8
MAX_DIM = 1 << 40
MAX_ELEMENTS = 1 << 48
MAX_NAME_BYTES = 512
MAX_SECTION_UNCOMPRESSED = 1 << 30  # the largest any kind allows (SECTION_LIMITS)
MAX_SECTION_WINDOW = 1 << 27  # zstd window a reader allocates at most, whatever a frame asks
MAX_LOW_RANK_RATIO = 4096  # dense elements / factor elements a low-rank tensor may claim
MIN_GROUP_SIZE = 8
MAX_GROUP_SIZE = 4096
# PREFIX_KV_CACHE payloads (format/prefix_cache.py): a descriptor of a few KiB, one array
# per KV part (the runtime's layouts have at most six), a prefix within any model's context.
MAX_PREFIX_DESCRIPTOR = 1 << 20
MAX_PREFIX_ARRAYS = 16
MAX_PREFIX_TOKENS = 1 << 20
# LoRA adapter payloads (spec section 6.2, format/adapter.py). Real adapters: rank 4-256,
# q/k/v/o/gate/up/down of up to ~100 layers (a few hundred targets), JSON tens of KiB.
MAX_ADAPTER_JSON = 16 * 1024 * 1024
MAX_ADAPTER_TARGETS = 65_536
MAX_ADAPTER_RANK = 4096


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


_MiB = 1 << 20

# Uncompressed size each known section kind may declare (spec section 6). Real models are
# far below: the largest tokenizer.json known (Gemma 3) is 33 MiB, chat templates and
# configs are tens of KiB. Kinds large by nature (KV caches, adapters) are hashed and
# decompressed in a stream by `verify`, never held whole.
SECTION_LIMITS: dict[SectionKind, int] = {
    SectionKind.METADATA_JSON: 16 * _MiB,
    SectionKind.TOKENIZER: 128 * _MiB,
    SectionKind.CHAT_TEMPLATE: 1 * _MiB,
    SectionKind.MODEL_CONFIG: 1 * _MiB,
    SectionKind.PRECISION_PLAN: 64 * _MiB,
    SectionKind.LORA_ADAPTER: MAX_SECTION_UNCOMPRESSED,
    SectionKind.PREFIX_KV_CACHE: MAX_SECTION_UNCOMPRESSED,
    SectionKind.PROVENANCE: 16 * _MiB,
    SectionKind.CALIBRATION_REPORT: 64 * _MiB,
}
# Kinds whose content must be a UTF-8 JSON object (readers refuse anything else).
JSON_OBJECT_SECTIONS = frozenset(
    {SectionKind.METADATA_JSON, SectionKind.TOKENIZER, SectionKind.MODEL_CONFIG}
)
TEXT_SECTIONS = frozenset({SectionKind.CHAT_TEMPLATE})  # UTF-8 text


class Compression(enum.IntEnum):
    NONE = 0
    ZSTD = 1


class HashAlgorithm(enum.IntEnum):
    SHA256 = 0


class SignatureAlgorithm(enum.IntEnum):
    ED25519 = 0


# The custom field of a release's TUF target info: the publisher (server) writes it, the
# device's update client reads it; both ask here.
TUF_CUSTOM_KEY = "edgepack"
# Operator an adapter-only package requires (the runtime applies LoRA sections online).
LORA_OPERATOR = "apply.lora"
# What a device's update check lists among its operators when its client installs
# ``adapter`` plans; the server plans none for a device without it.
ADAPTER_PLAN_OPERATOR = "update.adapter_plan"

"""The `.epkd` container (spec/DELTA.md sections 1-4): constants, values, encode, decode.

Decoding treats every byte as hostile: each read is bounds-checked, every count and size
is capped, and :func:`validate` proves the op table is safe to run (the target is tiled
exactly, every base range is inside the base file, streams are consumed exactly, a
predicted op only reads target bytes that earlier ops wrote) before anything is done.
Failures are :class:`~edgepack.format.delta.errors.CorruptDeltaError` and subclasses.
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from dataclasses import dataclass

from edgepack.format.constants import MAX_ELEMENTS, MAX_SIGNATURE_BLOCK, MAX_TENSORS
from edgepack.format.constants import MAX_HEADER_LENGTH as _PACKAGE_HEADER_LENGTH
from edgepack.format.encodings import REGISTRY, Encoding
from edgepack.format.layout import tensor_layout

from .errors import (
    CorruptDeltaError,
    IncompatibleDeltaError,
    TruncatedDeltaError,
    UnsupportedDeltaError,
)

__all__ = [
    "DELTA_MAGIC",
    "HEADER_DOMAIN",
    "PREDICT_FROM",
    "PREDICT_TO",
    "Codec",
    "Combine",
    "DeltaHeader",
    "DeltaPreamble",
    "Op",
    "OpKind",
    "Part",
    "Prediction",
    "RefKind",
    "Shuffle",
    "Stream",
    "decode_header",
    "encode_header",
    "header_digest",
    "part_length",
    "validate",
]

DELTA_MAGIC = b"\x89EPD\r\n\x1a\n"
HEADER_MAGIC = b"EPDH"
HEADER_DOMAIN = b"edgepack/v1/delta\x00"
FORMAT_MAJOR = 1
FORMAT_MINOR = 1  # 1.1: SPARSE / PLANES residuals, ADD_DIRECTED, RANS streams
PREAMBLE_SIZE = 128
MAX_PREAMBLE_SIZE = 4096
FIXED_SIZE = 196
MAX_HEADER_LENGTH = _PACKAGE_HEADER_LENGTH  # a delta header is smaller than the package's
MAX_STREAMS = 1 << 16
# each op is a Python object on the device, validated one by one: bound the header's cost.
# Real deltas hold ~2 ops per tensor (3 parts, the gaps between them, sections): 4 per
# tensor of the largest package is 524,288 (bench/limits.py measures the worst case).
MAX_OPS = 4 * MAX_TENSORS
MAX_FILE_SIZE = 1 << 48
MAX_STREAM_LENGTH = 1 << 40
MAX_DICT_LENGTH = 1 << 30
MAX_ZSTD_WINDOW = 1 << 27
MAX_RANK = 256
MAX_FACTOR_SIDE = 1 << 22  # rank * rows and rank * cols of one FACTORS op
MAX_LIVE_FACTOR_BYTES = 256 << 20  # FACTORS data a patcher holds at any one time
MAX_PREDICTED_COLS = 1 << 24  # one row of a prediction is held in float32
SHUFFLE_BLOCK = 1 << 20
SPARSE_BLOCK_HEADER = 8  # u32 count, u32 gap bytes
KNOWN_FEATURES = 0  # bit set of required_features this reader implements

_PRE = struct.Struct("<8sHHIQQQQQQ32s")  # 96 bytes; the rest of the 128 is reserved
_FIXED = struct.Struct("<4sIQ32s32sQ32s32s32sIII")
assert _PRE.size == 96 and _FIXED.size == FIXED_SIZE


class OpKind:
    ZERO = 0
    COPY = 1
    DATA = 2
    FACTORS = 3


class Codec:
    STORED = 0
    ZSTD = 1
    RANS = 2  # static order-0 rANS (rans.py)


class Shuffle:
    NONE = 0
    BYTES = 1  # byte planes per SHUFFLE_BLOCK
    SPARSE = 2  # positions (stream) and values (aux stream) of the non-zero bytes
    PLANES = 3  # byte planes; plane 0 from the stream, the others from the aux stream


class Combine:
    LITERAL = 0
    XOR = 1
    ADD = 2
    ADD_DIRECTED = 3  # ADD, residual negated where the predicted code was rounded up


class RefKind:
    NONE = 0
    BASE = 1
    PREDICTED = 2


class Part:
    CODES = 0
    SCALES = 1
    ZEROS = 2


_WIDTHS = (4, 8, 16, 32)
# encodings a PREDICTED reference may target, and the base encodings it may read
PREDICT_TO = frozenset(r.encoding for r in REGISTRY if r.delta_target)
PREDICT_FROM = PREDICT_TO | frozenset(r.encoding for r in REGISTRY if r.is_float)


# ------------------------------------------------------------------------ values


@dataclass(frozen=True, slots=True)
class Stream:
    codec: int
    blob_length: int
    decoded_length: int
    dict_offset: int = 0
    dict_length: int = 0


@dataclass(frozen=True, slots=True)
class Prediction:
    """A base tensor re-quantized into the target's encoding (spec section 4)."""

    base_encoding: int
    rows: int
    cols: int
    base_group_size: int
    base_codes_offset: int
    base_scales_offset: int
    base_zeros_offset: int
    target_encoding: int
    target_group_size: int
    part: int
    target_scales_offset: int = 0
    target_zeros_offset: int = 0
    factors: int = 0  # 0, or 1 + the index of a FACTORS op

    def fields(self) -> tuple[int, ...]:
        return (
            self.base_encoding,
            self.rows,
            self.cols,
            self.base_group_size,
            self.base_codes_offset,
            self.base_scales_offset,
            self.base_zeros_offset,
            self.target_encoding,
            self.target_group_size,
            self.part,
            self.target_scales_offset,
            self.target_zeros_offset,
            self.factors,
        )


@dataclass(frozen=True, slots=True)
class Op:
    kind: int
    target_offset: int
    length: int
    base_offset: int = 0  # COPY
    stream: int = 0  # DATA
    combine: int = Combine.LITERAL
    width: int = 8
    shuffle: int = 0
    ref_kind: int = RefKind.NONE
    ref_offset: int = 0  # RefKind.BASE
    prediction: Prediction | None = None  # RefKind.PREDICTED
    rows: int = 0  # FACTORS
    cols: int = 0
    rank: int = 0
    # DATA with Shuffle.SPARSE or PLANES: a second stream (sparse values, high planes)
    aux_stream: int = 0
    positions_length: int = 0  # SPARSE: bytes of block heads and gaps (from ``stream``)
    values_length: int = 0  # SPARSE: non-zero bytes (from ``aux_stream``)

    @property
    def elem_bytes(self) -> int:
        return max(self.width // 8, 1)

    @property
    def stream_bytes(self) -> int:
        """Bytes a DATA op takes from ``stream``."""
        if self.shuffle == Shuffle.SPARSE:
            return self.positions_length
        if self.shuffle == Shuffle.PLANES:
            return self.length // self.elem_bytes
        return self.length

    @property
    def aux_bytes(self) -> int:
        """Bytes a DATA op takes from ``aux_stream``."""
        if self.shuffle == Shuffle.SPARSE:
            return self.values_length
        if self.shuffle == Shuffle.PLANES:
            return self.length - self.length // self.elem_bytes
        return 0

    @property
    def target_end(self) -> int:
        return self.target_offset + self.length

    @property
    def factor_bytes(self) -> int:
        """Stream bytes a FACTORS op takes (spec section 4.1)."""
        return (self.rows + self.cols) * (self.rank + 2)


@dataclass(frozen=True)
class DeltaHeader:
    base_file_size: int
    base_header_digest: bytes
    base_file_sha256: bytes
    target_file_size: int
    target_header_digest: bytes
    target_file_sha256: bytes
    payload_sha256: bytes
    streams: tuple[Stream, ...] = ()
    ops: tuple[Op, ...] = ()
    required_features: int = 0

    @property
    def payload_length(self) -> int:
        return sum(s.blob_length for s in self.streams)

    def blob_offsets(self) -> list[int]:
        """Offset of each stream's blob, relative to the payload start."""
        offsets, pos = [], 0
        for s in self.streams:
            offsets.append(pos)
            pos += s.blob_length
        return offsets


@dataclass(frozen=True)
class DeltaPreamble:
    header_offset: int
    header_length: int
    payload_offset: int
    payload_length: int
    header_digest: bytes
    signature_offset: int = 0
    signature_length: int = 0
    format_major: int = FORMAT_MAJOR
    format_minor: int = FORMAT_MINOR
    preamble_size: int = PREAMBLE_SIZE

    @property
    def payload_end(self) -> int:
        return self.payload_offset + self.payload_length

    @property
    def file_size(self) -> int:
        return self.payload_end + self.signature_length

    def pack(self) -> bytes:
        raw = _PRE.pack(
            DELTA_MAGIC,
            self.format_major,
            self.format_minor,
            PREAMBLE_SIZE,
            self.header_offset,
            self.header_length,
            self.payload_offset,
            self.payload_length,
            self.signature_offset,
            self.signature_length,
            self.header_digest,
        )
        return raw + bytes(PREAMBLE_SIZE - len(raw))

    @classmethod
    def unpack(cls, raw: bytes, file_size: int) -> DeltaPreamble:
        """Parse the first bytes of a delta and check its layout against ``file_size``."""
        if len(raw) < PREAMBLE_SIZE:
            if raw and DELTA_MAGIC.startswith(bytes(raw[: len(DELTA_MAGIC)])):
                raise TruncatedDeltaError(f"delta is {file_size} bytes, shorter than its preamble")
            raise CorruptDeltaError("not an edgepack delta (file too short)")
        (magic, major, minor, psize, h_off, h_len, p_off, p_len, s_off, s_len, digest) = (
            _PRE.unpack_from(raw)
        )
        if magic != DELTA_MAGIC:
            raise CorruptDeltaError("not an edgepack delta (bad magic bytes)")
        if major != FORMAT_MAJOR:
            raise IncompatibleDeltaError(
                f"delta format version {major} is not readable by this edgepack (reads "
                f"version {FORMAT_MAJOR}); update the app, or download the full package"
            )
        pre = cls(h_off, h_len, p_off, p_len, digest, s_off, s_len, major, minor, psize)
        if not PREAMBLE_SIZE <= psize <= MAX_PREAMBLE_SIZE:
            raise CorruptDeltaError(f"delta preamble size {psize} is invalid")
        if h_off != psize:
            raise CorruptDeltaError("delta header does not follow the preamble")
        if not FIXED_SIZE <= h_len <= MAX_HEADER_LENGTH:
            raise CorruptDeltaError(f"delta header length {h_len} is out of range")
        if p_off != h_off + h_len:
            raise CorruptDeltaError("delta payload does not follow the header")
        if p_len > MAX_FILE_SIZE:
            raise CorruptDeltaError(f"delta payload length {p_len} is absurd")
        if s_len:
            if s_off != p_off + p_len:
                raise CorruptDeltaError("delta signature block is not right after the payload")
            if s_len > MAX_SIGNATURE_BLOCK:
                raise CorruptDeltaError(f"delta signature block of {s_len} bytes")
        elif s_off:
            raise CorruptDeltaError("delta signature offset set without a signature block")
        expected = p_off + p_len + s_len
        if file_size < expected:
            raise TruncatedDeltaError(
                f"delta is truncated: {file_size} bytes, its preamble promises {expected}"
            )
        if file_size > expected:
            raise CorruptDeltaError(f"delta has {file_size - expected} unexpected trailing bytes")
        return pre


def header_digest(header_bytes: bytes) -> bytes:
    return hashlib.sha256(HEADER_DOMAIN + header_bytes).digest()


def part_length(encoding: int, rows: int, cols: int, group_size: int, part: int) -> int:
    """Bytes of one part of a ``[rows, cols]`` tensor (0 if the encoding has none).

    Raises ValueError for impossible combinations."""
    layout = tensor_layout(Encoding(encoding), (rows, cols), group_size)
    p = (layout.codes, layout.scales, layout.zeros)[part]
    return p.nbytes if p is not None else 0


# ------------------------------------------------------------------------ encoding


def _varint(value: int, out: bytearray) -> None:
    if value < 0 or value >= 1 << 64:
        raise ValueError(f"varint out of range: {value}")
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


def _record(fields: tuple[int, ...] | list[int], out: bytearray) -> None:
    body = bytearray()
    for f in fields:
        _varint(int(f), body)
    _varint(len(body), out)
    out += body


def _op_fields(op: Op) -> list[int]:
    fields = [op.kind, op.target_offset, op.length]
    if op.kind == OpKind.COPY:
        fields.append(op.base_offset)
    elif op.kind == OpKind.FACTORS:
        fields += [op.stream, op.rows, op.cols, op.rank]
    elif op.kind == OpKind.DATA:
        fields += [op.stream, op.combine, op.width, op.shuffle, op.ref_kind]
        if op.ref_kind == RefKind.BASE:
            fields.append(op.ref_offset)
        elif op.ref_kind == RefKind.PREDICTED:
            if op.prediction is None:
                raise ValueError("predicted op without a prediction")
            fields += list(op.prediction.fields())
        if op.shuffle == Shuffle.SPARSE:
            fields += [op.aux_stream, op.positions_length, op.values_length]
        elif op.shuffle == Shuffle.PLANES:
            fields.append(op.aux_stream)
    return fields


def encode_header(h: DeltaHeader) -> bytes:
    """Serialize a header (the caller has made it valid; :func:`validate` checks)."""
    out = bytearray(
        _FIXED.pack(
            HEADER_MAGIC,
            FIXED_SIZE,
            h.base_file_size,
            h.base_header_digest,
            h.base_file_sha256,
            h.target_file_size,
            h.target_header_digest,
            h.target_file_sha256,
            h.payload_sha256,
            len(h.streams),
            len(h.ops),
            h.required_features,
        )
    )
    for s in h.streams:
        _record((s.codec, s.blob_length, s.decoded_length, s.dict_offset, s.dict_length), out)
    for op in h.ops:
        _record(_op_fields(op), out)
    return bytes(out)


# ------------------------------------------------------------------------ decoding


class _Reader:
    __slots__ = ("buf", "end", "pos")

    def __init__(self, buf: bytes, pos: int, end: int) -> None:
        self.buf, self.pos, self.end = buf, pos, end

    def varint(self) -> int:
        value = shift = 0
        buf, pos, end = self.buf, self.pos, self.end
        for _ in range(10):
            if pos >= end:
                raise CorruptDeltaError("delta header record ends inside a number")
            byte = buf[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                self.pos = pos
                if value >= 1 << 64:
                    raise CorruptDeltaError("delta header number exceeds 64 bits")
                return value
            shift += 7
        raise CorruptDeltaError("delta header number is longer than 10 bytes")

    def record(self) -> _Reader:
        length = self.varint()
        if length > self.end - self.pos:
            raise CorruptDeltaError("delta header record runs past the header")
        sub = _Reader(self.buf, self.pos, self.pos + length)
        self.pos += length
        return sub


def decode_header(raw: bytes) -> DeltaHeader:
    """Decode header bytes (structure only; :func:`validate` checks the meaning)."""
    if len(raw) < FIXED_SIZE:
        raise CorruptDeltaError("delta header is shorter than its fixed part")
    (
        magic,
        fixed_size,
        b_size,
        b_hd,
        b_sha,
        t_size,
        t_hd,
        t_sha,
        p_sha,
        n_streams,
        n_ops,
        feats,
    ) = _FIXED.unpack_from(raw)
    if magic != HEADER_MAGIC:
        raise CorruptDeltaError("delta header has a bad magic")
    if fixed_size < FIXED_SIZE or fixed_size > len(raw):
        raise CorruptDeltaError(f"delta header fixed size {fixed_size} is invalid")
    if feats & ~KNOWN_FEATURES:
        raise UnsupportedDeltaError(
            f"delta requires features unknown to this edgepack (bits {feats:#x}); update it"
        )
    if n_streams > MAX_STREAMS or n_ops > MAX_OPS:
        raise CorruptDeltaError(f"delta header claims {n_streams} streams and {n_ops} ops")
    # every record takes at least 2 bytes: refuse counts the header cannot hold
    if 2 * (n_streams + n_ops) > len(raw) - fixed_size:
        raise CorruptDeltaError("delta header is too short for its record counts")
    r = _Reader(raw, fixed_size, len(raw))
    streams = []
    for _ in range(n_streams):
        rec = r.record()
        streams.append(Stream(*(rec.varint() for _ in range(5))))
    ops = []
    for _ in range(n_ops):
        ops.append(_decode_op(r.record()))
    if r.pos != len(raw):
        raise CorruptDeltaError(f"delta header has {len(raw) - r.pos} bytes after its last record")
    return DeltaHeader(
        b_size, b_hd, b_sha, t_size, t_hd, t_sha, p_sha, tuple(streams), tuple(ops), feats
    )


def _decode_op(rec: _Reader) -> Op:
    kind, target_offset, length = rec.varint(), rec.varint(), rec.varint()
    if kind == OpKind.ZERO:
        return Op(kind, target_offset, length)
    if kind == OpKind.COPY:
        return Op(kind, target_offset, length, base_offset=rec.varint())
    if kind == OpKind.FACTORS:
        stream, rows, cols, rank = (rec.varint() for _ in range(4))
        return Op(kind, target_offset, length, stream=stream, rows=rows, cols=cols, rank=rank)
    if kind != OpKind.DATA:
        raise UnsupportedDeltaError(f"delta uses op kind {kind}, unknown to this edgepack")
    stream, combine, width, shuffle, ref_kind = (rec.varint() for _ in range(5))
    ref_offset, prediction = 0, None
    if ref_kind == RefKind.BASE:
        ref_offset = rec.varint()
    elif ref_kind == RefKind.PREDICTED:
        prediction = Prediction(*(rec.varint() for _ in range(13)))
    elif ref_kind != RefKind.NONE:
        raise UnsupportedDeltaError(f"delta uses reference kind {ref_kind}, unknown here")
    aux = (0, 0, 0)
    if shuffle == Shuffle.SPARSE:
        aux = (rec.varint(), rec.varint(), rec.varint())
    elif shuffle == Shuffle.PLANES:
        aux = (rec.varint(), 0, 0)
    return Op(
        kind,
        target_offset,
        length,
        stream=stream,
        combine=combine,
        width=width,
        shuffle=shuffle,
        ref_kind=ref_kind,
        ref_offset=ref_offset,
        prediction=prediction,
        aux_stream=aux[0],
        positions_length=aux[1],
        values_length=aux[2],
    )


# ------------------------------------------------------------------------ validation


def validate(h: DeltaHeader, payload_length: int | None = None) -> DeltaHeader:
    """Check everything the patcher relies on; return ``h`` unchanged."""
    if not 0 < h.target_file_size <= MAX_FILE_SIZE or h.base_file_size > MAX_FILE_SIZE:
        raise CorruptDeltaError("delta records an absurd base or target size")
    for name, digest in (
        ("base header", h.base_header_digest),
        ("base file", h.base_file_sha256),
        ("target header", h.target_header_digest),
        ("target file", h.target_file_sha256),
        ("payload", h.payload_sha256),
    ):
        if len(digest) != 32:
            raise CorruptDeltaError(f"delta {name} digest has the wrong size")
    for i, s in enumerate(h.streams):
        _check_stream(i, s, h.base_file_size)
    if payload_length is not None and h.payload_length != payload_length:
        raise CorruptDeltaError("delta stream blobs do not fill the payload exactly")

    consumed = [0] * len(h.streams)
    for i, op in enumerate(h.ops):
        _check_op(i, op, h, consumed)
    _check_factor_lifetimes(h)
    for i, (s, used) in enumerate(zip(h.streams, consumed, strict=True)):
        if used != s.decoded_length:
            raise CorruptDeltaError(
                f"delta stream {i} holds {s.decoded_length} bytes but its ops take {used}"
            )

    order = sorted(
        (i for i, op in enumerate(h.ops) if op.kind != OpKind.FACTORS),
        key=lambda i: h.ops[i].target_offset,
    )
    position = 0
    for i in order:
        op = h.ops[i]
        if op.target_offset != position:
            what = "overlap" if op.target_offset < position else "leave a gap"
            raise CorruptDeltaError(f"delta ops {what} at target offset {position}")
        position = op.target_end
    if position != h.target_file_size:
        raise CorruptDeltaError(
            f"delta ops write {position} bytes, the target has {h.target_file_size}"
        )
    starts = [h.ops[i].target_offset for i in order]
    for i, op in enumerate(h.ops):
        p = op.prediction
        if p is None or p.part != Part.CODES:
            continue
        for part, offset in (
            (Part.SCALES, p.target_scales_offset),
            (Part.ZEROS, p.target_zeros_offset),
        ):
            n = part_length(p.target_encoding, p.rows, p.cols, p.target_group_size, part)
            if n:
                _check_written_before(i, offset, n, h, order, starts)
    return h


def _check_factor_lifetimes(h: DeltaHeader) -> None:
    """FACTORS data is held from its op to its last use: bound what is held at once."""
    last_use: dict[int, int] = {}
    for i, op in enumerate(h.ops):
        if op.prediction is not None and op.prediction.factors:
            last_use[op.prediction.factors - 1] = i
    live = 0
    for i, op in enumerate(h.ops):
        if op.kind == OpKind.FACTORS and i in last_use:
            live += op.factor_bytes
            if live > MAX_LIVE_FACTOR_BYTES:
                raise CorruptDeltaError(f"delta op {i}: too much FACTORS data held at once")
        if op.prediction is not None and op.prediction.factors:
            j = op.prediction.factors - 1
            if last_use.get(j) == i and h.ops[j].kind == OpKind.FACTORS:
                live -= h.ops[j].factor_bytes


def _check_stream(i: int, s: Stream, base_size: int) -> None:
    if s.decoded_length > MAX_STREAM_LENGTH or s.blob_length > MAX_FILE_SIZE:
        raise CorruptDeltaError(f"delta stream {i} is absurdly long")
    if s.codec == Codec.STORED:
        if s.blob_length != s.decoded_length or s.dict_length or s.dict_offset:
            raise CorruptDeltaError(f"delta stream {i}: stored blob length mismatch")
    elif s.codec == Codec.ZSTD:
        if s.dict_length > MAX_DICT_LENGTH:
            raise CorruptDeltaError(f"delta stream {i}: dictionary of {s.dict_length} bytes")
        if s.dict_length and s.dict_offset + s.dict_length > base_size:
            raise CorruptDeltaError(f"delta stream {i}: dictionary lies outside the base")
        if not s.dict_length and s.dict_offset:
            raise CorruptDeltaError(f"delta stream {i}: dictionary offset without a length")
    elif s.codec == Codec.RANS:
        if s.dict_length or s.dict_offset:
            raise CorruptDeltaError(f"delta stream {i}: a rANS stream has no dictionary")
        if s.decoded_length and s.blob_length < 6:
            raise CorruptDeltaError(f"delta stream {i}: rANS blob too short")
    else:
        raise UnsupportedDeltaError(f"delta stream {i} uses codec {s.codec}, unknown here")


def _check_op(i: int, op: Op, h: DeltaHeader, consumed: list[int]) -> None:
    where = f"delta op {i}"
    if op.kind == OpKind.FACTORS:
        if op.target_offset or op.length:
            raise CorruptDeltaError(f"{where}: a FACTORS op writes nothing")
        if op.stream >= len(h.streams):
            raise CorruptDeltaError(f"{where} names stream {op.stream} of {len(h.streams)}")
        if not 1 <= op.rank <= MAX_RANK or op.rows <= 0 or op.cols <= 0:
            raise CorruptDeltaError(f"{where}: factors of rank {op.rank}, {op.rows}x{op.cols}")
        if max(op.rows, op.cols) * op.rank > MAX_FACTOR_SIDE:
            raise CorruptDeltaError(f"{where}: factors are absurdly large")
        consumed[op.stream] += op.factor_bytes
        return
    if op.length == 0:
        raise CorruptDeltaError(f"{where} is empty")
    if op.target_end > h.target_file_size:
        raise CorruptDeltaError(f"{where} writes past the end of the target")
    if op.kind == OpKind.COPY:
        if op.base_offset + op.length > h.base_file_size:
            raise CorruptDeltaError(f"{where} copies from outside the base")
        return
    if op.kind != OpKind.DATA:
        return
    if op.stream >= len(h.streams):
        raise CorruptDeltaError(f"{where} names stream {op.stream} of {len(h.streams)}")
    consumed[op.stream] += op.stream_bytes
    if op.combine not in (Combine.LITERAL, Combine.XOR, Combine.ADD, Combine.ADD_DIRECTED):
        raise UnsupportedDeltaError(f"{where} uses combine mode {op.combine}, unknown here")
    if op.combine == Combine.ADD_DIRECTED and not (
        op.ref_kind == RefKind.PREDICTED
        and op.prediction is not None
        and op.prediction.part == Part.CODES
        and op.width == (8 if op.prediction.target_encoding == Encoding.INT8_CHANNEL else 4)
    ):
        raise CorruptDeltaError(f"{where}: a directed ADD needs predicted codes of its width")
    if op.width not in _WIDTHS:
        raise UnsupportedDeltaError(f"{where} uses element width {op.width}, unknown here")
    if op.shuffle not in (Shuffle.NONE, Shuffle.BYTES, Shuffle.SPARSE, Shuffle.PLANES):
        raise UnsupportedDeltaError(f"{where} uses shuffle mode {op.shuffle}, unknown here")
    elem = op.elem_bytes
    if op.shuffle == Shuffle.SPARSE:
        heads = SPARSE_BLOCK_HEADER * -(-op.length // SHUFFLE_BLOCK)
        if not (
            op.values_length <= op.length
            and op.values_length + heads <= op.positions_length <= 3 * op.values_length + heads
        ):
            raise CorruptDeltaError(f"{where}: sparse residual sizes are impossible")
    elif op.shuffle in (Shuffle.BYTES, Shuffle.PLANES) and op.width < 16:
        raise CorruptDeltaError(f"{where}: byte shuffle needs 16- or 32-bit elements")
    if op.shuffle in (Shuffle.SPARSE, Shuffle.PLANES):
        if op.aux_stream >= len(h.streams):
            raise CorruptDeltaError(f"{where} names stream {op.aux_stream} of {len(h.streams)}")
        consumed[op.aux_stream] += op.aux_bytes
    if (
        op.shuffle in (Shuffle.BYTES, Shuffle.PLANES)
        or op.combine in (Combine.ADD, Combine.ADD_DIRECTED)
    ) and (op.length % elem):
        raise CorruptDeltaError(f"{where}: length is not a whole number of elements")
    if (op.combine == Combine.LITERAL) != (op.ref_kind == RefKind.NONE):
        raise CorruptDeltaError(f"{where}: combine mode and reference disagree")
    if op.ref_kind == RefKind.BASE:
        if op.ref_offset + op.length > h.base_file_size:
            raise CorruptDeltaError(f"{where}: reference lies outside the base")
    elif op.ref_kind == RefKind.PREDICTED:
        _check_prediction(where, i, op, h)


def _check_prediction(where: str, index: int, op: Op, h: DeltaHeader) -> None:
    p = op.prediction
    assert p is not None
    try:
        base_enc, target_enc = Encoding(p.base_encoding), Encoding(p.target_encoding)
    except ValueError:
        raise UnsupportedDeltaError(f"{where}: prediction names an unknown encoding") from None
    if base_enc not in PREDICT_FROM or target_enc not in PREDICT_TO:
        raise UnsupportedDeltaError(
            f"{where}: cannot predict {target_enc.name} from {base_enc.name}"
        )
    if p.part not in (Part.CODES, Part.SCALES, Part.ZEROS):
        raise UnsupportedDeltaError(f"{where}: prediction of part {p.part}")
    if p.rows <= 0 or not 0 < p.cols <= MAX_PREDICTED_COLS or p.rows * p.cols >= MAX_ELEMENTS:
        raise CorruptDeltaError(f"{where}: prediction shape {p.rows}x{p.cols} is invalid")
    if (base_enc.is_group or p.base_group_size) and base_enc.is_group != bool(p.base_group_size):
        raise CorruptDeltaError(f"{where}: base group size does not fit its encoding")
    if target_enc.is_group != bool(p.target_group_size):
        raise CorruptDeltaError(f"{where}: target group size does not fit its encoding")
    try:
        base_parts = [part_length(base_enc, p.rows, p.cols, p.base_group_size, k) for k in range(3)]
        want = part_length(target_enc, p.rows, p.cols, p.target_group_size, p.part)
    except ValueError as exc:
        raise CorruptDeltaError(f"{where}: {exc}") from None
    if want != op.length:
        raise CorruptDeltaError(f"{where}: length {op.length} is not the predicted part's {want}")
    if p.factors:
        j = p.factors - 1
        f = h.ops[j] if j < index else None
        if f is None or f.kind != OpKind.FACTORS or (f.rows, f.cols) != (p.rows, p.cols):
            raise CorruptDeltaError(
                f"{where}: its factors are not an earlier FACTORS op of its shape"
            )
    offsets = (p.base_codes_offset, p.base_scales_offset, p.base_zeros_offset)
    for n, offset in zip(base_parts, offsets, strict=True):
        if n and offset + n > h.base_file_size:
            raise CorruptDeltaError(f"{where}: base tensor lies outside the base file")
    for part, offset in (
        (Part.SCALES, p.target_scales_offset),
        (Part.ZEROS, p.target_zeros_offset),
    ):
        n = part_length(target_enc, p.rows, p.cols, p.target_group_size, part)
        if p.part == Part.CODES and n and offset + n > h.target_file_size:
            raise CorruptDeltaError(f"{where}: target scales lie outside the target")


def _check_written_before(
    i: int, offset: int, length: int, h: DeltaHeader, order: list[int], starts: list[int]
) -> None:
    k = bisect.bisect_right(starts, offset) - 1
    end = offset + length
    while k < len(order) and k >= 0:
        j = order[k]
        op = h.ops[j]
        if op.target_offset >= end:
            break
        if j >= i:
            raise CorruptDeltaError(f"delta op {i} reads target bytes op {j} writes later")
        k += 1

"""LoRA adapter payloads: the bytes of a LORA_ADAPTER section (spec/FORMAT.md section 6.2).

An adapter is only correct on the weights it was trained for, so the payload names them
by :func:`~.weights_digest.weights_digest`; runtime and merge refuse it on other weights.
Each target is a tensor of the base (its canonical name) with the factors ``A [r, in]`` and
``B [out, r]`` in an encoding of the registry (int8 per channel by default, f16 or f32)
and its scale (``alpha / r``, or ``alpha / sqrt(r)`` for rsLoRA): ``W' = W + scale * B A``.

Layout (little-endian; the shape of safetensors: a length-prefixed JSON header, then
the parts with implicit offsets, so no two can overlap)::

    "EPKLORA\\0" | u32 version | u32 json_length | JSON | zero pad to 8 | parts

The parts are, for each target in order, A's then B's stored parts (codes, then scales
for int8), each padded with zeros to 8 bytes; they must fill the payload exactly.
Decoding checks every field, shape and length against the limits of
:mod:`.constants` before any view is made; any bad byte is a ``CorruptPackageError``.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import codecs
from .constants import (
    DIGEST_SIZE,
    MAX_ADAPTER_JSON,
    MAX_ADAPTER_RANK,
    MAX_ADAPTER_TARGETS,
    MAX_DIM,
    MAX_NAME_BYTES,
)
from .digests import sha256
from .encodings import Encoding, by_label
from .errors import (
    AdapterBaseError,
    AdapterTargetError,
    CorruptPackageError,
    EncodingError,
    UnsupportedFeatureError,
)
from .layout import tensor_layout

__all__ = [
    "ADAPTER_ENCODINGS",
    "ADAPTER_MAGIC",
    "ADAPTER_VERSION",
    "LoraAdapter",
    "LoraFactor",
    "LoraTarget",
    "adapter_digest",
    "check_binding",
    "decode_adapter",
    "encode_adapter",
    "short_digest",
]

ADAPTER_MAGIC = b"EPKLORA\x00"
ADAPTER_VERSION = 1
# Encodings a factor may use: rank-sized rows rule out the group encodings' group sizes.
ADAPTER_ENCODINGS = (Encoding.INT8_CHANNEL, Encoding.F16, Encoding.F32)
_PREFIX = struct.Struct("<8sII")
_ALIGN = 8


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class LoraFactor:
    """One factor (A or B) as stored: ``codes`` (and int8's per-row ``scales``)."""

    encoding: Encoding
    shape: tuple[int, int]
    codes: np.ndarray
    scales: np.ndarray | None = None

    @classmethod
    def encode(cls, values: np.ndarray, encoding: Encoding = Encoding.INT8_CHANNEL) -> LoraFactor:
        """``values [rows, cols]`` stored in ``encoding`` (one of :data:`ADAPTER_ENCODINGS`)."""
        encoding = Encoding(encoding)
        if encoding not in ADAPTER_ENCODINGS:
            labels = ", ".join(e.info.kind for e in ADAPTER_ENCODINGS)
            raise EncodingError(f"adapter factors are stored as {labels}, not {encoding.info.kind}")
        m = np.asarray(values, np.float32)
        if m.ndim != 2 or m.size == 0:
            raise EncodingError(f"an adapter factor is a non-empty matrix, got shape {m.shape}")
        if not np.isfinite(m).all():
            raise EncodingError("an adapter factor holds a non-finite value")
        shape = (int(m.shape[0]), int(m.shape[1]))
        if encoding == Encoding.INT8_CHANNEL:
            codes, scales = codecs.quantize_int8_channel(m)
            return cls(encoding, shape, codes, scales)
        with np.errstate(over="ignore"):
            codes = np.ascontiguousarray(m, encoding.info.code_dtype)
        if not np.isfinite(codes).all():
            raise EncodingError("an adapter factor overflows float16")
        return cls(encoding, shape, codes)

    @property
    def parts(self) -> tuple[np.ndarray, ...]:
        return (self.codes,) if self.scales is None else (self.codes, self.scales)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def values(self) -> np.ndarray:
        """float32 ``[rows, cols]`` (a copy)."""
        return np.ascontiguousarray(
            codecs.dequantize(self.encoding, self.codes, self.scales).reshape(self.shape),
            np.float32,
        )


@dataclass(frozen=True)
class LoraTarget:
    """``W' = W + scale * B @ A`` for the base tensor ``name`` (``[out, in]``)."""

    name: str
    a: LoraFactor  # [rank, in]
    b: LoraFactor  # [out, rank]
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        """The shape of the base tensor this target changes."""
        return self.b.shape[0], self.a.shape[1]

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def delta(self) -> np.ndarray:
        """``scale * B @ A`` as float32 ``[out, in]`` (what merging adds)."""
        return (np.float32(self.scale) * (self.b.values() @ self.a.values())).astype(np.float32)


@dataclass(frozen=True)
class LoraAdapter:
    """A decoded adapter: its name, the weights it is bound to and its targets."""

    name: str
    base_digest: bytes  # weights_digest of the base it was made for
    rank: int  # the adapter's configured rank (targets may differ: PEFT rank_pattern)
    alpha: float
    targets: tuple[LoraTarget, ...]
    source: str = ""  # where it was imported from ("peft", "gguf"): informative

    @property
    def target_names(self) -> list[str]:
        return [t.name for t in self.targets]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.targets)


def adapter_digest(payload: bytes | memoryview) -> bytes:
    """SHA-256 of an encoded payload: names one adapter (what a KV cache made with it
    is bound to, besides the base's weights digest)."""
    return sha256(payload).digest()


def short_digest(digest: bytes) -> str:
    """The first 12 hex digits: enough to tell two bases apart in a message."""
    return digest.hex()[:12]


def check_binding(
    adapter: LoraAdapter, base_digest: bytes, shapes: Mapping[str, Sequence[int]]
) -> None:
    """Refuse ``adapter`` on a base whose weights digest is ``base_digest`` and whose
    tensors have ``shapes`` unless it was made for exactly these weights and every target
    is a tensor of the base with the target's shape."""
    if adapter.base_digest != base_digest:
        raise AdapterBaseError(
            f"adapter {adapter.name!r} was made for weights {short_digest(adapter.base_digest)}, "
            f"not these ({short_digest(base_digest)}): use the base it was trained for"
        )
    missing = [t.name for t in adapter.targets if t.name not in shapes]
    if missing:
        some = ", ".join(missing[:4]) + (f" (+{len(missing) - 4} more)" if len(missing) > 4 else "")
        none = "no tensor" if len(missing) == len(adapter.targets) else "tensors not"
        raise AdapterTargetError(f"adapter {adapter.name!r} targets {none} in the base: {some}")
    for t in adapter.targets:
        if tuple(shapes[t.name]) != t.shape:
            raise AdapterTargetError(
                f"adapter {adapter.name!r}: {t.name} is {tuple(shapes[t.name])} in the base, "
                f"the adapter changes a {t.shape} matrix"
            )


# -- encoding ----------------------------------------------------------------------------
def encode_adapter(adapter: LoraAdapter) -> bytes:
    """The payload bytes of ``adapter`` (checked as :func:`decode_adapter` would)."""
    doc = {
        "name": adapter.name,
        "base_weights_digest": adapter.base_digest.hex(),
        "rank": adapter.rank,
        "alpha": adapter.alpha,
        "source": adapter.source,
        "targets": [
            {"name": t.name, "scale": t.scale, "a": _factor_doc(t.a), "b": _factor_doc(t.b)}
            for t in adapter.targets
        ],
    }
    text = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")
    head = _PREFIX.pack(ADAPTER_MAGIC, ADAPTER_VERSION, len(text)) + text
    out = bytearray(head + bytes(_padded(len(head)) - len(head)))
    for t in adapter.targets:
        for part in (*t.a.parts, *t.b.parts):
            raw = np.ascontiguousarray(part).tobytes()
            out += raw + bytes(_padded(len(raw)) - len(raw))
    data = bytes(out)
    decode_adapter(data)  # a writer never emits what its reader refuses
    return data


def _factor_doc(f: LoraFactor) -> dict[str, Any]:
    return {"encoding": f.encoding.info.kind, "shape": list(f.shape)}


# -- decoding ----------------------------------------------------------------------------
def decode_adapter(data: bytes | memoryview) -> LoraAdapter:
    """Parse and check a payload; the factors are views of ``data``."""
    buf = memoryview(data).cast("B")
    if len(buf) < _PREFIX.size:
        raise CorruptPackageError(f"adapter payload of {len(buf)} bytes is truncated")
    magic, version, json_length = _PREFIX.unpack_from(buf)
    if magic != ADAPTER_MAGIC:
        raise CorruptPackageError("adapter payload has a bad magic")
    if version != ADAPTER_VERSION:
        raise UnsupportedFeatureError(
            f"adapter payload version {version} is unknown (this reader: {ADAPTER_VERSION})"
        )
    if json_length > MAX_ADAPTER_JSON or _PREFIX.size + json_length > len(buf):
        raise CorruptPackageError(f"adapter header length {json_length} exceeds the payload")
    try:
        doc = json.loads(bytes(buf[_PREFIX.size : _PREFIX.size + json_length]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CorruptPackageError("adapter header is not UTF-8 JSON") from None
    if not isinstance(doc, dict):
        raise CorruptPackageError("adapter header is not a JSON object")
    digest = _field(doc, "base_weights_digest", str)
    try:
        base = bytes.fromhex(digest)
    except ValueError:
        base = b""
    if len(base) != DIGEST_SIZE:
        raise CorruptPackageError("adapter base_weights_digest is not 32 bytes of hex")
    rank = _int(doc, "rank", 1, MAX_ADAPTER_RANK)
    alpha = _number(doc, "alpha")
    targets_doc = _field(doc, "targets", list)
    if not 1 <= len(targets_doc) <= MAX_ADAPTER_TARGETS:
        raise CorruptPackageError(
            f"adapter has {len(targets_doc)} targets (1 to {MAX_ADAPTER_TARGETS})"
        )
    offset = _padded(_PREFIX.size + json_length)
    targets: list[LoraTarget] = []
    seen: set[str] = set()
    for i, td in enumerate(targets_doc):
        if not isinstance(td, dict):
            raise CorruptPackageError(f"adapter target {i} is not an object")
        name = _name(td, seen)
        a, offset = _factor(buf, offset, _field(td, "a", dict), f"{name}: A")
        b, offset = _factor(buf, offset, _field(td, "b", dict), f"{name}: B")
        if a.shape[0] != b.shape[1] or a.shape[0] > MAX_ADAPTER_RANK:
            raise CorruptPackageError(
                f"adapter target {name}: A {a.shape} and B {b.shape} do not form a rank "
                f"of at most {MAX_ADAPTER_RANK}"
            )
        targets.append(LoraTarget(name, a, b, _number(td, "scale")))
    if offset != len(buf):
        raise CorruptPackageError(
            f"adapter payload is {len(buf)} bytes, its header describes {offset}"
        )
    return LoraAdapter(
        name=_field(doc, "name", str),
        base_digest=base,
        rank=rank,
        alpha=alpha,
        targets=tuple(targets),
        source=_field(doc, "source", str),
    )


def _field(doc: dict, key: str, kind: type) -> Any:
    value = doc.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise CorruptPackageError(f"adapter field {key!r} is missing or not a {kind.__name__}")
    return value


def _int(doc: dict, key: str, lo: int, hi: int) -> int:
    value = _field(doc, key, int)
    if not lo <= value <= hi:
        raise CorruptPackageError(f"adapter field {key!r} = {value} is outside {lo}..{hi}")
    return value


def _number(doc: dict, key: str) -> float:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CorruptPackageError(f"adapter field {key!r} is missing or not a finite number")
    return float(value)


def _name(td: dict, seen: set[str]) -> str:
    name = _field(td, "name", str)
    if not name or len(name.encode("utf-8")) > MAX_NAME_BYTES:
        raise CorruptPackageError(f"adapter target name of {len(name)} characters")
    if name in seen:
        raise CorruptPackageError(f"adapter names target {name!r} twice")
    seen.add(name)
    return name


def _factor(buf: memoryview, offset: int, doc: dict, where: str) -> tuple[LoraFactor, int]:
    found = by_label(doc.get("encoding")) if isinstance(doc.get("encoding"), str) else None
    if found is None or found[0].encoding not in ADAPTER_ENCODINGS:
        raise CorruptPackageError(f"adapter {where}: encoding {doc.get('encoding')!r} refused")
    encoding = found[0].encoding
    shape = doc.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) != 2
        or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
        or not all(1 <= d <= MAX_DIM for d in shape)
    ):
        raise CorruptPackageError(f"adapter {where}: shape {shape!r} is not two positive sizes")
    rows, cols = shape
    layout = tensor_layout(encoding, (rows, cols))
    parts = []
    for part in (layout.codes, layout.scales):
        if part is None:
            continue
        if offset + part.nbytes > len(buf):  # Python ints: no overflow to hide this
            raise CorruptPackageError(f"adapter {where}: data runs past the payload end")
        view = np.frombuffer(buf, part.dtype, math.prod(part.shape), offset).reshape(part.shape)
        parts.append(view)
        offset += _padded(part.nbytes)
    factor = LoraFactor(encoding, (rows, cols), *parts)
    if not all(np.isfinite(p).all() for p in factor.parts if p.dtype.kind == "f"):
        raise CorruptPackageError(f"adapter {where}: a stored value is not finite")
    return factor, offset

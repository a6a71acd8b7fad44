"""The PREFIX_KV_CACHE payload: a prefix's token ids, its K/V pages and what they bind to.

K/V bytes are only right for the exact model, adapter, KV layout, tokenizer, template and
RoPE that made them, so each cache carries a :class:`KVBinding`; a reader compares it with
what it runs and ignores a cache that differs (``KVBinding.mismatch`` names the field).

Layout (spec/FORMAT.md section 6.1), all little-endian::

    magic "EPKVPRE\\0" (8) | u32 payload version | u32 descriptor length D
    descriptor: D bytes, one UTF-8 JSON object (binding, tokens, arrays)
    token ids: int32 [T] at the descriptor's "tokens_offset"
    arrays: each at its own offset, 64-aligned (page-aligned when 64 KiB or more)
    version 2, "paged" arrays: each layer's T slots on pages of their own (an array's
    "layer_stride" bytes apart, a multiple of the page size), so a runtime can map one
    layer's pages straight into its KV pool (runtime_shim/kv_cache.py)

Offsets are relative to the payload's start. A writer stores the section uncompressed,
so the payload starts on a span boundary and every array lands aligned in the data
region: :func:`decode_prefix_cache` over the mapped section returns numpy views, no copy.
Every offset, length, dtype and shape is checked before a view is made; any bad byte is
a :class:`~.errors.CorruptPackageError`.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from dataclasses import asdict, dataclass, fields

import numpy as np

from .constants import (
    DIGEST_SIZE,
    MAX_NAME_BYTES,
    MAX_NDIM,
    MAX_PREFIX_ARRAYS,
    MAX_PREFIX_DESCRIPTOR,
    MAX_PREFIX_TOKENS,
    PAGE_ALIGN_THRESHOLD,
    PAGE_SIZE,
    SPAN_ALIGNMENT,
)
from .errors import CorruptPackageError, UnsupportedFeatureError

__all__ = [
    "PREFIX_PAYLOAD_VERSION",
    "KVBinding",
    "PrefixCache",
    "decode_prefix_cache",
    "encode_prefix_cache",
]

_MAGIC = b"EPKVPRE\x00"
_FIXED = struct.Struct("<8sII")
PREFIX_PAYLOAD_VERSION = 2
_VERSIONS = (1, 2)  # 1: every array contiguous (no "layer_stride")
# dtypes a KV array may have (the runtime's layouts use no others)
_DTYPES = {"int8": "i1", "uint8": "u1", "float16": "<f2", "float32": "<f4"}


@dataclass(frozen=True)
class KVBinding:
    """Everything that decides a K/V cache's bytes. Digests are 32 bytes; ``adapter``,
    ``tokenizer`` and ``chat_template`` are empty when there is none."""

    weights: bytes
    adapter: bytes
    kv_layout: str
    kv_layout_version: int
    v_group: int
    tokenizer: bytes
    chat_template: bytes
    rope: bytes
    num_layers: int
    num_kv_heads: int
    head_dim: int
    activations: str

    def mismatch(self, expected: KVBinding) -> str | None:
        """The first field that differs from ``expected`` (None when they agree)."""
        for f in fields(self):
            if getattr(self, f.name) != getattr(expected, f.name):
                return f.name
        return None

    def to_json(self) -> dict:
        return {k: v.hex() if isinstance(v, bytes) else v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, doc: object) -> KVBinding:
        if not isinstance(doc, dict):
            raise CorruptPackageError("prefix cache: binding is not an object")
        values = {}
        for f in fields(cls):
            v = doc.get(f.name)
            if f.type == "bytes":
                values[f.name] = _digest(v, f.name)
            elif f.type == "int":
                values[f.name] = _count(v, f.name, 1 << 20)
            else:
                if not isinstance(v, str) or len(v.encode()) > MAX_NAME_BYTES:
                    raise CorruptPackageError(f"prefix cache: binding field {f.name} is bad")
                values[f.name] = v
        return cls(**values)


@dataclass(frozen=True)
class PrefixCache:
    """A prefix's token ids and its K/V: ``arrays[name]`` is ``[num_layers, T, ...]`` in
    the runtime's layout (``kv_layout`` of the binding); ``text`` is for people."""

    binding: KVBinding
    tokens: np.ndarray
    arrays: dict[str, np.ndarray]
    text: str = ""

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def _align_for(nbytes: int) -> int:
    return PAGE_SIZE if nbytes >= PAGE_ALIGN_THRESHOLD else SPAN_ALIGNMENT


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def _layer_stride(a: np.ndarray, paged: bool) -> int:
    """Bytes from one layer's slots to the next: whole pages when ``paged``."""
    run = a.nbytes // a.shape[0]
    return _align(run, PAGE_SIZE) if paged else run


def encode_prefix_cache(cache: PrefixCache, *, paged: bool = False) -> bytes:
    """The payload bytes (store them uncompressed: the arrays stay mappable).
    ``paged``: each layer's slots start on a page (version 2), so a runtime can map them
    in place; else version 1, every array contiguous (saved sessions)."""
    tokens = np.ascontiguousarray(cache.tokens, "<i4")
    parts = [("tokens", tokens)] + [
        (name, np.ascontiguousarray(a)) for name, a in sorted(cache.arrays.items())
    ]
    for name, a in parts[1:]:
        if a.ndim < 2 or a.shape[0] != cache.binding.num_layers or a.shape[1] != tokens.size:
            raise ValueError(f"prefix cache array {name!r} is not [layers, tokens, ...]")
        if str(a.dtype) not in _DTYPES:
            raise ValueError(f"prefix cache array {name!r} has dtype {a.dtype}")
    descriptor: dict = {}
    # the descriptor's length moves the arrays; lay out until it stops changing
    for _ in range(8):
        offsets, pos = [], _FIXED.size + len(_descriptor_bytes(descriptor))
        for i, (_name, a) in enumerate(parts):
            stored = a.nbytes if i == 0 else _layer_stride(a, paged) * a.shape[0]
            pos = _align(pos, PAGE_SIZE if paged and i else _align_for(stored))
            offsets.append(pos)
            pos += stored
        new = {
            "binding": cache.binding.to_json(),
            "text": cache.text,
            "num_tokens": int(tokens.size),
            "tokens_offset": offsets[0],
            "arrays": [
                {"name": n, "dtype": str(a.dtype), "shape": list(a.shape), "offset": off}
                | ({"layer_stride": _layer_stride(a, True)} if paged else {})
                for (n, a), off in zip(parts[1:], offsets[1:], strict=True)
            ],
        }
        if new == descriptor:
            break
        descriptor = new
    head = _descriptor_bytes(descriptor)
    out = bytearray(pos)
    out[: _FIXED.size] = _FIXED.pack(_MAGIC, PREFIX_PAYLOAD_VERSION if paged else 1, len(head))
    out[_FIXED.size : _FIXED.size + len(head)] = head
    out[offsets[0] : offsets[0] + tokens.nbytes] = tokens.tobytes()
    for (_name, a), off in zip(parts[1:], offsets[1:], strict=True):
        stride = _layer_stride(a, paged)
        for layer, chunk in enumerate(a):
            out[off + layer * stride : off + layer * stride + chunk.nbytes] = chunk.tobytes()
    return bytes(out)


def _descriptor_bytes(descriptor: dict) -> bytes:
    return json.dumps(descriptor, sort_keys=True, separators=(",", ":")).encode()


def decode_prefix_cache(buf: bytes | memoryview) -> PrefixCache:
    """Check and decode a payload; the arrays are views of ``buf`` (no copy)."""
    view = memoryview(buf).cast("B")
    if len(view) < _FIXED.size:
        raise CorruptPackageError("prefix cache: payload shorter than its fixed header")
    magic, version, dlen = _FIXED.unpack_from(view)
    if magic != _MAGIC:
        raise CorruptPackageError("prefix cache: bad magic")
    if version not in _VERSIONS:
        raise UnsupportedFeatureError(f"prefix cache: payload version {version} is unknown")
    if dlen > MAX_PREFIX_DESCRIPTOR or _FIXED.size + dlen > len(view):
        raise CorruptPackageError(f"prefix cache: descriptor length {dlen} out of bounds")
    try:
        doc = json.loads(bytes(view[_FIXED.size : _FIXED.size + dlen]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptPackageError(f"prefix cache: descriptor is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise CorruptPackageError("prefix cache: descriptor is not an object")
    binding = KVBinding.from_json(doc.get("binding"))
    text = doc.get("text", "")
    if not isinstance(text, str):
        raise CorruptPackageError("prefix cache: text is not a string")
    n = _count(doc.get("num_tokens"), "num_tokens", MAX_PREFIX_TOKENS)
    if n < 1:
        raise CorruptPackageError("prefix cache: holds no token")
    used = [(0, _FIXED.size + dlen)]
    tokens = _view(view, doc.get("tokens_offset"), "<i4", (n,), "tokens", used)
    specs = doc.get("arrays")
    if not isinstance(specs, list) or not 1 <= len(specs) <= MAX_PREFIX_ARRAYS:
        raise CorruptPackageError("prefix cache: bad array list")
    arrays: dict[str, np.ndarray] = {}
    for spec in specs:
        if not isinstance(spec, dict):
            raise CorruptPackageError("prefix cache: array entry is not an object")
        name, dtype, shape = spec.get("name"), spec.get("dtype"), spec.get("shape")
        if not isinstance(name, str) or not name or len(name) > 64 or name in arrays:
            raise CorruptPackageError(f"prefix cache: bad or repeated array name {name!r}")
        if dtype not in _DTYPES:
            raise CorruptPackageError(f"prefix cache: array {name!r} has dtype {dtype!r}")
        if not isinstance(shape, list) or not 2 <= len(shape) <= MAX_NDIM:
            raise CorruptPackageError(f"prefix cache: array {name!r} has a bad shape")
        dims = tuple(_count(d, f"{name} shape", MAX_PREFIX_TOKENS) for d in shape)
        if dims[0] != binding.num_layers or dims[1] != n:
            raise CorruptPackageError(f"prefix cache: array {name!r} is not [layers, tokens, ...]")
        stride = spec.get("layer_stride") if version >= 2 else None
        if version >= 2 and stride is None:  # else read as contiguous: the wrong bytes
            raise CorruptPackageError(f"prefix cache: paged array {name!r} has no layer_stride")
        arrays[name] = _view(view, spec.get("offset"), _DTYPES[dtype], dims, name, used, stride)
    used.sort()
    for (_s0, e0), (s1, _e1) in itertools.pairwise(used):
        if s1 < e0:
            raise CorruptPackageError("prefix cache: arrays overlap")
    return PrefixCache(binding, tokens, arrays, text)


def _view(
    view: memoryview,
    offset: object,
    dtype: str,
    shape: tuple[int, ...],
    what: str,
    used: list,
    layer_stride: object = None,
) -> np.ndarray:
    """A view of ``shape`` at ``offset``; with ``layer_stride`` (version 2) each index of
    the first axis is that many bytes after the previous one, on its own pages."""
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise CorruptPackageError(f"prefix cache: {what} has a bad offset")
    if layer_stride is None:
        if offset % SPAN_ALIGNMENT or offset + nbytes > len(view):
            raise CorruptPackageError(f"prefix cache: {what} is out of bounds or unaligned")
        used.append((offset, offset + nbytes))
        return np.frombuffer(view, dt, math.prod(shape), offset).reshape(shape)
    if not shape[0]:
        raise CorruptPackageError(f"prefix cache: {what} holds no layer")
    run = nbytes // shape[0]
    if (
        not isinstance(layer_stride, int)
        or isinstance(layer_stride, bool)
        or layer_stride < run
        or layer_stride % PAGE_SIZE
    ):
        raise CorruptPackageError(f"prefix cache: {what} has a bad layer_stride")
    end = offset + layer_stride * (shape[0] - 1) + run
    if offset % PAGE_SIZE or end > len(view):
        raise CorruptPackageError(f"prefix cache: {what} is out of bounds or unaligned")
    starts = [offset + i * layer_stride for i in range(shape[0])]
    used.extend((start, start + run) for start in starts)
    inner = np.frombuffer(view, np.uint8, end - offset, offset)
    inner_strides = [dt.itemsize * math.prod(shape[i + 1 :]) for i in range(1, len(shape))]
    return np.ndarray(shape, dt, inner, 0, (layer_stride, *inner_strides))


def _count(v: object, what: str, limit: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= limit:
        raise CorruptPackageError(f"prefix cache: {what} is not a count up to {limit}")
    return v


def _digest(v: object, what: str) -> bytes:
    try:
        raw = bytes.fromhex(v) if isinstance(v, str) else None
    except ValueError:
        raw = None
    if raw is None or len(raw) not in (0, DIGEST_SIZE):
        raise CorruptPackageError(f"prefix cache: binding field {what} is not a digest")
    return raw

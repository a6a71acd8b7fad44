"""Small, realistic, deterministic packages for tests (and a way to forge variants).

API (kept small on purpose):

* :func:`make_key` - a deterministic Ed25519 key from an integer seed.
* :func:`build_package` - write a tiny llama-shaped package and return a
  :class:`BuiltPackage` describing what went in: every encoding (F32, F16, BF16,
  INT8_CHANNEL, INT4_GROUP_SYM, INT4_GROUP_ASYM, LOW_RANK with its two factors, a 3-D
  quantized tensor), sections of several kinds (one zstd-compressed), signed.
  The same arguments always give byte-identical files.
* :func:`replace_header` - re-encode a (mutated) :class:`Header` into an existing
  package's bytes with a *correct* header digest, keeping the data region, and either
  dropping the signature, keeping the old one or re-signing. This is how tests reach
  the semantic validator behind the digest check.
* :func:`file_parts` - the preamble, header bytes, data region and signature block.

Everything is deterministic (fixed seeds, no timestamps), so tests can pin bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from edgepack.format import (
    Encoding,
    Header,
    ModelIdentity,
    PackageWriter,
    Provenance,
    SectionKind,
    Span,
)
from edgepack.format.constants import DATA_REGION_ALIGNMENT, PREAMBLE_SIZE
from edgepack.format.header import encode_header
from edgepack.format.preamble import Preamble
from edgepack.format.signing import build_signature_block

__all__ = [
    "DEFAULT_OPERATORS",
    "KEEP_SIGNATURE",
    "BuiltPackage",
    "FileParts",
    "build_package",
    "file_parts",
    "make_key",
    "replace_header",
]

DEFAULT_OPERATORS: tuple[tuple[str, int], ...] = (
    ("llama.decoder", 1),
    ("matmul.int4_group_sym", 1),
    ("matmul.int4_group_asym", 1),
    ("matmul.int8_channel", 1),
    ("matmul.low_rank", 1),
)
_GROUP = 32


def make_key(seed: int = 0) -> Ed25519PrivateKey:
    """A deterministic Ed25519 private key (tests only: the seed is public)."""
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"pkgfactory-%d" % seed).digest())


@dataclass(frozen=True)
class BuiltPackage:
    """What :func:`build_package` wrote.

    ``stored`` maps tensor name -> the exact arrays written (``(codes,)`` for float
    encodings, ``(codes, scales)`` or ``(codes, scales, zeros)`` for integer ones; codes of
    quantized tensors in their [R, C] matrix form). ``dequantized`` maps every tensor
    name (LOW_RANK included) to the float32 values a reader must reconstruct.
    ``sections`` maps ``(kind, name)`` -> uncompressed content.
    """

    path: Path
    key: Ed25519PrivateKey | None
    stored: dict[str, tuple[np.ndarray, ...]]
    dequantized: dict[str, np.ndarray]
    sections: dict[tuple[int, str], bytes]
    encodings: dict[str, Encoding] = field(default_factory=dict)

    @property
    def public_key(self) -> Ed25519PublicKey:
        if self.key is None:
            raise ValueError("package is unsigned")
        return self.key.public_key()

    def read_bytes(self) -> bytes:
        return self.path.read_bytes()


def build_package(
    path: str | Path,
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 64,
    vocab: int = 128,
    key: Ed25519PrivateKey | bool | None = True,
    min_runtime_version: str = "0.1.0",
    required_operators: Sequence[tuple[str, int]] = DEFAULT_OPERATORS,
    extra_sections: Iterable[tuple[int, str, bytes, bool]] = (),
) -> BuiltPackage:
    """Write a small llama-shaped package to ``path`` (about 60 KB with the defaults).

    ``key=True`` signs with ``make_key(0)``, ``None``/``False`` leaves it unsigned, or pass
    a key. ``extra_sections`` are ``(kind, name, data, required)`` tuples added last
    (unknown kinds must not be ``required``: the writer refuses to write those).
    """
    if key is True:
        key = make_key(0)
    elif key is False:
        key = None
    if hidden % (2 * _GROUP):
        raise ValueError(f"hidden must be a multiple of {2 * _GROUP}")
    from edgepack.format import codecs

    rng = np.random.default_rng(seed)
    path = Path(path)
    ffn, kv, rank = 2 * hidden, hidden // 2, 8
    config = {
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
    }
    identity = ModelIdentity("tiny-llama", "1.2.3", "llama", config)
    provenance = Provenance(
        tool="pkgfactory",
        tool_version="1",
        source_name="synthetic",
        source_sha256="0" * 64,
        recipe={"seed": seed, "group_size": _GROUP, "plan": "mixed"},
    )
    stored: dict[str, tuple[np.ndarray, ...]] = {}
    deq: dict[str, np.ndarray] = {}
    encodings: dict[str, Encoding] = {}
    sections: dict[tuple[int, str], bytes] = {}

    def weights(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    with PackageWriter(
        path,
        identity,
        min_runtime_version=min_runtime_version,
        required_operators=required_operators,
        provenance=provenance,
    ) as w:

        def add_float(name: str, enc: Encoding, values: np.ndarray) -> None:
            if enc == Encoding.F32:
                codes = values
            elif enc == Encoding.F16:
                codes = values.astype(np.float16)
            else:  # BF16: truncate float32 to its upper half
                codes = (values.view(np.uint32) >> 16).astype(np.uint16)
            w.add_tensor(name, enc, codes)
            stored[name], encodings[name] = (codes,), enc
            deq[name] = _float_values(enc, codes)

        def add_quant(name: str, enc: Encoding, values: np.ndarray) -> None:
            if enc == Encoding.INT8_CHANNEL:
                parts = codecs.quantize_int8_channel(values)
                w.add_tensor(name, enc, *parts, shape=values.shape)
                out = codecs.dequantize_int8_channel(*parts)
            else:
                sym, bits = enc.is_symmetric, enc.bits
                c, s, z = codecs.quantize_group(values, bits, _GROUP, sym, enc.scale_bits)
                parts = (c, s) if sym else (c, s, z)
                w.add_tensor(name, enc, c, s, z, shape=values.shape, group_size=_GROUP)
                d, m = codecs.group_values(enc, s, z)
                out = codecs.dequantize_group(c, d, m, bits, _GROUP)
            stored[name], encodings[name] = tuple(parts), enc
            deq[name] = out.reshape(values.shape)

        add_float("token_embd.weight", Encoding.F16, weights(vocab, hidden))
        for i in range(layers):
            p = f"blk.{i}."
            add_float(p + "attn_norm.weight", Encoding.F32, 1 + weights(hidden))
            add_quant(p + "attn_q.weight", Encoding.INT4_GROUP_SYM, weights(hidden, hidden))
            add_quant(p + "attn_k.weight", Encoding.INT4_GROUP_ASYM, weights(kv, hidden))
            add_quant(p + "attn_v.weight", Encoding.INT8_CHANNEL, weights(kv, hidden))
            add_float(p + "attn_output.weight", Encoding.BF16, weights(hidden, hidden))
            add_float(p + "ffn_norm.weight", Encoding.F32, 1 + weights(hidden))
            add_float(p + "ffn_gate.lora_u", Encoding.F16, weights(ffn, rank))
            add_float(p + "ffn_gate.lora_v", Encoding.F32, weights(rank, hidden))
            w.add_low_rank(
                p + "ffn_gate.weight",
                (ffn, hidden),
                (p + "ffn_gate.lora_u", p + "ffn_gate.lora_v"),
                rank,
            )
            encodings[p + "ffn_gate.weight"] = Encoding.LOW_RANK
            deq[p + "ffn_gate.weight"] = deq[p + "ffn_gate.lora_u"] @ deq[p + "ffn_gate.lora_v"]
            add_quant(p + "ffn_up.weight", Encoding.INT8_CHANNEL, weights(ffn, hidden))
            # 3-D quantized tensor: viewed as [R, prod(rest)] by the encodings
            add_quant(p + "ffn_down.weight", Encoding.INT4_GROUP_ASYM, weights(hidden, 2, hidden))
        add_float("output_norm.weight", Encoding.F32, 1 + weights(hidden))
        # 8-bit group scales: a float32 multiplier and int8 values per row
        add_quant("output.weight", Encoding.INT3_GROUP_ASYM_S8, weights(vocab, hidden))

        vocab_json = json.dumps(
            {"model": {"type": "BPE", "vocab": {f"tok{i}": i for i in range(vocab)}}},
            sort_keys=True,
        ).encode()
        contents: list[tuple[int, str, bytes, str, bool | None, bool]] = [
            (SectionKind.TOKENIZER, "tokenizer.json", vocab_json, "application/json", True, False),
            (
                SectionKind.CHAT_TEMPLATE,
                "default",
                b"{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}",
                "text/x-jinja2",
                False,
                False,
            ),
            (
                SectionKind.METADATA_JSON,
                "",
                json.dumps({"license": "apache-2.0", "seed": seed}).encode(),
                "application/json",
                False,
                False,
            ),
            (
                SectionKind.PRECISION_PLAN,
                "plan",
                json.dumps({t: e.name for t, e in sorted(encodings.items())}).encode(),
                "application/json",
                False,
                True,
            ),
        ]
        contents += [
            (kind, name, data, "application/octet-stream", False, req)
            for kind, name, data, req in extra_sections
        ]
        for kind, name, data, media, compress, required in contents:
            w.add_section(
                kind, data, name=name, media_type=media, compress=compress, required=required
            )
            sections[(int(kind), name)] = data
        w.finish(signing_keys=[key] if key is not None else ())
    return BuiltPackage(path, key, stored, deq, sections, encodings)


def _float_values(enc: Encoding, codes: np.ndarray) -> np.ndarray:
    if enc == Encoding.BF16:
        return (codes.astype(np.uint32) << 16).view(np.float32)
    return codes.astype(np.float32)


# ------------------------------------------------------------------ forging variants


@dataclass(frozen=True)
class FileParts:
    """A package file cut along its preamble offsets (no validation beyond that)."""

    preamble: Preamble
    header: bytes
    data: bytes
    signature: bytes


def file_parts(raw: bytes) -> FileParts:
    """Cut ``raw`` along its preamble (which must pass the reader's layout checks)."""
    pre = Preamble.unpack(raw[:PREAMBLE_SIZE], len(raw))
    return FileParts(
        pre,
        raw[pre.header_offset : pre.header_offset + pre.header_length],
        raw[pre.data_offset : pre.data_end],
        raw[pre.data_end :],
    )


KEEP_SIGNATURE = object()
"""``replace_header(..., sign_with=KEEP_SIGNATURE)`` keeps the old signature block."""


def replace_header(
    raw: bytes,
    header: Header,
    *,
    sign_with: Ed25519PrivateKey | object | None = None,
) -> bytes:
    """Return ``raw`` with its header replaced by ``header``, the digest fixed.

    The data region is kept byte for byte. If the new header no longer fits before the
    data region, the data region moves to the next page boundary and every span of
    ``header`` that starts inside the old data region moves with it (deliberately
    out-of-range spans are left as they are).
    ``sign_with``: ``None`` drops the signature block, a key re-signs, and
    :data:`KEEP_SIGNATURE` keeps the old (now non-matching) block.
    """
    parts = file_parts(raw)
    encoded = encode_header(header)
    data_offset = max(
        parts.preamble.data_offset,
        math.ceil((PREAMBLE_SIZE + len(encoded)) / DATA_REGION_ALIGNMENT) * DATA_REGION_ALIGNMENT,
    )
    delta = data_offset - parts.preamble.data_offset
    if delta:
        header = _shift_spans(header, parts.preamble, delta)
        encoded = encode_header(header)
    digest = hashlib.sha256(encoded).digest()
    if sign_with is KEEP_SIGNATURE:
        signature = parts.signature
    elif sign_with is None:
        signature = b""
    else:
        signature = build_signature_block(digest, [sign_with])  # type: ignore[list-item]
    data_end = data_offset + len(parts.data)
    pre = Preamble(
        header_offset=PREAMBLE_SIZE,
        header_length=len(encoded),
        data_offset=data_offset,
        data_length=len(parts.data),
        header_digest=digest,
        signature_offset=data_end if signature else 0,
        signature_length=len(signature),
    )
    padding = bytes(data_offset - PREAMBLE_SIZE - len(encoded))
    return pre.pack() + encoded + padding + parts.data + signature


def _shift_spans(header: Header, pre: Preamble, delta: int) -> Header:
    def move(span: Span) -> Span:
        inside = span.length and pre.data_offset <= span.offset <= pre.data_end
        return Span(span.offset + delta, span.length) if inside else span

    tensors = tuple(
        replace(t, codes=move(t.codes), scales=move(t.scales), zeros=move(t.zeros))
        for t in header.tensors
    )
    sections = tuple(replace(s, data=move(s.data)) for s in header.sections)
    return replace(header, tensors=tensors, sections=sections)

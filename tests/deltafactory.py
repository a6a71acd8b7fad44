"""Random small package pairs for delta tests: a model spec, mutations, and a writer.

A :class:`ModelSpec` is plain data (tensors with their float weights and encodings,
sections, identity version); :func:`write_spec` writes it with PackageWriter, and
:func:`mutate` derives the NEW spec the way releases differ: tensors dropped, added,
renamed, moved, slightly changed and re-quantized, re-encoded from the same weights,
reshaped; sections changed, added or dropped; version bumped.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edgepack.format import Encoding, ModelIdentity, PackageWriter, Provenance, codecs

GROUP = 32
QUANTIZED = (Encoding.INT8_CHANNEL, Encoding.INT4_GROUP_SYM, Encoding.INT4_GROUP_ASYM)
FLOATS = (Encoding.F32, Encoding.F16, Encoding.BF16)


def make_key(seed: int) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"delta-%d" % seed).digest())


@dataclass
class TensorSpec:
    name: str
    encoding: Encoding
    weights: np.ndarray  # float32, the tensor's shape
    factors: tuple[str, str] | None = None  # LOW_RANK: [U, V] (weights unused)


@dataclass
class ModelSpec:
    tensors: list[TensorSpec]
    sections: list[tuple[int, str, bytes, bool]] = field(default_factory=list)
    version: str = "1.0.0"


def random_spec(rng: np.random.Generator, n_tensors: int = 6, low_rank: bool = True) -> ModelSpec:
    tensors = []
    for i in range(n_tensors):
        enc = Encoding(rng.choice([int(e) for e in FLOATS + QUANTIZED]))
        rows = int(rng.integers(1, 9)) * 4
        cols = int(rng.integers(1, 4)) * GROUP
        shape: tuple[int, ...] = (rows, cols)
        if enc in FLOATS and rng.random() < 0.3:
            shape = (rows * cols,)  # 1-D, like norms
        elif rng.random() < 0.2:
            shape = (rows, 2, cols // 2) if cols % 64 == 0 else shape
        w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        tensors.append(TensorSpec(f"t{i}.weight", enc, w))
    if low_rank:
        u = (rng.standard_normal((16, 4)) * 0.1).astype(np.float32)
        v = (rng.standard_normal((4, 32)) * 0.1).astype(np.float32)
        tensors += [
            TensorSpec("lr.u", Encoding.F16, u),
            TensorSpec("lr.v", Encoding.F32, v),
            TensorSpec(
                "lr.weight", Encoding.LOW_RANK, np.zeros((16, 32), np.float32), ("lr.u", "lr.v")
            ),
        ]
    sections = [
        (1, "tokenizer.json", rng.integers(97, 123, 3000, dtype=np.uint8).tobytes(), True),
        (2, "default", b"{% for m in messages %}{{ m.content }}{% endfor %}", False),
    ]
    return ModelSpec(tensors, sections)


def mutate(spec: ModelSpec, rng: np.random.Generator) -> ModelSpec:
    """A plausible next release of ``spec`` (every kind of change, chosen at random)."""
    protected = {n for t in spec.tensors if t.factors for n in t.factors}
    out: list[TensorSpec] = []
    for t in spec.tensors:
        r = rng.random()
        if t.factors or t.name in protected:
            out.append(t)
        elif r < 0.12:
            continue  # dropped
        elif r < 0.22:
            out.append(replace(t, name=t.name + ".renamed"))
        elif r < 0.45:  # fine-tuned: a small low-rank update, same encoding
            w = t.weights
            m = w.reshape(w.shape[0], -1)
            delta = np.outer(rng.standard_normal(m.shape[0]), rng.standard_normal(m.shape[1]))
            delta *= 0.01 * np.linalg.norm(m) / max(np.linalg.norm(delta), 1e-12)
            out.append(replace(t, weights=(m + delta.astype(np.float32)).reshape(w.shape)))
        elif r < 0.55 and t.weights.ndim >= 2:  # re-encoded from the same weights
            enc = Encoding(rng.choice([int(e) for e in QUANTIZED + FLOATS]))
            out.append(replace(t, encoding=enc, weights=dequantized(t)))
        elif r < 0.6:  # reshaped / new content under the same name
            w = (rng.standard_normal((8, GROUP)) * 0.05).astype(np.float32)
            out.append(replace(t, weights=w))
        else:
            out.append(t)
    if rng.random() < 0.5:
        out.append(
            TensorSpec(
                "new.weight",
                Encoding.INT4_GROUP_SYM,
                (rng.standard_normal((8, 64)) * 0.1).astype(np.float32),
            )
        )
    if rng.random() < 0.3:
        order = rng.permutation(len(out))
        out = [out[i] for i in order]
        # LOW_RANK entries may come before their factors: the format allows it
    sections = []
    for kind, name, data, compress in spec.sections:
        r = rng.random()
        if r < 0.15:
            continue
        if r < 0.45:
            data = data[:100] + b"changed" + data[100:]
        sections.append((kind, name, data, compress))
    if rng.random() < 0.4:
        sections.append((0, "", b'{"release_notes": "new"}', False))
    version = "1.0.1" if rng.random() < 0.5 else spec.version
    return ModelSpec(out, sections, version)


def dequantized(t: TensorSpec) -> np.ndarray:
    """The values a reader gets back for ``t`` (float32, its shape)."""
    parts = encode(t)
    w = t.weights
    if t.encoding == Encoding.INT8_CHANNEL:
        return codecs.dequantize_int8_channel(*parts).reshape(w.shape)
    if t.encoding.is_group:
        return codecs.dequantize_int4_group(
            parts[0], parts[1], parts[2] if len(parts) > 2 else None, GROUP
        ).reshape(w.shape)
    if t.encoding == Encoding.BF16:
        return (parts[0].astype(np.uint32) << 16).view(np.float32)
    return parts[0].astype(np.float32)


def encode(t: TensorSpec) -> tuple[np.ndarray, ...]:
    w = t.weights
    if t.encoding == Encoding.F32:
        return (w,)
    if t.encoding == Encoding.F16:
        return (w.astype(np.float16),)
    if t.encoding == Encoding.BF16:
        return ((w.view(np.uint32) >> 16).astype(np.uint16),)
    m = w.reshape(w.shape[0], -1)
    if t.encoding == Encoding.INT8_CHANNEL:
        return codecs.quantize_int8_channel(m)
    sym = t.encoding == Encoding.INT4_GROUP_SYM
    c, s, z = codecs.quantize_int4_group(m, GROUP, sym)
    return (c, s) if sym else (c, s, z)


def write_spec(path: Path, spec: ModelSpec, key: Ed25519PrivateKey | None = None) -> Path:
    identity = ModelIdentity("tiny", spec.version, "llama", {"hidden_size": 32})
    with PackageWriter(path, identity, provenance=Provenance(tool="deltafactory")) as w:
        for t in spec.tensors:
            if t.factors:
                u = next(x for x in spec.tensors if x.name == t.factors[0])
                w.add_low_rank(t.name, t.weights.shape, t.factors, u.weights.shape[1])
                continue
            group = GROUP if t.encoding.is_group else 0
            w.add_tensor(t.name, t.encoding, *encode(t), shape=t.weights.shape, group_size=group)
        for kind, name, data, compress in spec.sections:
            w.add_section(kind, data, name=name, compress=compress)
        w.finish([key] if key is not None else ())
    return path


# ------------------------------------------------------------------ forging deltas


def split_delta(raw: bytes):
    """(preamble, header, payload, signature block) of delta bytes, unchecked."""
    from edgepack.format.delta.container import DeltaPreamble, decode_header

    pre = DeltaPreamble.unpack(raw[:128], len(raw))
    header = decode_header(raw[pre.header_offset : pre.payload_offset])
    return pre, header, raw[pre.payload_offset : pre.payload_end], raw[pre.payload_end :]


def rewrite_header(
    raw: bytes, header, payload: bytes | None = None, *, fix_payload_hash: bool = True
) -> bytes:
    """Delta bytes with ``header`` (and ``payload``) swapped in, digests made to match,
    signature dropped: how tests reach the checks behind the digests."""
    from dataclasses import replace as dc_replace

    from edgepack.format.delta.container import (
        PREAMBLE_SIZE,
        DeltaPreamble,
        encode_header,
        header_digest,
    )

    _, _, old_payload, _ = split_delta(raw)
    payload = old_payload if payload is None else payload
    if fix_payload_hash:
        header = dc_replace(header, payload_sha256=hashlib.sha256(payload).digest())
    hb = encode_header(header)
    pre = DeltaPreamble(
        header_offset=PREAMBLE_SIZE,
        header_length=len(hb),
        payload_offset=PREAMBLE_SIZE + len(hb),
        payload_length=len(payload),
        header_digest=header_digest(hb),
    )
    return pre.pack() + hb + payload


def write_release_pair(directory: Path, seed: int) -> Path:
    """``old.epk``, ``new.epk`` (a mutation of it) and ``d.epkd`` between them (made with
    :func:`edgepack.server.delta.create_delta`) in ``directory``; returns the delta."""
    from edgepack.server.delta import create_delta

    rng = np.random.default_rng(seed)
    spec = random_spec(rng, 4)
    write_spec(directory / "old.epk", spec)
    write_spec(directory / "new.epk", mutate(spec, rng))
    create_delta(directory / "old.epk", directory / "new.epk", directory / "d.epkd")
    return directory / "d.epkd"

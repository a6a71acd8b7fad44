"""LORA_ADAPTER payloads: round trip in each encoding, and typed errors on bad bytes."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from edgepack.format import CorruptPackageError, Encoding, EncodingError, UnsupportedFeatureError
from edgepack.format.adapter import (
    ADAPTER_MAGIC,
    LoraAdapter,
    LoraFactor,
    LoraTarget,
    adapter_digest,
    decode_adapter,
    encode_adapter,
)


def _adapter(encoding: Encoding = Encoding.INT8_CHANNEL, seed: int = 0) -> LoraAdapter:
    rng = np.random.default_rng(seed)
    targets = []
    shapes = {"layers.0.attn_q.weight": (64, 32), "layers.0.attn_v.weight": (16, 32)}
    for name, (out, inp) in shapes.items():
        a = rng.standard_normal((4, inp)).astype(np.float32)
        b = rng.standard_normal((out, 4)).astype(np.float32)
        targets.append(
            LoraTarget(name, LoraFactor.encode(a, encoding), LoraFactor.encode(b, encoding), 2.0)
        )
    return LoraAdapter("demo", bytes(range(32)), 4, 8.0, tuple(targets), "peft")


@pytest.mark.parametrize("encoding", [Encoding.INT8_CHANNEL, Encoding.F16, Encoding.F32])
def test_round_trip(encoding):
    adapter = _adapter(encoding)
    data = encode_adapter(adapter)
    back = decode_adapter(data)
    assert back.name == "demo" and back.base_digest == bytes(range(32))
    assert back.rank == 4 and back.alpha == 8.0 and back.source == "peft"
    assert back.target_names == adapter.target_names
    for t, u in zip(adapter.targets, back.targets, strict=True):
        assert u.a.encoding == encoding and u.scale == 2.0
        np.testing.assert_array_equal(u.a.values(), t.a.values())
        np.testing.assert_array_equal(u.b.values(), t.b.values())
        assert u.delta().shape == t.shape
    assert adapter_digest(data) == adapter_digest(encode_adapter(back))


def test_int8_is_close_to_the_float_factors():
    exact = _adapter(Encoding.F32).targets[0]
    coded = _adapter(Encoding.INT8_CHANNEL).targets[0]
    err = np.abs(exact.delta() - coded.delta()).max()
    assert 0 < err < 0.05 * np.abs(exact.delta()).max()


def test_group_encodings_are_refused_for_factors():
    with pytest.raises(EncodingError, match="adapter factors"):
        LoraFactor.encode(np.ones((4, 32), np.float32), Encoding.INT4_GROUP_SYM)
    with pytest.raises(EncodingError, match="non-finite"):
        LoraFactor.encode(np.full((4, 32), np.nan, np.float32))


def _header(data: bytes) -> tuple[dict, int]:
    n = struct.unpack_from("<I", data, 12)[0]
    return json.loads(data[16 : 16 + n]), n


def _with_header(data: bytes, doc: dict) -> bytes:
    """``data`` with its JSON replaced by ``doc`` (the parts kept, re-aligned)."""
    _, n = _header(data)
    parts = data[-(-(16 + n) // 8) * 8 :]
    text = json.dumps(doc).encode()
    head = struct.pack("<8sII", ADAPTER_MAGIC, 1, len(text)) + text
    return head + bytes(-len(head) % 8) + parts


def _mutations(data: bytes):
    doc, _ = _header(data)
    yield "magic", b"XXXXXXXX" + data[8:]
    yield "truncated", data[:10]
    yield "short", data[:-8]
    yield "long", data + bytes(8)
    yield "json length", data[:12] + struct.pack("<I", 1 << 30) + data[16:]
    yield "not json", data[:16] + b"\xff" * 8 + data[24:]
    for key, value in [
        ("base_weights_digest", "abcd"),
        ("rank", 0),
        ("alpha", "x"),
        ("targets", []),
        ("name", 3),
    ]:
        yield key, _with_header(data, {**doc, key: value})
    for key, value in [
        ("name", ""),
        ("scale", None),
        ("a", {"encoding": "int4-g32", "shape": [4, 32]}),
        ("a", {"encoding": "int8", "shape": [4, -1]}),
        ("a", {"encoding": "int8", "shape": [5, 32]}),
        ("b", {"encoding": "int8", "shape": [1 << 39, 4]}),
        ("b", {"encoding": "int8", "shape": [64, True]}),
    ]:
        bad = json.loads(json.dumps(doc))
        bad["targets"][0][key] = value
        yield f"target {key}", _with_header(data, bad)
    dup = json.loads(json.dumps(doc))
    dup["targets"][1]["name"] = dup["targets"][0]["name"]
    yield "duplicate", _with_header(data, dup)


@pytest.mark.parametrize("case", [name for name, _ in _mutations(encode_adapter(_adapter()))])
def test_bad_bytes_are_corrupt(case):
    data = dict(_mutations(encode_adapter(_adapter())))[case]
    with pytest.raises(CorruptPackageError):
        decode_adapter(data)


def test_non_finite_stored_value_is_corrupt():
    data = bytearray(encode_adapter(_adapter(Encoding.F32)))
    _, n = _header(bytes(data))
    start = -(-(16 + n) // 8) * 8
    data[start : start + 4] = struct.pack("<f", float("nan"))
    with pytest.raises(CorruptPackageError, match="not finite"):
        decode_adapter(bytes(data))


def test_newer_version_is_unsupported():
    data = encode_adapter(_adapter())
    with pytest.raises(UnsupportedFeatureError, match="version 2"):
        decode_adapter(data[:8] + struct.pack("<I", 2) + data[12:])


def test_random_bytes_never_crash():
    data = encode_adapter(_adapter())
    rng = np.random.default_rng(1)
    for _ in range(300):
        mutated = bytearray(data)
        for i in rng.integers(0, len(data), size=int(rng.integers(1, 6))):
            mutated[int(i)] = int(rng.integers(0, 256))
        try:
            decode_adapter(bytes(mutated))
        except CorruptPackageError:
            pass

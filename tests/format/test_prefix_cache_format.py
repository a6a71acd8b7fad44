"""The PREFIX_KV_CACHE payload: round trip, alignment, zero-copy views, typed refusals."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from edgepack.format.constants import PAGE_SIZE, SPAN_ALIGNMENT
from edgepack.format.errors import CorruptPackageError, UnsupportedFeatureError
from edgepack.format.prefix_cache import (
    KVBinding,
    PrefixCache,
    decode_prefix_cache,
    encode_prefix_cache,
)

LAYERS, TOKENS = 2, 5


def _binding(**changes) -> KVBinding:
    base = dict(
        weights=bytes(range(32)),
        adapter=b"",
        kv_layout="int8",
        kv_layout_version=1,
        v_group=32,
        tokenizer=b"\x01" * 32,
        chat_template=b"",
        rope=b"\x02" * 32,
        num_layers=LAYERS,
        num_kv_heads=2,
        head_dim=64,
        activations="int8",
    )
    return KVBinding(**{**base, **changes})


def _cache() -> PrefixCache:
    rng = np.random.default_rng(0)
    arrays = {
        "k": rng.integers(-127, 128, (LAYERS, TOKENS, 2, 64), dtype=np.int8),
        "k_scales": rng.random((LAYERS, TOKENS, 2)).astype(np.float16),
        "v": rng.integers(0, 256, (LAYERS, TOKENS, 2, 32), dtype=np.uint8),
    }
    return PrefixCache(_binding(), np.arange(10, 10 + TOKENS, dtype=np.int32), arrays, "hi")


def _descriptor(payload: bytes) -> tuple[dict, int]:
    _magic, _version, dlen = struct.unpack_from("<8sII", payload)
    return json.loads(payload[16 : 16 + dlen]), dlen


def _with_descriptor(payload: bytes, doc: dict) -> bytes:
    """``payload`` with its descriptor replaced by ``doc`` (padded to the same length;
    the optional text is dropped to make room)."""
    _, dlen = _descriptor(payload)
    doc = {k: v for k, v in doc.items() if k != "text"}
    raw = json.dumps(doc, separators=(",", ":")).encode()
    assert len(raw) <= dlen
    return payload[:16] + raw.ljust(dlen) + payload[16 + dlen :]


def test_round_trip_gives_aligned_views_of_the_buffer() -> None:
    cache = _cache()
    payload = encode_prefix_cache(cache)
    buf = bytearray(payload)
    got = decode_prefix_cache(memoryview(buf))
    assert got.binding == cache.binding and got.text == "hi"
    assert got.tokens.tolist() == cache.tokens.tolist()
    assert set(got.arrays) == set(cache.arrays)
    base = np.frombuffer(buf, np.uint8)
    for name, a in got.arrays.items():
        assert np.array_equal(a, cache.arrays[name])
        assert np.shares_memory(a, base)  # a view: no copy
        offset = a.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        assert offset % SPAN_ALIGNMENT == 0


def test_binding_mismatch_names_the_first_differing_field() -> None:
    assert _binding().mismatch(_binding()) is None
    assert _binding(adapter=b"\x05" * 32).mismatch(_binding()) == "adapter"
    assert _binding(rope=b"\x00" * 32).mismatch(_binding()) == "rope"


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: b"NOTMAGIC" + p[8:],
        lambda p: p[:10],
        lambda p: p[:16] + b"\xff" * 8 + p[24:],  # descriptor no longer JSON
        lambda p: p[:12] + struct.pack("<I", len(p)) + p[16:],  # descriptor past the end
        lambda p: p[: len(p) - 64],  # the last array cut off
    ],
)
def test_bad_bytes_are_corrupt(damage) -> None:
    with pytest.raises(CorruptPackageError):
        decode_prefix_cache(damage(encode_prefix_cache(_cache())))


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["arrays"][0].update(offset=d["arrays"][1]["offset"]),  # overlap
        lambda d: d["arrays"][0].update(offset=3),  # unaligned
        lambda d: d["arrays"][0].update(dtype="object"),
        lambda d: d["arrays"][0].update(shape=[LAYERS + 1, TOKENS, 2, 64]),
        lambda d: d.update(num_tokens=-1),
        lambda d: d["binding"].update(weights="zz"),
        lambda d: d["binding"].update(num_layers="2"),
        lambda d: d.update(arrays=[]),
    ],
)
def test_inconsistent_descriptor_is_corrupt(edit) -> None:
    payload = encode_prefix_cache(_cache())
    doc, _ = _descriptor(payload)
    edit(doc)
    with pytest.raises(CorruptPackageError):
        decode_prefix_cache(_with_descriptor(payload, doc))


def test_newer_payload_version_is_unsupported() -> None:
    payload = bytearray(encode_prefix_cache(_cache()))
    payload[8:12] = struct.pack("<I", 99)
    with pytest.raises(UnsupportedFeatureError):
        decode_prefix_cache(bytes(payload))


@pytest.mark.parametrize("paged", [False, True])
def test_random_damage_never_escapes_the_error_tree(paged: bool) -> None:
    payload = encode_prefix_cache(_cache(), paged=paged)
    rng = np.random.default_rng(1)
    for _ in range(300):
        b = bytearray(payload)
        for i in rng.integers(0, 16 + _descriptor(payload)[1], 3):
            b[i] = int(rng.integers(0, 256))
        try:
            decode_prefix_cache(bytes(b))
        except CorruptPackageError:
            pass


def test_paged_payload_puts_each_layer_on_pages_of_its_own() -> None:
    cache = _cache()
    payload = encode_prefix_cache(cache, paged=True)
    assert struct.unpack_from("<I", payload, 8)[0] == 2
    buf = bytearray(payload)
    got = decode_prefix_cache(memoryview(buf))
    base = np.frombuffer(buf, np.uint8).__array_interface__["data"][0]
    for name, a in got.arrays.items():
        assert np.array_equal(a, cache.arrays[name])
        for layer in a:
            assert layer.flags.c_contiguous
            assert (layer.__array_interface__["data"][0] - base) % PAGE_SIZE == 0
    assert np.shares_memory(got.arrays["k"], np.frombuffer(buf, np.uint8))


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["arrays"][0].update(layer_stride=100),  # not whole pages
        lambda d: d["arrays"][0].update(layer_stride=0),  # layers overlap
        lambda d: d["arrays"][0].update(layer_stride=1 << 30),  # past the end
        lambda d: d["arrays"][1].update(offset=d["arrays"][0]["offset"]),  # overlap
        lambda d: d["arrays"][0].update(layer_stride="4096"),
        lambda d: d.update(binding={**d["binding"], "num_layers": 0})
        or [a.update(shape=[0, *a["shape"][1:]]) for a in d["arrays"]],  # no layer
    ],
)
def test_inconsistent_paged_descriptor_is_corrupt(edit) -> None:
    payload = encode_prefix_cache(_cache(), paged=True)
    doc, _ = _descriptor(payload)
    edit(doc)
    with pytest.raises(CorruptPackageError):
        decode_prefix_cache(_with_descriptor(payload, doc))


@pytest.mark.parametrize("stride", ["missing", None])
def test_paged_array_without_layer_stride_is_corrupt(stride) -> None:
    """A version 2 array must say where its layers are: never read as contiguous."""
    payload = encode_prefix_cache(_cache(), paged=True)
    doc, _ = _descriptor(payload)
    if stride == "missing":
        del doc["arrays"][0]["layer_stride"]
    else:
        doc["arrays"][0]["layer_stride"] = stride
    with pytest.raises(CorruptPackageError, match="has no layer_stride"):
        decode_prefix_cache(_with_descriptor(payload, doc))

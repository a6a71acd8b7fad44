"""Fuzzing the delta patcher: thousands of mutated deltas, zero untyped exceptions.

Mutations reach every layer: raw bytes (caught by the preamble and digests), header
records re-digested so the decoder and validator see them, op fields re-digested so the
runner sees them, and payload bytes with the payload hash fixed so stream decoding and
combining see them. Every attempt must either raise an EdgepackError and leave the old
target in place, or succeed with exactly NEW (the final SHA-256 guarantees that).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
from deltafactory import ModelSpec, TensorSpec, dequantized, rewrite_header, split_delta, write_spec

from edgepack.format import EdgepackError, Encoding
from edgepack.format.delta import apply_delta
from edgepack.format.delta.container import (
    Codec,
    Combine,
    OpKind,
    RefKind,
    Shuffle,
    Stream,
    encode_header,
)
from edgepack.server.delta import DeltaOptions, create_delta

ITERATIONS = 3000  # a fixed, seeded count: the same mutants on every machine


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory):
    return build_corpus(tmp_path_factory.mktemp("fuzz"))


def build_corpus(d: Path) -> tuple[Path, Path, Path, Path]:
    """Old and new packages in ``d`` and the delta between them, using every op shape."""
    rng = np.random.default_rng(2024)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    a, b, c, e, k = w(64, 128), w(32, 64), w(8, 96), w(64), w(16, 128)
    a_q = dequantized(TensorSpec("q8", Encoding.INT8_CHANNEL, a))  # a LoRA-like merge:
    lora = (rng.standard_normal((64, 2)) @ rng.standard_normal((2, 128))).astype(np.float32)
    a_new = a_q + lora * (0.05 * np.linalg.norm(a_q) / np.linalg.norm(lora))
    old_spec = ModelSpec(
        [
            TensorSpec("q8", Encoding.INT8_CHANNEL, a_q),
            TensorSpec("q4", Encoding.INT4_GROUP_SYM, b),
            TensorSpec("qa", Encoding.INT4_GROUP_ASYM, c),
            TensorSpec("norm", Encoding.F32, e),
            TensorSpec("gone", Encoding.F16, w(8, 32)),
            TensorSpec("keep", Encoding.INT4_GROUP_SYM, k),
        ],
        [(1, "tok", rng.integers(97, 123, 2000, dtype=np.uint8).tobytes(), False)],
    )
    recoded = TensorSpec("q4", Encoding.INT4_GROUP_SYM, b)
    new_spec = ModelSpec(
        [
            TensorSpec("q8", Encoding.INT8_CHANNEL, a_new),
            TensorSpec("q4", Encoding.INT8_CHANNEL, dequantized(recoded)),
            TensorSpec("qa", Encoding.INT4_GROUP_ASYM, c + 0.001 * w(8, 96) * 20),
            TensorSpec("norm", Encoding.F32, e * 1.001),
            TensorSpec("fresh", Encoding.BF16, w(8, 32)),
            TensorSpec("keep", Encoding.INT4_GROUP_SYM, k),
        ],
        [
            (
                1,
                "tok",
                old_spec.sections[0][2][:500] + b"inserted" + old_spec.sections[0][2][500:],
                False,
            )
        ],
        version="1.0.1",
    )
    old = write_spec(d / "old.epk", old_spec)
    new = write_spec(d / "new.epk", new_spec)
    delta = d / "d.epkd"
    create_delta(old, new, delta, options=DeltaOptions(level=3, workers=1))
    return d, old, new, delta


def test_corpus_covers_every_op_shape(corpus) -> None:
    _, _, _, delta = corpus
    _, h, _, _ = split_delta(delta.read_bytes())
    kinds = {op.kind for op in h.ops}
    refs = {op.ref_kind for op in h.ops if op.kind == OpKind.DATA}
    assert kinds == {OpKind.ZERO, OpKind.COPY, OpKind.DATA, OpKind.FACTORS}
    assert refs >= {RefKind.NONE, RefKind.PREDICTED}
    assert any(s.dict_length for s in h.streams)
    assert {s.codec for s in h.streams} >= {Codec.ZSTD, Codec.RANS}
    assert Combine.ADD_DIRECTED in {op.combine for op in h.ops if op.kind == OpKind.DATA}
    shuffles = {op.shuffle for op in h.ops if op.kind == OpKind.DATA}
    assert {Shuffle.SPARSE, Shuffle.PLANES} <= shuffles, shuffles


def _mutate_int(rng: np.random.Generator, value: int) -> int:
    r = rng.random()
    if r < 0.3:
        return max(0, value + int(rng.integers(-3, 4)))
    if r < 0.5:
        return value ^ (1 << int(rng.integers(0, 40)))
    if r < 0.7:
        return int(rng.choice([0, 1, 2, 3, 4, 8, 16, 20, 21, 32, 40, 255, 2**31, 2**63]))
    return int(rng.integers(0, 2**62))


def _structured(raw: bytes, rng: np.random.Generator) -> bytes:
    _, h, _, _ = split_delta(raw)
    ops, streams = list(h.ops), list(h.streams)
    for _ in range(int(rng.integers(1, 3))):
        if streams and rng.random() < 0.25:
            i = int(rng.integers(len(streams)))
            fields = dataclasses.astuple(streams[i])
            k = int(rng.integers(len(fields)))
            streams[i] = Stream(
                *[(_mutate_int(rng, v) if j == k else v) for j, v in enumerate(fields)]
            )
            continue
        i = int(rng.integers(len(ops)))
        op = ops[i]
        if op.prediction is not None and rng.random() < 0.5:
            pf = dataclasses.fields(op.prediction)
            f = pf[int(rng.integers(len(pf)))].name
            pred = dataclasses.replace(
                op.prediction, **{f: _mutate_int(rng, getattr(op.prediction, f))}
            )
            ops[i] = dataclasses.replace(op, prediction=pred)
        else:
            names = [
                "kind",
                "target_offset",
                "length",
                "base_offset",
                "stream",
                "combine",
                "width",
                "shuffle",
                "ref_kind",
                "ref_offset",
                "aux_stream",
                "positions_length",
                "values_length",
            ]
            f = names[int(rng.integers(len(names)))]
            ops[i] = dataclasses.replace(op, **{f: _mutate_int(rng, getattr(op, f))})
        if rng.random() < 0.1 and len(ops) > 1:
            j = int(rng.integers(len(ops)))
            ops[i], ops[j] = ops[j], ops[i]
    h = dataclasses.replace(h, ops=tuple(ops), streams=tuple(streams))
    try:
        encode_header(h)
    except ValueError:  # a number the encoder refuses (< 0 or >= 2^64): nothing to test
        return raw
    return rewrite_header(raw, h)


def _payload(raw: bytes, rng: np.random.Generator) -> bytes:
    _, h, payload, _ = split_delta(raw)
    p = bytearray(payload)
    for _ in range(int(rng.integers(1, 4))):
        pos = int(rng.integers(len(p)))
        p[pos] ^= 1 << int(rng.integers(8))
    return rewrite_header(raw, h, bytes(p))


def _header_bytes(raw: bytes, rng: np.random.Generator) -> bytes:
    from edgepack.format.delta.container import header_digest

    pre, _, payload, _ = split_delta(raw)
    hb = bytearray(raw[pre.header_offset : pre.payload_offset])
    r = rng.random()
    if r < 0.6:
        pos = int(rng.integers(len(hb)))
        hb[pos] = int(rng.integers(256))
    elif r < 0.8:
        cut = int(rng.integers(len(hb)))
        del hb[cut : cut + int(rng.integers(1, 8))]
    else:
        pos = int(rng.integers(len(hb)))
        hb[pos:pos] = bytes(rng.integers(0, 256, int(rng.integers(1, 8)), dtype=np.uint8))
    pre = dataclasses.replace(
        pre,
        header_length=len(hb),
        payload_offset=pre.header_offset + len(hb),
        header_digest=header_digest(bytes(hb)),
        signature_offset=0,
        signature_length=0,
    )
    return pre.pack() + bytes(hb) + payload


def _raw(raw: bytes, rng: np.random.Generator) -> bytes:
    b = bytearray(raw)
    r = rng.random()
    if r < 0.5:
        pos = int(rng.integers(len(b)))
        b[pos] ^= 1 << int(rng.integers(8))
    elif r < 0.75:
        del b[int(rng.integers(len(b))) :]
    else:
        pos = int(rng.integers(len(b)))
        b[pos:pos] = bytes(int(rng.integers(1, 16)))
    return bytes(b)


MUTATORS = [_structured, _structured, _payload, _header_bytes, _raw]  # weighted by repeats


@pytest.mark.slow
def test_fuzz_mutated_deltas_only_raise_typed_errors(corpus, monkeypatch) -> None:
    d, old, new, delta = corpus
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # durability is not what is fuzzed
    raw = delta.read_bytes()
    expected = new.read_bytes()
    rng = np.random.default_rng(99)
    mutators = MUTATORS
    target = d / "out.epk"
    bad = d / "bad.epkd"
    outcomes: dict[str, int] = {}
    for n in range(ITERATIONS):
        mutator = mutators[n % len(mutators)]
        bad.write_bytes(mutator(raw, rng))
        target.write_bytes(b"old release")
        try:
            apply_delta(old, bad, target)
        except EdgepackError as exc:
            outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
            assert target.read_bytes() == b"old release"
        else:
            outcomes["ok"] = outcomes.get("ok", 0) + 1
            assert target.read_bytes() == expected
    leftovers = {p.name for p in d.iterdir()} - {
        "old.epk",
        "new.epk",
        "d.epkd",
        "out.epk",
        "bad.epkd",
    }
    assert not leftovers
    assert sum(outcomes.values()) == ITERATIONS
    print(ITERATIONS, outcomes)
    assert len(outcomes) >= 4, outcomes  # the mutations reach several layers


def test_fuzz_header_decoder_directly() -> None:
    """decode_header + validate on random and half-random bytes: typed errors only."""
    from edgepack.format.delta.container import decode_header, validate

    rng = np.random.default_rng(5)
    for i in range(3000):
        n = int(rng.integers(0, 400))
        raw = bytearray(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
        if i % 2 and n >= 196:
            raw[0:4] = b"EPDH"
            raw[4:8] = (196).to_bytes(4, "little")
            raw[184:192] = bytes(rng.integers(0, 4, 8, dtype=np.uint8))
            raw[192:196] = bytes(4)
        try:
            validate(decode_header(bytes(raw)))
        except EdgepackError:
            pass


def test_corpus_applies(corpus) -> None:
    d, old, new, delta = corpus
    apply_delta(old, delta, d / "ok.epk")
    assert (d / "ok.epk").read_bytes() == new.read_bytes()
    (d / "ok.epk").unlink()

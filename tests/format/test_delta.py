"""Deltas end to end (spec/DELTA.md): patch(OLD, diff(OLD, NEW)) == NEW byte for byte over
random package pairs; a wrong base or a corrupted delta is refused with a typed error
before any output exists; the target path is only ever replaced by a verified file;
patching streams (memory well under the largest tensor); signatures."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
from deltafactory import (
    ModelSpec,
    TensorSpec,
    make_key,
    mutate,
    random_spec,
    split_delta,
    write_spec,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgepack.format import EdgepackError, Encoding, SignatureError
from edgepack.format.delta import (
    CorruptDeltaError,
    DeltaError,
    DeltaFile,
    TruncatedDeltaError,
    WrongBaseError,
    apply_delta,
)
from edgepack.format.delta.container import Combine, OpKind, RefKind, Shuffle
from edgepack.server.delta import DeltaOptions, create_delta

FAST = DeltaOptions(level=3, workers=1, verify=False)


def _files_in(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n_tensors=st.integers(1, 8),
    sign_old=st.booleans(),
    sign_new=st.booleans(),
    sign_delta=st.booleans(),
)
def test_patch_reproduces_new_exactly(seed, n_tensors, sign_old, sign_new, sign_delta) -> None:
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        old_spec = random_spec(rng, n_tensors, low_rank=bool(rng.random() < 0.5))
        new_spec = mutate(old_spec, rng)
        old = write_spec(d / "old.epk", old_spec, make_key(1) if sign_old else None)
        new = write_spec(d / "new.epk", new_spec, make_key(2) if sign_new else None)
        keys = [make_key(3)] if sign_delta else []
        create_delta(old, new, d / "d.epkd", signing_keys=keys, options=FAST)
        trusted = [make_key(3).public_key()] if sign_delta else None
        report = apply_delta(old, d / "d.epkd", d / "out.epk", trusted_keys=trusted)
        assert (d / "out.epk").read_bytes() == new.read_bytes()
        assert report.signed == sign_delta
        assert _files_in(d) == {"old.epk", "new.epk", "d.epkd", "out.epk"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("delta")
    rng = np.random.default_rng(7)
    spec = random_spec(rng, 8)
    big = (rng.standard_normal((64, 256)) * 0.05).astype(np.float32)
    spec.tensors.append(TensorSpec("big.weight", Encoding.INT4_GROUP_SYM, big))
    old = write_spec(d / "old.epk", spec, make_key(1))
    new_spec = mutate(ModelSpec(spec.tensors[:-1], spec.sections), rng)
    big = big + 0.001 * rng.standard_normal(big.shape).astype(np.float32)
    new_spec.tensors.append(TensorSpec("big.weight", Encoding.INT4_GROUP_SYM, big))
    new = write_spec(d / "new.epk", new_spec, make_key(1))
    delta = d / "d.epkd"
    create_delta(old, new, delta, signing_keys=[make_key(5)])
    other = write_spec(d / "other.epk", random_spec(np.random.default_rng(8), 4))
    return d, old, new, delta, other


def test_default_options_verify_and_roundtrip(pair) -> None:
    d, old, new, delta, _ = pair
    out = d / "roundtrip.epk"
    apply_delta(old, delta, out, trusted_keys=[make_key(5).public_key()])
    assert out.read_bytes() == new.read_bytes()
    out.unlink()


def test_unchanged_package_costs_almost_nothing(tmp_path: Path, pair) -> None:
    _, old, _, _, _ = pair
    stats = create_delta(old, old, tmp_path / "same.epkd")
    assert stats.size < 400
    assert stats.coded <= 8192  # the preamble+header page, coded against itself
    apply_delta(old, tmp_path / "same.epkd", tmp_path / "same.epk")
    assert (tmp_path / "same.epk").read_bytes() == old.read_bytes()


def test_renamed_and_moved_tensors_are_copied(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    spec = random_spec(rng, 6, low_rank=False)
    moved = ModelSpec(
        [TensorSpec(t.name + ".moved", t.encoding, t.weights) for t in reversed(spec.tensors)],
        spec.sections,
    )
    old = write_spec(tmp_path / "old.epk", spec)
    new = write_spec(tmp_path / "new.epk", moved)
    stats = create_delta(old, new, tmp_path / "d.epkd", options=FAST)
    assert stats.methods["copy"] >= 1
    assert stats.coded <= 8192 + 200  # only the head page (and nothing of the tensors)
    apply_delta(old, tmp_path / "d.epkd", tmp_path / "out.epk")
    assert (tmp_path / "out.epk").read_bytes() == new.read_bytes()


def test_reencoded_tensor_is_predicted(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((128, 256)) * 0.05).astype(np.float32)
    old_spec = ModelSpec([TensorSpec("w", Encoding.INT4_GROUP_SYM, w)])
    from deltafactory import dequantized

    new_spec = ModelSpec([TensorSpec("w", Encoding.INT8_CHANNEL, dequantized(old_spec.tensors[0]))])
    old = write_spec(tmp_path / "old.epk", old_spec)
    new = write_spec(tmp_path / "new.epk", new_spec)
    stats = create_delta(old, new, tmp_path / "d.epkd")
    with DeltaFile.open(tmp_path / "d.epkd") as df:
        kinds = {op.ref_kind for op in df.header.ops if op.kind == OpKind.DATA}
    assert RefKind.PREDICTED in kinds
    assert stats.size < 1500  # 32 KB of int8 codes + scales, predicted exactly
    apply_delta(old, tmp_path / "d.epkd", tmp_path / "out.epk")
    assert (tmp_path / "out.epk").read_bytes() == new.read_bytes()


# ----------------------------------------------------------------- refusals


def test_wrong_base_refused_before_any_output(pair) -> None:
    d, _, new, delta, other = pair
    before = _files_in(d)
    with pytest.raises(WrongBaseError, match="bytes"):
        apply_delta(other, delta, d / "x.epk")
    with pytest.raises(WrongBaseError):
        apply_delta(new, delta, d / "x.epk")  # the target is not the base either
    assert _files_in(d) == before


def test_same_header_corrupt_base_refused(pair, tmp_path: Path) -> None:
    _, old, _, delta, _ = pair
    data = bytearray(old.read_bytes())
    data[-200] ^= 0x01  # inside the data region or signature: header digest still matches
    bad = tmp_path / "bad-base.epk"
    bad.write_bytes(bytes(data))
    with pytest.raises(WrongBaseError, match="corrupt base"):
        apply_delta(bad, delta, tmp_path / "x.epk")
    assert not (tmp_path / "x.epk").exists()


def test_wrong_base_checks_are_cheap_first(pair, tmp_path: Path, monkeypatch) -> None:
    """A base of another size is refused without hashing it."""
    import edgepack.format.delta.apply as apply_mod

    _, _, _, delta, other = pair
    calls = []
    real = apply_mod._pread_exact
    monkeypatch.setattr(
        apply_mod,
        "_pread_exact",
        lambda fd, n, off, what: calls.append(what) or real(fd, n, off, what),
    )
    with pytest.raises(WrongBaseError):
        apply_delta(other, delta, tmp_path / "x.epk")
    assert "base" not in calls


@pytest.mark.parametrize("cut", [0, 5, 127, 128, 200, -1, -64, -300])
def test_truncated_delta_is_typed_and_leaves_nothing(pair, tmp_path: Path, cut: int) -> None:
    _, old, _, delta, _ = pair
    raw = delta.read_bytes()
    bad = tmp_path / "t.epkd"
    bad.write_bytes(raw[:cut])
    target = tmp_path / "out.epk"
    target.write_bytes(b"previous release")
    with pytest.raises(DeltaError):
        apply_delta(old, bad, target)
    assert target.read_bytes() == b"previous release"
    assert _files_in(tmp_path) == {"t.epkd", "out.epk"}


def test_truncation_error_kinds(pair, tmp_path: Path) -> None:
    _, old, _, delta, _ = pair
    raw = delta.read_bytes()
    bad = tmp_path / "t.epkd"
    bad.write_bytes(raw[:-10])
    with pytest.raises(TruncatedDeltaError, match="truncated"):
        apply_delta(old, bad, tmp_path / "o.epk")
    bad.write_bytes(raw + b"x")
    with pytest.raises(CorruptDeltaError, match="trailing"):
        apply_delta(old, bad, tmp_path / "o.epk")
    bad.write_bytes(b"not a delta at all" * 20)
    with pytest.raises(CorruptDeltaError, match="not an edgepack delta"):
        apply_delta(old, bad, tmp_path / "o.epk")


def test_bit_flips_anywhere_are_typed(pair, tmp_path: Path) -> None:
    """Every flip is refused with a typed error and the old target kept, except flips of
    bytes nothing depends on - format_minor and reserved preamble bytes (ignored by the
    spec), flatbuffer padding in the signature block - which still yield exactly NEW."""
    _, old, new, delta, _ = pair
    raw = delta.read_bytes()
    target = tmp_path / "out.epk"
    rng = np.random.default_rng(0)
    positions = sorted({*range(0, 128, 3), *rng.integers(0, len(raw), 80).tolist(), len(raw) - 1})
    trusted = [make_key(5).public_key()]
    with DeltaFile.open(delta) as df:
        signature_start = df.preamble.payload_end
    ignored = set(range(10, 12)) | set(range(96, 128))
    for pos in positions:
        bad = bytearray(raw)
        bad[pos] ^= 1 << int(rng.integers(0, 8))
        (tmp_path / "f.epkd").write_bytes(bytes(bad))
        target.write_bytes(b"previous")
        if pos in ignored or pos >= signature_start:
            try:
                apply_delta(old, tmp_path / "f.epkd", target, trusted_keys=trusted)
            except EdgepackError:
                assert pos >= signature_start
                assert target.read_bytes() == b"previous"
            else:
                assert target.read_bytes() == new.read_bytes()
            continue
        with pytest.raises(EdgepackError):
            apply_delta(old, tmp_path / "f.epkd", target, trusted_keys=trusted)
        assert target.read_bytes() == b"previous", pos
        assert _files_in(tmp_path) == {"f.epkd", "out.epk"}


def test_signature_checks(pair, tmp_path: Path) -> None:
    d, old, _, delta, _ = pair
    with pytest.raises(SignatureError, match="not by a trusted key"):
        apply_delta(old, delta, tmp_path / "x.epk", trusted_keys=[make_key(9).public_key()])
    unsigned = tmp_path / "u.epkd"
    create_delta(old, d / "new.epk", unsigned, options=FAST)
    with pytest.raises(SignatureError, match="not signed"):
        apply_delta(old, unsigned, tmp_path / "x.epk", trusted_keys=[make_key(5).public_key()])
    assert not (tmp_path / "x.epk").exists()


def test_delta_signature_does_not_verify_as_package_signature(pair) -> None:
    """Domain separation: the signed digest of a delta is never a package header digest."""
    from edgepack.format.delta.container import header_digest

    _, _, _, delta, _ = pair
    with DeltaFile.open(delta) as df:
        raw = df.read(df.preamble.header_offset, df.preamble.header_length)
    assert header_digest(raw) == df.preamble.header_digest
    import hashlib

    assert hashlib.sha256(raw).digest() != df.preamble.header_digest


def test_newer_major_is_incompatible(pair, tmp_path: Path) -> None:
    from edgepack.format.errors import IncompatiblePackageError

    _, old, _, delta, _ = pair
    raw = bytearray(delta.read_bytes())
    raw[8:10] = (2).to_bytes(2, "little")
    (tmp_path / "v2.epkd").write_bytes(bytes(raw))
    with pytest.raises(IncompatiblePackageError, match="update the app"):
        apply_delta(old, tmp_path / "v2.epkd", tmp_path / "x.epk")


def test_ops_must_tile_the_target(pair, tmp_path: Path) -> None:
    """A forged but well-digested header with a gap is refused while parsing."""
    from deltafactory import rewrite_header

    _, old, _, delta, _ = pair
    with DeltaFile.open(delta) as df:
        h = df.header
    from dataclasses import replace

    ops = list(h.ops)
    zero = next(i for i, op in enumerate(ops) if op.kind == OpKind.ZERO and op.length > 1)
    ops[zero] = replace(ops[zero], length=ops[zero].length - 1)
    bad = rewrite_header(delta.read_bytes(), replace(h, ops=tuple(ops)))
    (tmp_path / "gap.epkd").write_bytes(bad)
    with pytest.raises(CorruptDeltaError, match="gap"):
        apply_delta(old, tmp_path / "gap.epkd", tmp_path / "x.epk")


def test_huge_target_refused(pair, tmp_path: Path) -> None:
    """A well-digested delta whose ops end in a terabyte of zeros is refused up front."""
    from dataclasses import replace

    from deltafactory import rewrite_header

    _, old, _, delta, _ = pair
    with DeltaFile.open(delta) as df:
        h = df.header
    huge = 1 << 40
    last = max(h.ops, key=lambda op: op.target_end)
    ops = (*h.ops, replace(last, kind=OpKind.ZERO, target_offset=last.target_end, length=huge))
    forged = replace(h, ops=ops, target_file_size=h.target_file_size + huge)
    (tmp_path / "huge.epkd").write_bytes(rewrite_header(delta.read_bytes(), forged))
    with pytest.raises(CorruptDeltaError, match="more than the"):
        apply_delta(old, tmp_path / "huge.epkd", tmp_path / "x.epk")
    assert not (tmp_path / "x.epk").exists()


def test_lora_merge_is_coded_as_factors(tmp_path: Path) -> None:
    """An int8 tensor re-quantized after a low-rank update: FACTORS + small residuals."""
    from deltafactory import dequantized

    rng = np.random.default_rng(12)
    w = (rng.standard_normal((256, 256)) * 0.05).astype(np.float32)
    w_q = dequantized(TensorSpec("w", Encoding.INT8_CHANNEL, w))
    lora = (rng.standard_normal((256, 4)) @ rng.standard_normal((4, 256))).astype(np.float32)
    w_new = w_q + lora * (0.01 * np.linalg.norm(w_q) / np.linalg.norm(lora))
    old = write_spec(tmp_path / "old.epk", ModelSpec([TensorSpec("w", Encoding.INT8_CHANNEL, w_q)]))
    new = write_spec(
        tmp_path / "new.epk", ModelSpec([TensorSpec("w", Encoding.INT8_CHANNEL, w_new)])
    )
    plain = create_delta(old, new, tmp_path / "p.epkd", options=DeltaOptions(factors_limit=0))
    stats = create_delta(old, new, tmp_path / "d.epkd")
    factored = [m for m in stats.methods if m.startswith("predict-add8") and m.endswith("+factors")]
    assert sum(stats.methods[m] for m in factored) == 1, stats.methods
    assert stats.size < 0.6 * plain.size
    apply_delta(old, tmp_path / "d.epkd", tmp_path / "out.epk")
    assert (tmp_path / "out.epk").read_bytes() == new.read_bytes()


def test_transforms_are_inverse() -> None:
    from edgepack.format.delta.transforms import (
        combine,
        planes,
        residual_of,
        shuffle,
        unshuffle_block,
    )

    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, 4096, dtype=np.uint8)
    b = rng.integers(0, 256, 4096, dtype=np.uint8)
    for mode, width in [
        (Combine.XOR, 8),
        (Combine.ADD, 4),
        (Combine.ADD, 8),
        (Combine.ADD, 16),
        (Combine.ADD, 32),
    ]:
        res = residual_of(a, b, mode, width)
        assert np.array_equal(combine(res, b, mode, width), a)
    for width, flags in ((8, 2), (4, 4)):
        negate = rng.integers(0, flags, a.size, dtype=np.uint8)
        res = residual_of(a, b, Combine.ADD_DIRECTED, width, negate)
        assert np.array_equal(combine(res, b, Combine.ADD_DIRECTED, width, negate), a)
        plain = residual_of(a, b, Combine.ADD, width)
        assert np.array_equal(res[negate == 0], plain[negate == 0])
    # a code one above its rounded-up prediction costs what one below an unflagged one does
    up = residual_of(
        np.array([6], np.uint8),
        np.array([5], np.uint8),
        Combine.ADD_DIRECTED,
        8,
        np.array([0], np.uint8),
    )
    down = residual_of(
        np.array([4], np.uint8),
        np.array([5], np.uint8),
        Combine.ADD_DIRECTED,
        8,
        np.array([1], np.uint8),
    )
    assert up.tolist() == down.tolist() == [2]
    small = np.array([1, 0, 255, 3], np.uint8)  # +1, 0, -1, +3 as nibbles / bytes
    assert residual_of(small, np.zeros(4, np.uint8), Combine.ADD, 8).tolist() == [2, 0, 1, 6]
    for elem in (2, 4):
        s = shuffle(a, elem)
        assert np.array_equal(unshuffle_block(s, elem), a)
        first, rest = planes(a, elem)
        assert np.array_equal(np.concatenate([first, rest]), s)


@pytest.mark.parametrize("size", [1, 77, (1 << 20) - 1, 1 << 20, (1 << 20) + 3, 2_500_000])
@pytest.mark.parametrize("density", [0.0, 0.03, 1.0])
def test_sparse_residual_roundtrip(size: int, density: float) -> None:
    """Positions (LEB128 gaps per 2^20-byte block) and values rebuild the residual, and
    each block takes exactly its own bytes from both streams."""
    from edgepack.format.delta.transforms import sparse_block, sparsify

    rng = np.random.default_rng(size)
    res = np.where(rng.random(size) < density, rng.integers(1, 256, size), 0).astype(np.uint8)
    positions, values = sparsify(res)
    assert values.size == np.count_nonzero(res)
    streams = {"p": positions.tobytes(), "v": values.tobytes()}
    used = {"p": 0, "v": 0}

    def reader(key):
        def read(n: int) -> bytes:
            out = streams[key][used[key] : used[key] + n]
            used[key] += n
            return out

        return read

    blocks = [
        sparse_block(reader("p"), reader("v"), min(1 << 20, size - start))
        for start in range(0, size, 1 << 20)
    ]
    assert np.array_equal(np.concatenate(blocks), res)
    assert used == {"p": positions.size, "v": values.size}


def _sparse_bytes(count: int, gaps: bytes) -> bytes:
    return np.array([count, len(gaps)], "<u4").tobytes() + gaps


@pytest.mark.parametrize(
    ("positions", "values", "length", "why"),
    [
        (_sparse_bytes(5, b"\x00" * 5), b"\x01" * 5, 4, "impossible block counts"),
        (_sparse_bytes(2, b"\x00"), b"\x01" * 2, 8, "impossible block counts"),
        (_sparse_bytes(1, b"\x80\x80\x80\x01"), b"\x01", 8, "impossible block counts"),
        (_sparse_bytes(2, b"\x00\x80"), b"\x01" * 2, 8, "does not hold its count"),
        (_sparse_bytes(1, b"\x08"), b"\x01", 8, "out of range"),
        (_sparse_bytes(2, b"\x00\x00"), b"\x01\x00", 8, "zero value"),
    ],
)
def test_sparse_block_refuses_inconsistent_input(positions, values, length, why) -> None:
    from edgepack.format.delta.transforms import sparse_block

    p, v = iter([positions[:8], positions[8:]]), iter([values])
    with pytest.raises(CorruptDeltaError, match=why):
        sparse_block(lambda n: next(p)[:n], lambda n: next(v)[:n], length)


def test_requantized_codes_and_scales_use_sparse_and_planes(tmp_path: Path) -> None:
    """A float fine-tune re-quantized to int4 moves a few percent of the codes and most
    scales by a few ulps: the codes go sparse, the scales as split byte planes, and the
    patch rebuilds NEW exactly."""
    rng = np.random.default_rng(7)
    ws = [(rng.standard_normal((192, 256)) * 0.05).astype(np.float32) for _ in range(3)]
    updated = []
    for w in ws:
        lora = (rng.standard_normal((192, 8)) @ rng.standard_normal((8, 256))).astype(np.float32)
        updated.append(w + lora * (0.01 * np.linalg.norm(w) / np.linalg.norm(lora)))
    spec = lambda mats: ModelSpec(  # noqa: E731
        [TensorSpec(f"w{i}", Encoding.INT4_GROUP_SYM, m) for i, m in enumerate(mats)]
    )
    old = write_spec(tmp_path / "old.epk", spec(ws))
    new = write_spec(tmp_path / "new.epk", spec(updated))
    stats = create_delta(old, new, tmp_path / "d.epkd", options=DeltaOptions(factors_limit=0))
    _, h, _, _ = split_delta((tmp_path / "d.epkd").read_bytes())
    modes = {op.shuffle for op in h.ops if op.kind == OpKind.DATA}
    assert {Shuffle.SPARSE, Shuffle.PLANES} <= modes, stats.methods
    apply_delta(old, tmp_path / "d.epkd", tmp_path / "out.epk")
    assert (tmp_path / "out.epk").read_bytes() == new.read_bytes()


# ----------------------------------------------------------------- streaming


# Peak RSS of this process alone: VmHWM resets at exec, where ru_maxrss would inherit
# the (large) test process's high-water mark.
_MEASURE = textwrap.dedent(
    """
    import sys
    import numpy, zstandard
    from edgepack.format.delta import apply_delta
    if sys.argv[1] == "apply":
        apply_delta(sys.argv[2], sys.argv[3], sys.argv[4])
    status = open("/proc/self/status").read()
    print(int(status.split("VmHWM:")[1].split()[0]) * 1024)
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_patch_memory_is_bounded(tmp_path: Path) -> None:
    """One 64 MB tensor, changed: patch's peak RSS stays well under the tensor's size."""
    rng = np.random.default_rng(11)
    rows, cols = 4096, 16384  # int8: 64 MiB of codes
    w = rng.standard_normal((rows, cols), dtype=np.float32)
    old = write_spec(tmp_path / "old.epk", ModelSpec([TensorSpec("big", Encoding.INT8_CHANNEL, w)]))
    w[: rows // 2] += 0.02 * rng.standard_normal((rows // 2, cols), dtype=np.float32)
    new = write_spec(tmp_path / "new.epk", ModelSpec([TensorSpec("big", Encoding.INT8_CHANNEL, w)]))
    del w
    create_delta(old, new, tmp_path / "d.epkd", options=DeltaOptions(level=3, verify=False))
    script = tmp_path / "measure.py"
    script.write_text(_MEASURE)

    def peak(*args: str) -> int:
        out = subprocess.run(
            [sys.executable, str(script), *args], check=True, capture_output=True, text=True
        )
        return int(out.stdout.strip().splitlines()[-1])

    baseline = peak("idle")
    used = peak("apply", str(old), str(tmp_path / "d.epkd"), str(tmp_path / "out.epk")) - baseline
    assert (tmp_path / "out.epk").read_bytes() == new.read_bytes()
    tensor = rows * cols
    print(f"patch peak RSS {used / 2**20:.1f} MiB over a {baseline / 2**20:.0f} MiB baseline")
    assert used < tensor // 2, f"patch used {used / 2**20:.0f} MiB over baseline"


def test_output_next_to_target_and_atomic(pair, tmp_path: Path) -> None:
    """The temporary file lives next to the target; a failing patch removes it."""
    _, old, new, delta, _ = pair
    target_dir = tmp_path / "slot"
    target_dir.mkdir()
    seen = []
    import edgepack.format.delta.apply as apply_mod

    real = apply_mod._Runner.finish

    def spy(self):
        seen.extend(p.name for p in target_dir.iterdir())
        raise OSError("disk gone")

    apply_mod._Runner.finish = spy
    try:
        with pytest.raises(OSError):
            apply_delta(old, delta, target_dir / "model.epk")
    finally:
        apply_mod._Runner.finish = real
    assert len(seen) == 1 and seen[0].startswith(".model.epk.") and seen[0].endswith(".partial")
    assert list(target_dir.iterdir()) == []
    apply_delta(old, delta, target_dir / "model.epk")
    assert (target_dir / "model.epk").read_bytes() == new.read_bytes()
    assert os.listdir(target_dir) == ["model.epk"]


def test_patcher_imports_only_the_device_stack() -> None:
    """edgepack.format.delta runs on devices: no server, packager, CLI or click."""
    code = (
        "import sys, json, edgepack.format.delta;"
        "print(json.dumps(sorted(m for m in sys.modules if not m.startswith('_'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    import json

    loaded = set(json.loads(out.stdout))
    forbidden = ("edgepack.server", "edgepack.packager", "edgepack.cli", "click", "boto3", "rich")
    assert not [m for m in loaded for f in forbidden if m == f or m.startswith(f + ".")]


@pytest.mark.parametrize(
    "encoding", [Encoding.INT8_CHANNEL, Encoding.INT4_GROUP_SYM, Encoding.INT4_GROUP_ASYM]
)
def test_predictions_equal_the_reference_encoder(encoding: Encoding) -> None:
    """On finite weights, the patcher's predicted scales/zeros/codes are exactly what
    edgepack.format.codecs writes (spec section 4): re-encodes cost nothing."""
    from edgepack.format import codecs
    from edgepack.format.delta.predict import predict_codes, predict_part

    rng = np.random.default_rng(int(encoding))
    w = (rng.standard_normal((24, 64)) * 0.1).astype(np.float32)
    w[3, :5] = 0  # zero runs and an all-zero group
    w[5, :32] = 0
    if encoding == Encoding.INT8_CHANNEL:
        codes, scales = codecs.quantize_int8_channel(w)
        zeros, group = None, 0
    else:
        group = 32
        codes, scales, zeros = codecs.quantize_int4_group(
            w, group, encoding == Encoding.INT4_GROUP_SYM
        )
    assert predict_part(w, encoding, group, 1).tobytes() == scales.tobytes()
    if zeros is not None:
        assert predict_part(w, encoding, group, 2).tobytes() == zeros.tobytes()
    zb = zeros.tobytes() if zeros is not None else None
    assert predict_codes(w, encoding, group, scales.tobytes(), zb).tobytes() == codes.tobytes()


def test_factors_references_are_checked(pair) -> None:
    """A prediction may only use a FACTORS op that comes earlier and has its shape."""
    from dataclasses import replace

    from edgepack.format.delta.container import Codec, Op, Stream, validate

    _, _, _, delta, _ = pair
    with DeltaFile.open(delta) as df:
        h = df.header
    i, op = next((i, op) for i, op in enumerate(h.ops) if op.prediction is not None)
    rows, cols = op.prediction.rows, op.prediction.cols

    def with_factors(position: int, factor_cols: int):
        fop = Op(OpKind.FACTORS, 0, 0, stream=len(h.streams), rows=rows, cols=factor_cols, rank=2)
        stream = Stream(Codec.STORED, fop.factor_bytes, fop.factor_bytes)
        ops = list(h.ops)
        ops.insert(position, fop)
        j, k = ops.index(fop), ops.index(op)
        ops[k] = replace(op, prediction=replace(op.prediction, factors=j + 1))
        return replace(h, ops=tuple(ops), streams=(*h.streams, stream))

    validate(with_factors(i, cols))  # right before its user, right shape: fine
    for bad in (with_factors(i + 1, cols), with_factors(i, cols + 1)):
        with pytest.raises(CorruptDeltaError, match="not an earlier FACTORS op"):
            validate(bad)


# ----------------------------------------------------------------- rANS streams


def _rans_roundtrip(data: np.ndarray, lanes: int | None = None) -> bytes:
    from edgepack.format.delta.rans import RansDecoder
    from edgepack.server.delta.entropy import rans_encode

    blob = rans_encode(data, lanes)
    dec = RansDecoder(lambda off, n: blob[off : off + n], len(blob), data.size)
    out = b""
    while len(out) < data.size:
        out += dec.decode(1 << 12)
    dec.finish()
    assert out == data.tobytes()
    return blob


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40_000),
    spread=st.floats(0.05, 80.0),
    lanes=st.one_of(st.none(), st.integers(1, 300)),
    seed=st.integers(0, 2**32 - 1),
)
def test_rans_roundtrip_any_distribution(n: int, spread: float, lanes, seed: int) -> None:
    rng = np.random.default_rng(seed)
    data = np.clip(np.round(rng.standard_normal(n) * spread) + 128, 0, 255).astype(np.uint8)
    _rans_roundtrip(data, lanes)


def test_rans_lands_near_the_order0_entropy() -> None:
    """The reason rANS exists here: four near-equiprobable values and a rare tail (a
    sparse 4-bit residual's non-zero bytes) cost Huffman-based zstd ~6% over entropy."""
    import zstandard

    rng = np.random.default_rng(3)
    values = np.array([0x01, 0x10, 0x02, 0x20, 0x11, 0x22, 0x12, 0x21], np.uint8)
    p = np.array([0.247, 0.246, 0.238, 0.237, 0.011, 0.010, 0.0055, 0.0055])
    data = rng.choice(values, 400_000, p=p / p.sum())
    counts = np.bincount(data, minlength=256)
    q = counts[counts > 0] / data.size
    entropy = -(q * np.log2(q)).sum() * data.size / 8
    blob = _rans_roundtrip(data)
    zstd = len(zstandard.ZstdCompressor(level=19).compress(data.tobytes()))
    assert len(blob) < 1.005 * entropy + 600
    assert len(blob) < 0.97 * zstd


@pytest.mark.parametrize(
    "damage",
    ["lanes0", "table_sum", "table_order", "state_low", "word", "truncate", "stray_byte"],
)
def test_rans_damage_is_typed(damage: str) -> None:
    from edgepack.format.delta.rans import RansDecoder

    rng = np.random.default_rng(4)
    data = np.clip(np.round(rng.standard_normal(20_000) * 5) + 100, 0, 255).astype(np.uint8)
    blob = bytearray(_rans_roundtrip(data, lanes=8))
    k = int.from_bytes(blob[4:6], "little")
    states = 6 + 3 * k
    if damage == "lanes0":
        blob[0:4] = b"\0\0\0\0"
    elif damage == "table_sum":
        blob[7] ^= 1
    elif damage == "table_order":
        blob[6], blob[9] = blob[9], blob[6]
    elif damage == "state_low":
        blob[states + 2 : states + 4] = b"\0\0"
    elif damage == "word":
        blob[len(blob) // 2] ^= 0x40
    elif damage == "truncate":
        del blob[-2:]
    else:
        blob += b"\0"
    raw = bytes(blob)
    with pytest.raises(CorruptDeltaError):
        dec = RansDecoder(lambda off, n: raw[off : off + n], len(raw), data.size)
        out = b""
        while len(out) < data.size:
            out += dec.decode(1 << 12)
        dec.finish()
        assert out == data.tobytes()  # a flipped word that decodes "fine" must not get here


def test_directed_add_only_on_predicted_codes(pair, tmp_path: Path) -> None:
    """ADD_DIRECTED reads the rounding directions of a codes prediction: on any other op
    it means nothing, and a forged header using it elsewhere is refused while parsing."""
    from dataclasses import replace

    from deltafactory import rewrite_header

    _, old, _, delta, _ = pair
    with DeltaFile.open(delta) as df:
        h = df.header
    ops = list(h.ops)
    i = next(
        i
        for i, op in enumerate(ops)
        if op.kind == OpKind.DATA and op.combine == Combine.ADD and op.ref_kind == RefKind.BASE
    )
    ops[i] = replace(ops[i], combine=Combine.ADD_DIRECTED)
    (tmp_path / "bad.epkd").write_bytes(
        rewrite_header(delta.read_bytes(), replace(h, ops=tuple(ops)))
    )
    with pytest.raises(CorruptDeltaError, match="directed ADD"):
        apply_delta(old, tmp_path / "bad.epkd", tmp_path / "x.epk")
    assert not (tmp_path / "x.epk").exists()

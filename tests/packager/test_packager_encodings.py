"""int3 / int2 group encodings end to end: codecs (golden bits, packing, bounds), layout,
package round trip, and the runtime decoding them (numpy path, native per-op fallback)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from runtime_fixtures import convert_to, cosine, tiny_model_dir

import edgepack.runtime_shim as rt
from edgepack.format import Encoding, Package, PackageWriter, codecs
from edgepack.format.errors import EncodingError
from edgepack.format.layout import tensor_layout
from edgepack.packager.convert import required_operators
from edgepack.packager.encode import EncodingChoice, encode_tensor, parse_encoding
from edgepack.runtime_shim.capabilities import RUNTIME_OPERATORS

IDS = [int(i) for i in np.random.default_rng(0).integers(0, 288, 48)]
GROUPS = [
    Encoding.INT3_GROUP_SYM,
    Encoding.INT3_GROUP_ASYM,
    Encoding.INT2_GROUP_SYM,
    Encoding.INT2_GROUP_ASYM,
]


# ---------------------------------------------------------------- constants and layout
def test_encoding_properties() -> None:
    assert [e.bits for e in GROUPS] == [3, 3, 2, 2]
    assert all(e.is_group for e in GROUPS)
    assert [e.is_symmetric for e in GROUPS] == [True, False, True, False]
    assert Encoding.INT4_GROUP_SYM.bits == 4 and Encoding.INT8_CHANNEL.bits == 8
    assert Encoding.group(3, True) == Encoding.INT3_GROUP_SYM
    assert Encoding.group(2, False) == Encoding.INT2_GROUP_ASYM
    with pytest.raises(ValueError):
        Encoding.group(5, True)


@pytest.mark.parametrize("enc", GROUPS)
def test_layout_sizes(enc: Encoding) -> None:
    lay = tensor_layout(enc, (6, 64), 32)
    assert lay.codes.shape == (6, 64 * enc.bits // 8)
    assert lay.scales.shape == (6, 2)
    assert (lay.zeros is None) == enc.is_symmetric


def test_parse_encoding_labels() -> None:
    for text in ("int3-g32", "int3-g64-asym", "int2-g32", "int2-g128-asym", "int4-g32"):
        assert parse_encoding(text).label == text
    assert parse_encoding("int3-g32-sym").encoding == Encoding.INT3_GROUP_SYM


def test_decode_operators_declared() -> None:
    ops = dict(required_operators("llama", set(GROUPS)))
    for name in ("int3_group_sym", "int3_group_asym", "int2_group_sym", "int2_group_asym"):
        assert ops[f"decode.{name}"] == 1
        assert RUNTIME_OPERATORS[f"decode.{name}"] == 1


# ---------------------------------------------------------------- packing
def test_int3_bit_order_golden() -> None:
    # element i occupies bits [3i, 3i+3) of the little-endian stream
    q = np.array([[1, 2, 3, 4, 5, 6, 7, 0]], np.uint8)
    word = sum(int(v) << (3 * i) for i, v in enumerate(q[0]))
    packed = codecs.pack_codes(q, 3)
    assert packed.tolist() == [[word & 0xFF, (word >> 8) & 0xFF, word >> 16]]
    assert codecs.unpack_codes(packed, 3).tolist() == q.tolist()
    # a single 7 at position 2 straddles bytes 0 and 1: bits 6, 7 of byte 0 and bit 0 of byte 1
    one = np.zeros((1, 8), np.uint8)
    one[0, 2] = 7
    assert codecs.pack_codes(one, 3).tolist() == [[0xC0, 0x01, 0x00]]


def test_int2_bit_order_golden() -> None:
    q = np.array([[1, 2, 3, 0, 3, 3, 0, 1]], np.uint8)
    packed = codecs.pack_codes(q, 2)
    assert packed.tolist() == [[1 | 2 << 2 | 3 << 4, 3 | 3 << 2 | 1 << 6]]
    assert codecs.unpack_codes(packed, 2).tolist() == q.tolist()


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_pack_round_trip_random(bits: int) -> None:
    q = np.random.default_rng(bits).integers(0, 1 << bits, (5, 64)).astype(np.uint8)
    packed = codecs.pack_codes(q, bits)
    assert packed.shape == (5, 64 * bits // 8)
    assert np.array_equal(codecs.unpack_codes(packed, bits), q)
    if bits == 4:
        assert np.array_equal(packed, codecs.pack_nibbles(q))


def test_pack_rejects_bad_values() -> None:
    with pytest.raises(EncodingError, match=r"0\.\.7"):
        codecs.pack_codes(np.full((1, 8), 8, np.uint8), 3)
    with pytest.raises(EncodingError, match="divisible by 8"):
        codecs.pack_codes(np.zeros((1, 4), np.uint8), 3)
    with pytest.raises(EncodingError, match="4, 3 or 2"):
        codecs.pack_codes(np.zeros((1, 8), np.uint8), 5)


# ---------------------------------------------------------------- quantizers
def test_int3_sym_golden() -> None:
    # peak -8 -> d = f16(-8 / -4) = 2; codes = clip(rint(w / 2), -4, 3) + 4
    w = np.array([[-8, 1, 3, 5, 6, 7, -1, 0]], np.float32)
    codes, scales, mins = codecs.quantize_group(w, 3, 8, True)
    assert mins is None and scales.tolist() == [[2.0]]
    q = codecs.unpack_codes(codes, 3)
    # -4, 0 (0.5 ties to even), 2 (1.5), 2 (2.5), 3, 3 (3.5 -> 4 clipped), 0 (-0.5), 0
    assert (q.astype(int) - 4).tolist() == [[-4, 0, 2, 2, 3, 3, 0, 0]]
    deq = codecs.dequantize_group(codes, scales, None, 3, 8)
    assert deq.tolist() == [[-8, 0, 4, 4, 6, 6, 0, 0]]


def test_int2_asym_golden() -> None:
    # min -1, max 2: d = f16(3 / 3) = 1, m = -1; codes = clip(rint(w + 1), 0, 3)
    w = np.array([[-1, 0, 1, 2, 0.5, -0.5, 1.5, 0.25]], np.float32)
    codes, scales, mins = codecs.quantize_group(w, 2, 8, False)
    assert scales.tolist() == [[1.0]] and mins.tolist() == [[-1.0]]
    assert codecs.unpack_codes(codes, 2).tolist() == [[0, 1, 2, 3, 2, 0, 2, 1]]
    deq = codecs.dequantize_group(codes, scales, mins, 2, 8)
    assert deq.tolist() == [[-1, 0, 1, 2, 1, -1, 1, 0]]


def test_int2_sym_golden() -> None:
    # peak 4 -> d = f16(4 / -2) = -2; codes = clip(rint(w / -2), -2, 1) + 2
    w = np.array([[4, -2, 1, -1, 0, 3, -4, 2]], np.float32)
    codes, scales, _ = codecs.quantize_group(w, 2, 8, True)
    assert scales.tolist() == [[-2.0]]
    q = codecs.unpack_codes(codes, 2).astype(int) - 2
    assert q.tolist() == [[-2, 1, 0, 0, 0, -2, 1, -1]]


@pytest.mark.parametrize("symmetric", [True, False])
def test_bits4_is_the_int4_codec(symmetric: bool) -> None:
    w = np.random.default_rng(1).standard_normal((7, 96)).astype(np.float32)
    a = codecs.quantize_group(w, 4, 32, symmetric)
    b = codecs.quantize_int4_group(w, 32, symmetric)
    for x, y in zip(a, b, strict=True):
        assert (x is None and y is None) or np.array_equal(x, y)
    assert np.array_equal(
        codecs.dequantize_group(a[0], a[1], a[2], 4, 32),
        codecs.dequantize_int4_group(b[0], b[1], b[2], 32),
    )


@pytest.mark.parametrize("bits", [3, 2])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("g", [8, 32, 64])
def test_round_trip_bound(bits: int, symmetric: bool, g: int) -> None:
    rng = np.random.default_rng(bits * 100 + g)
    w = (rng.standard_normal((9, 128)) * rng.uniform(0.01, 10)).astype(np.float32)
    codes, scales, mins = codecs.quantize_group(w, bits, g, symmetric)
    deq = codecs.dequantize_group(codes, scales, mins, bits, g)
    d = np.abs(scales.astype(np.float32)).repeat(g, axis=1)
    err = np.abs(deq - w)
    if symmetric:  # the positive end of the grid is one step short of the peak
        bound = d * 1.001 + 1e-6
    else:
        bound = 0.5 * d * 1.01 + np.abs(w) * 2e-3 + 1e-6
    assert (err <= bound).all()
    # more bits never hurt on the same data
    c4, s4, m4 = codecs.quantize_group(w, 4, g, symmetric)
    e4 = np.abs(codecs.dequantize_group(c4, s4, m4, 4, g) - w).mean()
    assert e4 < err.mean()


def test_errors_name_the_width() -> None:
    w = np.full((1, 8), 1e6, np.float32)
    with pytest.raises(EncodingError, match="too large for int3"):
        codecs.quantize_group(w, 3, 8, True)
    with pytest.raises(EncodingError, match="int2 scales"):
        codecs.dequantize_group(
            np.zeros((1, 2), np.uint8), np.zeros((1, 2), np.float16), None, 2, 8
        )


# ---------------------------------------------------------------- packages and runtime
@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("encodings")


@pytest.mark.parametrize("encoding", ["int3-g32", "int3-g32-asym", "int2-g32", "int2-g64-asym"])
def test_package_round_trip_and_runtime(root: Path, encoding: str) -> None:
    src = tiny_model_dir(root)
    pkg = convert_to(root, src, encoding)
    choice = parse_encoding(encoding)
    with Package.open(pkg) as p:
        entry = p.entry("layers.0.attn_q.weight")
        assert entry.encoding == choice.encoding
        stored = p.tensor("layers.0.attn_q.weight")
        want = codecs.dequantize_group(
            stored.codes, stored.scales, stored.zeros, choice.encoding.bits, choice.group_size
        )
        assert np.array_equal(p.dequantize("layers.0.attn_q.weight"), want)
        assert p.verify().tensors_checked == len(p.header.tensors)
        ops = dict(p.header.required_operators)
        assert f"decode.{choice.encoding.name.lower()}" in ops
    # the runtime's float path over the packed weights == f32 weights decoded by the codecs
    decoded = root / f"decoded-{encoding}.epk"
    with (
        Package.open(pkg) as p,
        PackageWriter(
            decoded,
            p.header.identity,
            required_operators=required_operators("llama", {Encoding.F32}),
        ) as wr,
    ):
        for t in p.header.tensors:
            wr.add_tensor(t.name, Encoding.F32, p.dequantize(t.name))
        wr.finish()
    with rt.open(decoded, kv="float", kernels="numpy") as m:
        ref = m.logits(IDS)
    with rt.open(pkg, kv="float", kernels="numpy", activations="float") as m:
        out = m.logits(IDS)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    with rt.open(convert_to(root, src, "f32"), kv="float", kernels="numpy") as m:
        f32 = m.logits(IDS)
    assert cosine(f32, out) > 0.3  # random weights amplify low-bit noise


def _native_available() -> bool:
    from edgepack import native

    mod = native.load()
    return mod is not None and hasattr(mod, "linear_f32")


def src_identity(root: Path):
    with Package.open(convert_to(root, tiny_model_dir(root), "f32")) as ref:
        return ref.header.identity


def _mixed_package(root: Path) -> Path:
    """int4, int3 and int2 weights in one model (the native path binds only some)."""
    from edgepack.packager.importers import open_source

    src = open_source(tiny_model_dir(root))
    out = root / "mixed.epk"
    if out.exists():
        return out
    plan = {"attn_q": "int3-g32", "ffn_down": "int2-g32-asym", "attn_v": "int3-g64-asym"}
    choices = {}
    for t in src.tensors:
        kind = next((v for k, v in plan.items() if f".{k}." in t.name), "int4-g32")
        choices[t.name] = EncodingChoice(Encoding.F32) if len(t.shape) < 2 else parse_encoding(kind)
    ops = required_operators("llama", {c.encoding for c in choices.values()})
    with PackageWriter(out, src_identity(root), required_operators=ops) as wr:
        for t in src.tensors:
            choice = choices[t.name]
            e = encode_tensor(t.load(), choice, t.name)
            wr.add_tensor(
                t.name,
                choice.encoding,
                e.codes,
                e.scales,
                e.zeros,
                shape=e.shape,
                group_size=choice.group_size,
            )
        wr.finish()
    return out


def _mixed_logits(pkg: Path, kernels: str, activations: str) -> tuple[np.ndarray, list]:
    with rt.open(pkg, kv="float", kernels=kernels, activations=activations) as m:
        seq = m.new_sequence()
        prefill = m.forward(seq, IDS[:40], logits="all")
        steps = [m.forward(seq, [t]) for t in IDS[40:44]]
        lw = m.weights.layers[0]
        bound = [lw.q.native, lw.down.native, lw.v.native, lw.k.native]
        return np.concatenate([prefill, np.stack(steps)]), bound


@pytest.mark.skipif(not _native_available(), reason="no native runtime kernels")
@pytest.mark.parametrize("activations", ["float", "auto"])
def test_native_runs_int3_int2_as_widened_int4(root: Path, activations: str) -> None:
    pkg = _mixed_package(root)
    ref, _ = _mixed_logits(pkg, "numpy", activations)
    out, bound = _mixed_logits(pkg, "native", activations)
    q, down, v, _ = bound
    assert q.encoding == "int4_sym" and down.encoding == "int4_asym" and v.group == 64
    assert np.isfinite(out).all() and cosine(out, ref) > 0.999
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not _native_available(), reason="no native runtime kernels")
def test_native_falls_back_per_weight(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight the extension refuses stays on numpy; the others stay native."""
    from edgepack.runtime_shim.kernels import native_backend as kmod

    widen = kmod._native_codes

    def refuse_int3(p):
        if p.encoding.bits == 3:
            raise ValueError("no int3 kernel in this build")
        return widen(p)

    monkeypatch.setattr(kmod, "_native_codes", refuse_int3)
    pkg = _mixed_package(root)
    ref, _ = _mixed_logits(pkg, "numpy", "auto")
    out, (q, down, _, k) = _mixed_logits(pkg, "native", "auto")
    assert q is None and k is not None and down is not None
    assert np.isfinite(out).all() and cosine(out, ref) > 0.999

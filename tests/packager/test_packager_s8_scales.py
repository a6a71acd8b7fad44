"""8-bit group scales (the ``*_S8`` encodings): codec definition, layout, package round
trip, the runtime running them as their binary16 twins, damaged multipliers refused, and
the quantizers (RTN search, GPTQ) staying bit-exact with the decoder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from runtime_fixtures import convert_to, tiny_model_dir

import edgepack.runtime_shim as rt
from edgepack.format import Encoding, EncodingError, Package, codecs
from edgepack.format.errors import CorruptPackageError, EdgepackError
from edgepack.format.layout import tensor_layout
from edgepack.packager.convert import required_operators
from edgepack.packager.encode import encode_tensor, parse_encoding
from edgepack.packager.quantizers.gptq import gptq_quantize, output_error
from edgepack.packager.quantizers.rtn import decode, rtn_quantize
from edgepack.packager.recipe import QuantizeSpec, RecipeError, load_recipe
from edgepack.runtime_shim.capabilities import RUNTIME_OPERATORS

S8 = [e for e in Encoding if e.scale_bits == 8]
IDS = [int(i) for i in np.random.default_rng(0).integers(0, 288, 32)]


def test_encoding_properties_and_labels() -> None:
    assert len(S8) == 6 and all(e.is_group for e in S8)
    for e in S8:
        twin = e.base
        assert twin.scale_bits == 16 and twin.bits == e.bits
        assert twin.is_symmetric == e.is_symmetric
        assert Encoding.group(e.bits, e.is_symmetric, 8) == e
        label = parse_encoding(f"int{e.bits}-g32{'' if e.is_symmetric else '-asym'}-s8")
        assert label.encoding == e and label.label.endswith("-s8")
    assert Encoding.INT4_GROUP_SYM.base == Encoding.INT4_GROUP_SYM
    ops = dict(required_operators("llama", set(S8)))
    for e in S8:
        assert ops[f"decode.{e.name.lower()}"] == 1 == RUNTIME_OPERATORS[f"decode.{e.name.lower()}"]


def test_layout_is_a_row_multiplier_then_int8_per_group() -> None:
    lay = tensor_layout(Encoding.INT3_GROUP_ASYM_S8, (6, 128), 32)
    assert lay.codes.shape == (6, 48)
    assert lay.scales.dtype == np.uint8 and lay.scales.shape == (6, 4 + 4)
    assert lay.zeros == lay.scales
    assert tensor_layout(Encoding.INT4_GROUP_SYM_S8, (2, 64), 16).zeros is None


def test_snap_golden_and_expand() -> None:
    v = np.array([[2.54, -1.27, 0.0, 0.01], [0, 0, 0, 0]], np.float32)
    part, dec = codecs.snap_s8(v)
    a = part[:, :4].copy().view("<f4").ravel()
    assert a[0] == np.float32(2.54) / np.float32(127) and a[1] == 0
    q = part[:, 4:].view(np.int8)
    assert q[0].tolist() == [127, -64, 0, 0] and q[1].tolist() == [0, 0, 0, 0]
    assert np.array_equal(dec, (q.astype(np.float32) * a[:, None]).astype(np.float16))
    assert np.array_equal(codecs.expand_s8(part), dec)
    # within half a step of the multiplier (plus the binary16 rounding)
    assert np.all(np.abs(dec[0].astype(np.float32) - v[0]) <= a[0] / 2 + 2e-3)


@pytest.mark.parametrize("bad", [np.nan, np.inf, 1e6])
def test_expand_refuses_non_finite_scales(bad: float) -> None:
    part, _ = codecs.snap_s8(np.ones((3, 4), np.float32))
    part[1, :4] = np.array([bad], "<f4").view(np.uint8)
    with pytest.raises(EncodingError, match="row 1"):
        codecs.expand_s8(part)


@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("symmetric", [True, False])
def test_codec_matches_the_twin_up_to_scale_rounding(bits: int, symmetric: bool) -> None:
    rng = np.random.default_rng(bits)
    w = (rng.standard_normal((9, 512)) * rng.uniform(0.5, 2, (9, 1))).astype(np.float32)
    codes, scales, mins = codecs.quantize_group(w, bits, 32, symmetric, scale_bits=8)
    assert scales.shape == (9, 4 + 16) and (mins is None) == symmetric
    d, z = codecs.group_values(Encoding.group(bits, symmetric, 8), scales, mins)
    deq = codecs.dequantize_group(codes, d, z, bits, 32)
    # the definition: codes computed against the decoded 8-bit scales
    c16, s16, m16 = codecs.quantize_group(w, bits, 32, symmetric)
    twin = codecs.dequantize_group(c16, s16, m16, bits, 32)
    e8, e16 = np.abs(deq - w).mean(), np.abs(twin - w).mean()
    assert e8 <= e16 * 1.1, (e8, e16)
    bpw8 = (codes.nbytes + scales.nbytes + (0 if mins is None else mins.nbytes)) * 8 / w.size
    bpw16 = (c16.nbytes + s16.nbytes + (0 if m16 is None else m16.nbytes)) * 8 / w.size
    assert bpw8 < bpw16


def _hessian(cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4 * cols, cols)) * rng.uniform(0.1, 3, cols)
    x[:, :4] *= 8  # a few outlier channels
    return (x.T @ x / x.shape[0]).astype(np.float64)


@pytest.mark.parametrize(
    "label", ["int3-g32-s8", "int3-g16-asym-s8", "int4-g32-s8", "int2-g32-asym-s8"]
)
@pytest.mark.parametrize("act_order", [True, False])
def test_quantizers_are_bit_exact_with_the_decoder(label: str, act_order: bool) -> None:
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((48, 128)) * 0.05).astype(np.float32)
    h = _hessian(128, 1)
    choice = parse_encoding(label)
    enc, deq = gptq_quantize(w, h, choice, act_order=act_order)
    assert enc.scales.dtype == np.uint8
    assert np.array_equal(decode(enc), deq)
    enc_r, deq_r = rtn_quantize(w, choice, np.diag(h), search=True)
    assert np.array_equal(decode(enc_r), deq_r)
    # GPTQ still beats searched RTN, and 8-bit scales cost little against binary16 ones
    assert output_error(deq - w, h) < output_error(deq_r - w, h)
    twin = parse_encoding(label.removesuffix("-s8"))
    _, deq16 = gptq_quantize(w, h, twin, act_order=act_order)
    assert output_error(deq - w, h) < 1.15 * output_error(deq16 - w, h)


def test_recipe_kinds() -> None:
    labels = [c.label for c in QuantizeSpec().candidates()]
    assert "int3-g32-s8" in labels and "int4-g32-asym" in labels and "int3-g32-asym-s8" in labels
    spec = QuantizeSpec(encodings=("int3-asym-s8", "int2-s8"), group_sizes=(32,))
    assert [c.label for c in spec.candidates()] == ["int3-g32-asym-s8", "int2-g32-s8"]


def test_recipe_rejects_unknown_suffix(tmp_path: Path) -> None:
    p = tmp_path / "r.toml"
    p.write_text('[quantize]\nencodings = ["int3-s4"]\n')
    with pytest.raises(RecipeError, match="unknown encoding"):
        load_recipe(p)


# ---------------------------------------------------------------- packages and runtime
@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("s8")


@pytest.mark.parametrize("twin", ["int4-g32", "int3-g32-asym"])
def test_runtime_runs_s8_as_its_twin(root: Path, twin: str) -> None:
    src = tiny_model_dir(root)
    pkg = convert_to(root, src, f"{twin}-s8")
    name = "layers.0.attn_q.weight"
    with Package.open(pkg) as p:
        assert p.entry(name).encoding == parse_encoding(f"{twin}-s8").encoding
        stored = p.tensor(name)
        d, z = stored.group_values()
        want = codecs.dequantize_group(stored.codes, d, z, stored.encoding.bits, 32)
        assert np.array_equal(p.dequantize(name).reshape(want.shape), want)
        assert p.verify().tensors_checked == len(p.header.tensors)
    kernels = ["numpy"]
    from edgepack import native

    if native.load() is not None:
        kernels.append("native")
    outs = []
    for k in kernels:
        with rt.open(pkg, kv="float", kernels=k, activations="float") as m:
            q = m.weights.layers[0].q
            assert q.encoding == parse_encoding(twin).encoding  # runs as the twin
            assert np.array_equal(q.scales, d)
            outs.append(m.logits(IDS))
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], rtol=2e-3, atol=2e-3)


def test_damaged_multiplier_is_a_typed_error(root: Path, tmp_path: Path) -> None:
    pkg = convert_to(root, tiny_model_dir(root), "int4-g32-s8")
    name = "layers.1.ffn_up.weight"
    with Package.open(pkg) as p:
        span = p.entry(name).scales
    raw = bytearray(pkg.read_bytes())
    raw[span.offset : span.offset + 4] = np.array([np.inf], "<f4").tobytes()
    bad = tmp_path / "bad.epk"
    bad.write_bytes(bytes(raw))
    with pytest.raises(CorruptPackageError, match=name):  # hashes unchecked: values still refused
        rt.open(bad, verify="none")
    with Package.open(bad) as p, pytest.raises(EdgepackError):
        p.dequantize(name)
    with pytest.raises(EdgepackError):  # the default open verifies the hash first
        rt.open(bad)


def test_encode_tensor_uses_the_reference_codec() -> None:
    w = np.random.default_rng(3).standard_normal((8, 64)).astype(np.float32)
    e = encode_tensor(w, parse_encoding("int3-g16-s8"))
    codes, scales, mins = codecs.quantize_group(w, 3, 16, True, scale_bits=8)
    assert np.array_equal(e.codes, codes) and np.array_equal(e.scales, scales) and mins is None

"""The encoding registry (edgepack.format.encodings): every record is checked end to end,
so adding an encoding is one record plus its kernels and this file finds what is missing."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from edgepack.format import Encoding, EncodingError, ModelIdentity, Package, PackageWriter, codecs
from edgepack.format.encodings import (
    REGISTRY,
    EncodingInfo,
    Family,
    by_kind,
    by_label,
    by_operator,
    group_encoding,
    info,
)
from edgepack.format.layout import tensor_layout
from edgepack.packager.convert import required_operators
from edgepack.packager.encode import EncodingChoice, encode_tensor, parse_encoding
from edgepack.runtime_shim.capabilities import runtime_capabilities
from edgepack.runtime_shim.weights import decode_rows, quantized_linear

SPEC = Path(__file__).resolve().parents[2] / "spec" / "FORMAT.md"
DATA = [r for r in REGISTRY if not r.is_low_rank]
SHAPE = (6, 64)
# relative RMS error a round trip of N(0, 1) weights may have, by code bits (floats: none
# for f32, the float format's rounding otherwise)
MAX_REL_ERROR = {32: 0.0, 16: 4e-3, 8: 0.01, 4: 0.12, 3: 0.22, 2: 0.5}


def _id(rec: EncodingInfo) -> str:
    return rec.name


def test_one_record_per_encoding() -> None:
    assert [r.encoding for r in REGISTRY] == list(Encoding)
    assert len({r.kind for r in REGISTRY}) == len({r.operator for r in REGISTRY}) == len(REGISTRY)
    for e in Encoding:
        assert info(e) is info(int(e)) is e.info and e.info.encoding is e


@pytest.mark.parametrize("rec", REGISTRY, ids=_id)
def test_record_is_consistent(rec: EncodingInfo) -> None:
    e = rec.encoding
    assert (e.bits, e.is_symmetric, e.scale_bits, e.base) == (
        rec.bits,
        rec.symmetric,
        rec.scale_bits,
        rec.base,
    )
    assert by_kind(rec.kind) is rec and by_operator(rec.operator) is rec
    assert rec.operator == f"decode.{e.name.lower()}"
    if rec.is_group:
        assert rec.bits in codecs.GROUP_BITS and rec.scale_bits in (16, 8)
        assert group_encoding(rec.bits, rec.symmetric, rec.scale_bits) is e
        assert Encoding.group(rec.bits, rec.symmetric, rec.scale_bits) is e
        twin = rec.base.info
        assert (twin.bits, twin.symmetric, twin.scale_bits, twin.base) == (
            rec.bits,
            rec.symmetric,
            16,
            twin.encoding,
        )
    else:
        assert rec.scale_bits == 0 and rec.base is e
    assert e.is_float == (rec.family is Family.FLOAT)


@pytest.mark.parametrize("rec", DATA, ids=_id)
def test_label_round_trips(rec: EncodingInfo) -> None:
    for g in (16, 32, 128) if rec.is_group else (0,):
        label = rec.label(g)
        assert by_label(label) == (rec, g)
        choice = parse_encoding(label)
        assert choice == EncodingChoice(rec.encoding, g) and choice.label == label


def test_unknown_labels() -> None:
    for label in ("int4", "int5-g32", "int4-g32-s8-asym", "int8-g32", "int4-gx", "low_rank"):
        with pytest.raises(ValueError, match="unknown encoding"):
            parse_encoding(label)
    assert by_label("int4-g") is None and by_operator("decode.int9") is None
    with pytest.raises(ValueError, match="no group encoding"):
        group_encoding(5, True)


def test_every_operator_is_in_the_runtime_capabilities() -> None:
    caps = runtime_capabilities()
    required = dict(required_operators("llama", set(Encoding)))
    assert all(caps.operators.get(op) == v for op, v in required.items()), required
    assert caps.encodings == frozenset(int(e) for e in Encoding)


@pytest.mark.parametrize("rec", DATA, ids=_id)
def test_codec_round_trips(rec: EncodingInfo, tmp_path: Path) -> None:
    """Encode, lay out, write, read back and decode with each decoder: the reader, the
    runtime's row lookup (after binding) and the shared codec all give the same values,
    close to the input."""
    w = np.random.default_rng(rec.id).standard_normal(SHAPE).astype(np.float32)
    g = 32 if rec.is_group else 0
    enc = encode_tensor(w, EncodingChoice(rec.encoding, g))
    layout = tensor_layout(rec.encoding, SHAPE, g)
    parts = (enc.codes, enc.scales, enc.zeros)
    for part, want in zip(parts, (layout.codes, layout.scales, layout.zeros), strict=True):
        assert (part is None) == (want is None)
        if part is not None:
            assert part.dtype == want.dtype and part.shape == want.shape
    values = codecs.dequantize(rec.encoding, enc.codes, enc.scales, enc.zeros, g).reshape(SHAPE)
    err = np.sqrt(np.mean((values - w) ** 2) / np.mean(w**2))
    assert err <= MAX_REL_ERROR[rec.bits], err
    path = tmp_path / "one.epk"
    with PackageWriter(path, ModelIdentity("t", "1.0.0", "llama")) as pw:
        pw.add_tensor("w", rec.encoding, *parts, shape=SHAPE, group_size=g)
        pw.finish()
    with Package.open(path) as pkg:
        np.testing.assert_array_equal(pkg.dequantize("w"), values)
        stored = pkg.tensor("w")
        if rec.is_float:
            return
        views = (stored.codes, stored.scales, stored.zeros)
        lin = quantized_linear("w", rec.encoding, *SHAPE, *views, g)
        assert lin.encoding is rec.base
        rows = np.array([5, 0, 3])
        np.testing.assert_array_equal(decode_rows(lin, rows), values[rows])


def test_low_rank_has_no_parts() -> None:
    rec = Encoding.LOW_RANK.info
    assert rec.is_low_rank and rec.bits == 0 and tensor_layout(rec.encoding, SHAPE).codes is None
    with pytest.raises(EncodingError, match="factors"):
        codecs.dequantize(rec.encoding, np.zeros((1, 1), np.float32))


def test_spec_table_matches_the_registry() -> None:
    """spec/FORMAT.md section 5 lists every encoding with its id."""
    text = SPEC.read_text().split("## 5. Encodings", 1)[1]
    rows = dict(re.findall(r"^\| ([A-Z0-9_]+) \| (\d+) \|", text, re.M))
    assert {k: int(v) for k, v in rows.items()} == {r.name: r.id for r in REGISTRY}

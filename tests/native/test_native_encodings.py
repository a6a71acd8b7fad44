"""The C++ side's encodings come from the registry: native/src/encodings.h is what the
generator renders, and the built module accepts exactly the registry's native encodings,
by id and by name, with the registry's part layout."""

from __future__ import annotations

import numpy as np
import pytest

from edgepack.format.encodings import REGISTRY, EncodingInfo
from edgepack.format.layout import tensor_layout
from edgepack.native.gen_encodings import HEADER, api_name, render
from edgepack.packager.encode import EncodingChoice, encode_tensor

SHAPE = (4, 64)


def test_generated_header_is_current() -> None:
    assert HEADER.read_text() == render(), "run: python -m edgepack.native.gen_encodings"


def test_header_lists_every_native_encoding() -> None:
    text = render()
    for rec in REGISTRY:
        assert (f"{rec.native} = {rec.id}" in text) == bool(rec.native), rec.name


def _weight(k, rec: EncodingInfo, key):
    g = 32 if rec.is_group else 0
    w = np.random.default_rng(rec.id).standard_normal(SHAPE).astype(np.float32)
    enc = encode_tensor(w, EncodingChoice(rec.encoding, g))
    return k.Weight(enc.codes, enc.scales, enc.zeros, key, g)


@pytest.mark.parametrize("rec", [r for r in REGISTRY if not r.is_low_rank], ids=lambda r: r.name)
def test_native_module_takes_the_registry_encodings(rec: EncodingInfo) -> None:
    k = pytest.importorskip("edgepack.native._kernels")
    if not rec.native:
        with pytest.raises(ValueError, match="has no matmul kernel"):
            _weight(k, rec, rec.id)
        return
    g = 32 if rec.is_group else 0
    layout = tensor_layout(rec.encoding, SHAPE, g)
    parts = (layout.codes, layout.scales, layout.zeros)
    for key in (rec.id, api_name(rec)):
        w = _weight(k, rec, key)
        assert w.encoding == api_name(rec) and w.shape == SHAPE
        assert w.nbytes == sum(p.nbytes for p in parts if p is not None)


def test_native_module_refuses_unknown_names() -> None:
    k = pytest.importorskip("edgepack.native._kernels")
    codes = np.zeros(SHAPE, np.float32)
    with pytest.raises(ValueError, match="unknown weight encoding 'int9'"):
        k.Weight(codes, None, None, "int9", 0)
    assert k.Weight(codes, None, None, "float32", 0).encoding == "f32"

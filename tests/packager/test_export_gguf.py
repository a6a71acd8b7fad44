"""`export` to GGUF: every exported tensor decodes bit for bit to the package's own decode
(read back with gguf's reader and codecs, and with edgepack's GGUF importer), the
metadata imports back to the same config and tokenizer, and what GGUF cannot hold
exactly is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from runtime_fixtures import smollm2_package

from edgepack.format import Package, SectionKind
from edgepack.format.errors import OutputPathError
from edgepack.packager.convert import convert
from edgepack.packager.errors import UnexportableError
from edgepack.packager.export_gguf import export_gguf
from edgepack.packager.importers import open_source
from edgepack.packager.importers.names import gguf_from_canonical, permute_qk
from edgepack.packager.importers.synthetic import (
    TinyLlamaSpec,
    tiny_llama_weights,
    write_gguf_llama,
)

Q = gguf.GGMLQuantizationType
SPEC = TinyLlamaSpec()
# encoding -> the GGUF type its 2-D weights export as
EXPORTABLE = {
    "f32": Q.F32,
    "f16": Q.F16,
    "bf16": Q.BF16,
    "int4-g32": Q.Q4_0,
    "int4-g64": Q.Q4_0,
    "int4-g32-asym": Q.Q4_1,
    "int4-g32-s8": Q.Q4_0,
    "int4-g32-asym-s8": Q.Q4_1,
}
REFUSED = {"int3-g32": "int3-g32", "int2-g32-asym": "int2-g32-asym", "int4-g16": "int4-g16"}


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def _f16_exact_rows(w: np.ndarray) -> np.ndarray:
    """``w`` with every row's max |value| set to 127 * 2^-7, so int8's row scale
    ``max / 127`` is 2^-7: a binary16 value (Q8_0 holds it exactly)."""
    peak = np.float32(127 * 2.0**-7)
    out = (w / np.abs(w).max(axis=1, keepdims=True) * peak * np.float32(0.99)).astype(np.float32)
    out[np.arange(len(out)), np.abs(w).argmax(axis=1)] = peak
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("src") / "tiny.gguf"
    write_gguf_llama(path, SPEC, tiny_llama_weights(SPEC))
    return path


@pytest.fixture(scope="module")
def int8_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("src8") / "tiny8.gguf"
    weights = tiny_llama_weights(SPEC)
    weights = {n: _f16_exact_rows(w) if w.ndim == 2 else w for n, w in weights.items()}
    write_gguf_llama(path, SPEC, weights)
    return path


def _package(src: Path, root: Path, encoding: str, embedding: str | None = "same") -> Path:
    """``src`` converted to ``encoding``, the embedding and head too unless ``embedding``
    is None (convert's default: int8 for group encodings)."""
    out = root / f"{encoding}-{embedding}.epk"
    if not out.exists():
        embedding = encoding if embedding == "same" else embedding
        convert(src, out, encoding=encoding, embedding_encoding=embedding)
    return out


def check_round_trip(pkg_path: Path, gguf_path: Path) -> dict[str, Q]:
    """Every tensor of the export decodes to the package's values, bit for bit, both with
    gguf's codecs (in llama.cpp's Q/K row order) and through edgepack's importer; returns
    the GGUF type of each tensor."""
    reader = gguf.GGUFReader(gguf_path)
    by_name = {t.name: t for t in reader.tensors}
    imported = {t.name: t for t in open_source(gguf_path).tensors}
    types = {}
    with Package.open(pkg_path) as pkg:
        cfg = pkg.header.identity.config
        assert len(by_name) == len(pkg.header.tensors)
        for entry in pkg.header.tensors:
            ours = pkg.dequantize(entry.name).reshape(entry.shape)
            t = by_name[gguf_from_canonical(entry.name)]
            got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(entry.shape)
            heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
            role = entry.name.split(".")[-2]
            want = permute_qk(ours, heads[role]) if role in heads else ours
            assert np.array_equal(_bits(got), _bits(want)), entry.name
            back = imported[entry.name].load()
            assert np.array_equal(_bits(back), _bits(ours)), entry.name
            types[entry.name] = t.tensor_type
    return types


@pytest.mark.parametrize("encoding", sorted(EXPORTABLE))
def test_exportable_encodings_round_trip_bit_for_bit(tiny_gguf, tmp_path, encoding):
    pkg = _package(tiny_gguf, tmp_path, encoding)
    out = tmp_path / "out.gguf"
    report = export_gguf(pkg, out)
    types = check_round_trip(pkg, out)
    assert types["layers.0.ffn_up.weight"] == EXPORTABLE[encoding]
    assert report.tensors == len(types) and report.bytes_written == out.stat().st_size
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_int8_exports_as_q8_0_when_row_scales_are_binary16(int8_gguf, tmp_path):
    pkg = _package(int8_gguf, tmp_path, "int8")
    out = tmp_path / "int8.gguf"
    export_gguf(pkg, out)
    assert check_round_trip(pkg, out)["layers.1.attn_v.weight"] == Q.Q8_0


def test_int8_with_float32_row_scales_is_refused(tiny_gguf, tmp_path):
    pkg = _package(tiny_gguf, tmp_path, "int8")
    with pytest.raises(UnexportableError, match=r"tensor '.+' is int8, .*not a binary16 value"):
        export_gguf(pkg, tmp_path / "x.gguf")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*partial"))


def test_int4_with_convert_default_int8_embedding_names_the_embedding(tiny_gguf, tmp_path):
    pkg = _package(tiny_gguf, tmp_path, "int4-g32", embedding=None)
    with pytest.raises(UnexportableError, match=r"^tensor 'embed.weight' is int8, "):
        export_gguf(pkg, tmp_path / "x.gguf")


@pytest.mark.parametrize("encoding", sorted(REFUSED))
def test_inexact_encodings_are_refused_naming_tensor_and_encoding(tiny_gguf, tmp_path, encoding):
    pkg = _package(tiny_gguf, tmp_path, encoding)
    with pytest.raises(UnexportableError) as info:
        export_gguf(pkg, tmp_path / "x.gguf")
    message = str(info.value)
    assert "\n" not in message and f"is {REFUSED[encoding]}," in message
    assert "exportable: " in message and "Q4_0" in message
    assert not (tmp_path / "x.gguf").exists()


def test_metadata_imports_back_to_the_same_config_and_tokenizer(tiny_gguf, tmp_path):
    pkg = _package(tiny_gguf, tmp_path, "int4-g32")
    out = tmp_path / "out.gguf"
    export_gguf(pkg, out)
    back = open_source(out)
    with Package.open(pkg) as p:
        cfg = p.header.identity.config
        tok = p.section(SectionKind.TOKENIZER).decode()
        chat = p.section(SectionKind.CHAT_TEMPLATE).decode()
        name = p.header.identity.name
    same = {k: v for k, v in cfg.items() if k != "source_config"}
    assert {k: back.config[k] for k in same} == same
    assert json.loads(back.tokenizer_json) == json.loads(tok)
    assert back.chat_template == chat and back.name == name
    meta = back.config["source_config"]
    assert meta["general.architecture"] == "llama"
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "smollm"


def test_output_rules(tiny_gguf, tmp_path):
    pkg = _package(tiny_gguf, tmp_path, "f16")
    out = tmp_path / "out.gguf"
    out.write_bytes(b"keep")
    with pytest.raises(OutputPathError, match="--force"):
        export_gguf(pkg, out)
    assert out.read_bytes() == b"keep"
    with pytest.raises(OutputPathError, match="is the input"):
        export_gguf(pkg, pkg, overwrite=True)
    export_gguf(pkg, out, overwrite=True)
    assert out.read_bytes()[:4] == b"GGUF"


def test_smollm2_sample_round_trips(smollm2_gguf, tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2-export")
    pkg = smollm2_package(smollm2_gguf, root, "int4-g32-asym")
    out = root / "smollm2.gguf"
    report = export_gguf(pkg, out)
    types = check_round_trip(pkg, out)
    assert types["layers.0.ffn_up.weight"] == Q.Q4_1
    assert report.gguf_types.get("Q4_1", 0) > 0
    back = open_source(out)
    with Package.open(pkg) as p:
        assert json.loads(back.tokenizer_json) == json.loads(p.section(SectionKind.TOKENIZER))


def test_models_llama_cpp_llama_cannot_describe_are_refused(tmp_path):
    from edgepack.packager.importers.synthetic import write_hf_llama

    qwen = TinyLlamaSpec(model_type="qwen2")
    write_gguf_llama(tmp_path / "qwen.gguf", qwen, tiny_llama_weights(qwen))
    pkg = _package(tmp_path / "qwen.gguf", tmp_path, "f16")
    with pytest.raises(UnexportableError, match=r"is a qwen2 model; export writes llama\.cpp"):
        export_gguf(pkg, tmp_path / "q.gguf")
    write_hf_llama(tmp_path / "hf", SPEC)  # no tokenizer.json
    bare = tmp_path / "bare.epk"
    convert(tmp_path / "hf", bare, encoding="f16")
    with pytest.raises(UnexportableError, match=r"has no tokenizer, which llama\.cpp needs"):
        export_gguf(bare, tmp_path / "b.gguf")
    assert not list(tmp_path.glob("*.gguf.*")) and not (tmp_path / "b.gguf").exists()

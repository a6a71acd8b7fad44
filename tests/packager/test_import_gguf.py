"""Importing GGUF: canonical names, Q/K un-permutation, quant types, SmolLM2, bad files."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from edgepack.packager.errors import ImportModelError
from edgepack.packager.importers import open_source
from edgepack.packager.importers.names import (
    canonical_from_gguf,
    canonical_from_hf,
    permute_qk,
    unpermute_qk,
)
from edgepack.packager.importers.synthetic import TinyLlamaSpec, write_gguf_llama, write_hf_llama

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers must never reach for a hub
Q = gguf.GGMLQuantizationType
QTYPES = {
    "token_embd.weight": Q.Q8_0,
    "blk.0.attn_q.weight": Q.Q8_0,
    "blk.0.attn_k.weight": Q.Q4_0,
    "blk.0.attn_v.weight": Q.Q4_1,
    "blk.0.ffn_gate.weight": Q.Q5_0,
    "blk.0.ffn_up.weight": Q.Q5_1,
    "blk.0.ffn_down.weight": Q.F16,
    "blk.1.attn_output.weight": Q.BF16,
    "output.weight": Q.Q8_0,
}  # everything else (incl. blk.1 Q/K) stays F32: those must round-trip exactly


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Literal copy of convert_hf_to_gguf.py's ``LlamaModel.permute``."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _roundtrip(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """What llama.cpp's own codec gives back for ``w`` (blocks run along rows)."""
    if qtype == Q.F32:
        return w
    if qtype == Q.F16:
        return w.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)


@pytest.fixture
def pair(tmp_path: Path):
    spec = TinyLlamaSpec()
    weights = write_hf_llama(tmp_path / "hf", spec, shards=2)
    write_gguf_llama(tmp_path / "tiny.gguf", spec, weights, QTYPES)
    return spec, weights, tmp_path / "hf", tmp_path / "tiny.gguf"


@pytest.mark.parametrize("rows,n_head", [(64, 4), (32, 2), (576, 9), (192, 3)])
def test_permutation_matches_llama_cpp_and_inverts(rows: int, n_head: int) -> None:
    w = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    np.testing.assert_array_equal(permute_qk(w, n_head), _llama_cpp_permute(w, n_head))
    np.testing.assert_array_equal(unpermute_qk(_llama_cpp_permute(w, n_head), n_head), w)
    bias = np.arange(rows, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_qk(_llama_cpp_permute(bias, n_head), n_head), bias)
    assert not np.array_equal(_llama_cpp_permute(w, n_head), w)


def test_gguf_and_hf_import_to_the_same_model(pair) -> None:
    _, weights, hf_dir, gguf_path = pair
    hf, gg = open_source(hf_dir), open_source(gguf_path)
    assert gg.architecture == hf.architecture == "llama"
    assert gg.tensor_names == hf.tensor_names  # same names, same order
    for name, w in weights.items():
        canonical = canonical_from_hf(name)
        tensor = gg.tensor(canonical)
        assert tensor.shape == w.shape
        value = tensor.load()
        assert value.dtype == np.float32 and value.flags.c_contiguous and value.flags.writeable
        gguf_name = (
            next(k for k in QTYPES if _same(k, canonical)) if _quantized(canonical) else None
        )
        qtype = QTYPES[gguf_name] if gguf_name else Q.F32
        assert tensor.source_dtype == qtype.name
        # exact against llama.cpp's codec on the HF-layout rows: proves the un-permutation
        np.testing.assert_array_equal(value, _roundtrip(w, qtype), err_msg=canonical)
        if qtype == Q.F32:
            np.testing.assert_array_equal(value, hf.tensor(canonical).load())
        else:  # and close to the original within the format's tolerance
            tol = {Q.Q4_0: 0.08, Q.Q4_1: 0.05, Q.Q5_0: 0.04, Q.Q5_1: 0.03}.get(qtype, 0.01)
            np.testing.assert_allclose(value, w, atol=tol, err_msg=canonical)


def _quantized(canonical: str) -> bool:
    return any(_same(k, canonical) for k in QTYPES)


def _same(gguf_name: str, canonical: str) -> bool:
    return canonical_from_gguf(gguf_name) == canonical


def test_permuted_q_k_rows_differ_in_the_file(pair) -> None:
    """The GGUF really holds llama.cpp's row order, so the un-permutation is exercised."""
    _, weights, _, gguf_path = pair
    reader = gguf.GGUFReader(gguf_path)
    raw = {t.name: t for t in reader.tensors}
    q_file = np.array(raw["blk.1.attn_q.weight"].data)
    q_hf = weights["model.layers.1.self_attn.q_proj.weight"]
    assert not np.array_equal(q_file, q_hf)
    np.testing.assert_array_equal(q_file, _llama_cpp_permute(q_hf, 4))
    k_file = np.array(raw["blk.1.attn_k.weight"].data)
    np.testing.assert_array_equal(
        k_file, _llama_cpp_permute(weights["model.layers.1.self_attn.k_proj.weight"], 2)
    )


def test_gguf_config_matches_hf_config(pair) -> None:
    _, _, hf_dir, gguf_path = pair
    hf, gg = open_source(hf_dir).config, open_source(gguf_path).config
    keys = [
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_theta",
        "rope_scaling", "max_position_embeddings", "tie_word_embeddings", "attention_bias",
        "bos_token_id", "eos_token_id", "family",
    ]  # fmt: skip
    assert {k: gg[k] for k in keys} == {k: hf[k] for k in keys}
    assert gg["source_config"]["general.architecture"] == "llama"
    assert "tokenizer.ggml.tokens" not in gg["source_config"]


def test_gguf_metadata_extras(pair) -> None:
    _, _, _, gguf_path = pair
    model = open_source(gguf_path)
    assert model.chat_template is not None and "<|im_start|>" in model.chat_template
    assert model.tokenizer_json is not None
    assert model.source_files == [gguf_path]
    assert model.source_sha256 == hashlib.sha256(gguf_path.read_bytes()).hexdigest()


def test_qwen2_gguf_is_not_unpermuted(tmp_path: Path) -> None:
    spec = TinyLlamaSpec(model_type="qwen2", attention_bias=True, tie_word_embeddings=True)
    weights = write_hf_llama(tmp_path / "hf", spec)
    write_gguf_llama(tmp_path / "q.gguf", spec, weights)
    hf, gg = open_source(tmp_path / "hf"), open_source(tmp_path / "q.gguf")
    assert gg.config["family"] == "qwen2" and gg.config["attention_bias"] is True
    assert gg.tensor_names == hf.tensor_names and "output.weight" not in gg.tensor_names
    for tensor in hf.tensors:
        np.testing.assert_array_equal(gg.tensor(tensor.name).load(), tensor.load())


def test_llama_bias_is_unpermuted_too(tmp_path: Path) -> None:
    spec = TinyLlamaSpec(attention_bias=True)
    weights = write_hf_llama(tmp_path / "hf", spec)
    write_gguf_llama(tmp_path / "b.gguf", spec, weights)
    gg = open_source(tmp_path / "b.gguf")
    for part, hf_part in (("q", "q_proj"), ("k", "k_proj")):
        expected = weights[f"model.layers.0.self_attn.{hf_part}.bias"]
        np.testing.assert_array_equal(gg.tensor(f"layers.0.attn_{part}.bias").load(), expected)


def test_unknown_tensor_keeps_source_name(tmp_path: Path) -> None:
    spec = TinyLlamaSpec()
    weights = write_hf_llama(tmp_path / "hf", spec)
    freqs = np.linspace(1, 2, 8, dtype=np.float32)
    write_gguf_llama(tmp_path / "u.gguf", spec, weights, extra={"rope_freqs.weight": freqs})
    model = open_source(tmp_path / "u.gguf")
    assert model.tensor_names[-1] == "rope_freqs.weight"
    np.testing.assert_array_equal(model.tensor("rope_freqs.weight").load(), freqs)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random scale bytes make inf/NaN
def test_every_dequantizable_type_imports(tmp_path: Path) -> None:
    """Each type gguf can dequantize loads; types it cannot are refused at open time."""
    rng = np.random.default_rng(1)
    writer = gguf.GGUFWriter(str(tmp_path / "types.gguf"), "bert")
    expected = {}
    for qtype in Q:
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        cols = 256 if block > 1 else 8
        if qtype in (Q.F32, Q.F16, Q.F64, Q.I8, Q.I16, Q.I32, Q.I64):
            dtypes = {Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64, Q.I8: np.int8,
                      Q.I16: np.int16, Q.I32: np.int32, Q.I64: np.int64}  # fmt: skip
            data = (rng.standard_normal((2, cols)) * 10).astype(dtypes[qtype])
            writer.add_tensor(qtype.name, data)
            expected[qtype.name] = data.astype(np.float32)
            continue
        raw = rng.integers(0, 256, size=(2, cols // block * type_size), dtype=np.uint8)
        if qtype == Q.BF16:
            raw = np.zeros_like(raw)
        try:
            ref = gguf.quants.dequantize(raw, qtype)
        except NotImplementedError:
            continue  # checked below with its own file
        writer.add_tensor(qtype.name, raw, raw_dtype=qtype)
        expected[qtype.name] = ref
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model = open_source(tmp_path / "types.gguf")
    assert model.architecture == "bert"  # non-Llama: source names, no un-permutation
    assert len(expected) >= 25
    for tensor in model.tensors:
        np.testing.assert_array_equal(tensor.load(), expected[tensor.name], err_msg=tensor.name)
        assert tensor.source_dtype == tensor.name


def test_undequantizable_type_is_an_import_error(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "q81.gguf"), "bert")
    _, type_size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, type_size), np.uint8), raw_dtype=Q.Q8_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ImportModelError, match="Q8_1"):
        open_source(tmp_path / "q81.gguf")


@pytest.mark.parametrize("keep", [0, 3, 4, 10, 24, 100, 1000, -1, -100])
def test_truncated_gguf_is_an_import_error(pair, tmp_path: Path, keep: int) -> None:
    data = pair[3].read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:keep])
    with pytest.raises(ImportModelError):
        open_source(bad)


def test_corrupt_gguf_is_an_import_error(pair, tmp_path: Path) -> None:
    data = bytearray(pair[3].read_bytes())
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + data[4:])
    with pytest.raises(ImportModelError, match="magic"):
        open_source(bad)
    rng = np.random.default_rng(7)
    for _ in range(30):  # random damage to the header region: never a raw exception
        damaged = bytearray(data)
        for pos in rng.integers(4, 2000, size=8):
            damaged[pos] = int(rng.integers(0, 256))
        bad.write_bytes(bytes(damaged))
        try:
            model = open_source(bad)
        except ImportModelError:
            continue
        for tensor in model.tensors:  # a header that still parses must load or refuse cleanly
            try:
                tensor.load()
            except ImportModelError:
                pass


# --- SmolLM2-135M-Instruct (real weights) -----------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path):
    return open_source(smollm2_gguf)


def test_smollm2_structure_and_config(smollm2) -> None:
    assert smollm2.architecture == "llama"
    assert len(smollm2.tensors) == 272  # 30 layers x 9 + embed + norm, output tied
    cfg = smollm2.config
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["intermediate_size"] == 1536 and cfg["vocab_size"] == 49152
    assert cfg["tie_word_embeddings"] is True and "output.weight" not in smollm2.tensor_names
    assert cfg["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["max_position_embeddings"] == 8192 and cfg["rope_scaling"] is None
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert cfg["family"] == "llama" and cfg["variant"] == "smollm2"
    assert smollm2.tensor("embed.weight").shape == (49152, 576)
    assert smollm2.tensor("layers.29.attn_k.weight").shape == (192, 576)
    assert smollm2.tensor("layers.0.ffn_down.weight").shape == (576, 1536)
    dtypes = {t.source_dtype for t in smollm2.tensors}
    assert dtypes == {"Q4_1", "Q8_0", "F32"}
    assert "<|im_start|>" in smollm2.chat_template


def test_smollm2_values_equal_gguf_dequantize(smollm2, smollm2_gguf: Path) -> None:
    reader = gguf.GGUFReader(smollm2_gguf)
    raw = {t.name: t for t in reader.tensors}
    checks = {
        "token_embd.weight": ("embed.weight", None),
        "blk.0.attn_q.weight": ("layers.0.attn_q.weight", 9),
        "blk.0.attn_k.weight": ("layers.0.attn_k.weight", 3),
        "blk.17.attn_q.weight": ("layers.17.attn_q.weight", 9),
        "blk.29.attn_k.weight": ("layers.29.attn_k.weight", 3),
        "blk.3.attn_v.weight": ("layers.3.attn_v.weight", None),
        "blk.3.ffn_down.weight": ("layers.3.ffn_down.weight", None),
        "output_norm.weight": ("norm.weight", None),
    }
    for gguf_name, (canonical, heads) in checks.items():
        t = raw[gguf_name]
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(smollm2.tensor(canonical).shape)
        if heads is not None:
            ref = (
                ref.reshape(heads, ref.shape[0] // heads // 2, 2, -1)
                .swapaxes(1, 2)
                .reshape(ref.shape)
            )
        np.testing.assert_array_equal(smollm2.tensor(canonical).load(), ref, err_msg=canonical)


def _transformers_model(path: Path):
    pytest.importorskip("torch")
    pytest.importorskip("accelerate")  # transformers needs it for GGUF checkpoints
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.slow
def test_smollm2_qk_match_transformers_gguf_loader(smollm2, smollm2_gguf: Path) -> None:
    """transformers un-permutes llama.cpp's Q/K on its own: our layout must equal theirs."""
    model = _transformers_model(smollm2_gguf)
    for i in (0, 13, 29):
        attn = model.model.layers[i].self_attn
        for ours, theirs in (
            ("attn_q", attn.q_proj),
            ("attn_k", attn.k_proj),
            ("attn_v", attn.v_proj),
        ):
            ref = theirs.weight.detach().float().numpy()
            np.testing.assert_allclose(
                smollm2.tensor(f"layers.{i}.{ours}.weight").load(), ref, rtol=0, atol=1e-6
            )
    embed = model.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_allclose(smollm2.tensor("embed.weight").load(), embed, rtol=0, atol=1e-6)

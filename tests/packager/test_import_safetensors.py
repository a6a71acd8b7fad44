"""Importing HF safetensors: sharded folders, BF16, canonical names, MiniLM, bad files."""

from __future__ import annotations

import hashlib
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from edgepack.packager.errors import ImportModelError
from edgepack.packager.importers import open_source
from edgepack.packager.importers.names import canonical_from_hf
from edgepack.packager.importers.synthetic import TinyLlamaSpec, write_hf_llama, write_safetensors

BF16_NAME = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture
def sharded(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    folder = tmp_path / "tiny"
    weights = write_hf_llama(folder, TinyLlamaSpec(), shards=2, bf16=frozenset({BF16_NAME}))
    return folder, weights


def test_sharded_folder_canonical_names_shapes_values(sharded) -> None:
    folder, weights = sharded
    assert json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    model = open_source(folder)
    assert model.architecture == "llama"
    expected = {canonical_from_hf(n): w for n, w in weights.items()}
    assert set(model.tensor_names) == set(expected)
    assert model.tensor_names[0] == "embed.weight"
    assert model.tensor_names[-2:] == ["norm.weight", "output.weight"]
    assert "layers.1.attn_o.weight" in expected and "layers.0.ffn_gate.weight" in expected
    for tensor in model.tensors:
        value = tensor.load()
        assert value.dtype == np.float32 and value.flags.c_contiguous
        assert value.shape == tensor.shape == expected[tensor.name].shape
        np.testing.assert_array_equal(value, expected[tensor.name])
    assert model.tensor("layers.1.ffn_up.weight").source_dtype == "BF16"
    assert model.tensor("layers.0.attn_q.weight").shape == (64, 64)
    assert model.tensor("layers.0.attn_k.weight").shape == (32, 64)  # [out, in]


def test_bf16_is_widened_exactly(sharded) -> None:
    folder, weights = sharded
    value = open_source(folder).tensor("layers.1.ffn_up.weight").load()
    assert not np.array_equal(value, weights[BF16_NAME].view(np.uint32) * 0)  # non-trivial
    assert np.all(value.view(np.uint32) & 0xFFFF == 0)  # bf16 values have empty low halves
    np.testing.assert_array_equal(value, weights[BF16_NAME])


def test_llama_config_is_canonical(sharded) -> None:
    folder, _ = sharded
    cfg = open_source(folder).config
    assert cfg["hidden_size"] == 64 and cfg["intermediate_size"] == 128
    assert cfg["num_hidden_layers"] == 2
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert cfg["vocab_size"] == 272 and cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 1e4
    assert cfg["rope_scaling"] is None and cfg["max_position_embeddings"] == 512
    assert cfg["tie_word_embeddings"] is False and cfg["attention_bias"] is False
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert cfg["family"] == "llama" and cfg["source_config"]["model_type"] == "llama"


def test_source_files_and_sha256(sharded) -> None:
    folder, _ = sharded
    model = open_source(folder)
    names = sorted(p.name for p in model.source_files)
    assert names == sorted(
        [
            "config.json",
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        ]
    )
    manifest = "".join(
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n"
        for p in sorted(model.source_files, key=lambda p: p.name)
    )
    assert model.source_sha256 == hashlib.sha256(manifest.encode()).hexdigest()
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_theta"] = 20000.0
    (folder / "config.json").write_text(json.dumps(cfg))
    assert open_source(folder).source_sha256 != model.source_sha256


def test_qwen2_biases_and_tied_embeddings(tmp_path: Path) -> None:
    spec = TinyLlamaSpec(model_type="qwen2", attention_bias=True, tie_word_embeddings=True)
    weights = write_hf_llama(tmp_path, spec)
    model = open_source(tmp_path)
    assert model.architecture == "llama" and model.config["family"] == "qwen2"
    assert model.config["attention_bias"] is True and model.config["tie_word_embeddings"] is True
    assert "output.weight" not in model.tensor_names
    for i in range(2):
        for part in ("q", "k", "v"):
            name = f"layers.{i}.attn_{part}.bias"
            hf = f"model.layers.{i}.self_attn.{part}_proj.bias"
            np.testing.assert_array_equal(model.tensor(name).load(), weights[hf])
    assert model.tensor_names.index("layers.0.attn_q.bias") < model.tensor_names.index(
        "layers.0.attn_q.weight"
    )


def test_tied_lm_head_copy_is_dropped_and_unknown_names_kept(tmp_path: Path) -> None:
    spec = TinyLlamaSpec(tie_word_embeddings=True)
    inv_freq = np.arange(8, dtype=np.float32)
    extra = {
        "lm_head.weight": np.zeros((272, 64), np.float32),
        "model.layers.0.self_attn.rotary_emb.inv_freq": inv_freq,
    }
    write_hf_llama(tmp_path, spec, extra=extra)
    model = open_source(tmp_path)
    assert "output.weight" not in model.tensor_names
    unknown = model.tensor("model.layers.0.self_attn.rotary_emb.inv_freq")
    np.testing.assert_array_equal(unknown.load(), inv_freq)
    assert model.tensor_names[-1] == "model.layers.0.self_attn.rotary_emb.inv_freq"


def test_single_safetensors_file(sharded, tmp_path: Path) -> None:
    _, weights = sharded
    lone = tmp_path / "lone" / "weights.safetensors"
    lone.parent.mkdir()
    write_safetensors(lone, {"a.weight": weights["model.norm.weight"]})
    model = open_source(lone)
    assert model.architecture == "unknown" and model.tensor_names == ["a.weight"]
    assert model.source_sha256 == hashlib.sha256(lone.read_bytes()).hexdigest()
    # with a config.json beside it, the file is a Llama checkpoint
    one = tmp_path / "one"
    write_hf_llama(one, TinyLlamaSpec())
    assert open_source(one / "model.safetensors").tensor_names == open_source(one).tensor_names


def test_open_reads_no_weights(tmp_path: Path) -> None:
    spec = TinyLlamaSpec(hidden_size=512, intermediate_size=2048)
    weights = write_hf_llama(tmp_path, spec, shards=2)
    total = sum(w.nbytes for w in weights.values())
    open_source(tmp_path)  # warm up imports
    tracemalloc.start()
    try:
        model = open_source(tmp_path)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        model.tensor("layers.0.ffn_up.weight").load()
        _, load_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    up_bytes = 2048 * 512 * 4
    assert total > 30_000_000
    assert peak < 4 * 1024 * 1024  # headers and hashing buffers, never the weights
    assert load_peak < peak + 2 * up_bytes  # one tensor at a time


def test_minilm(minilm_dir: Path) -> None:
    model = open_source(minilm_dir)
    assert model.architecture == "bert"
    assert len(model.tensors) == 104
    assert (
        model.config["hidden_size"] == 384 and model.config["source_config"]["model_type"] == "bert"
    )
    assert model.tokenizer_json is not None and json.loads(model.tokenizer_json)["model"]["type"]
    assert {p.name for p in model.source_files} >= {"config.json", "model.safetensors"}
    with safe_open(str(minilm_dir / "model.safetensors"), framework="numpy") as ref:
        assert set(model.tensor_names) == set(ref.keys())  # BERT keeps its source names
        for tensor in model.tensors:
            expected = ref.get_tensor(tensor.name)
            assert tensor.shape == expected.shape
            np.testing.assert_array_equal(tensor.load(), expected.astype(np.float32))
    word = model.tensor("embeddings.word_embeddings.weight")
    assert word.shape == (30522, 384) and word.source_dtype == "F32"


def _corrupt(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda b: b[: len(b) // 2], id="truncated-data"),
        pytest.param(lambda b: b[:20], id="truncated-header"),
        pytest.param(lambda b: b[:5], id="shorter-than-length"),
        pytest.param(lambda b: b"", id="empty"),
        pytest.param(lambda b: b[:8] + b"{garbage" + b[16:], id="bad-json"),
        pytest.param(lambda b: (2**62).to_bytes(8, "little") + b[8:], id="huge-header"),
        pytest.param(lambda b: (len(b)).to_bytes(8, "little") + b[8:], id="header-past-end"),
    ],
)
def test_corrupt_safetensors_raise_import_error(sharded, tmp_path: Path, mutate) -> None:
    folder, _ = sharded
    good = (folder / "model-00001-of-00002.safetensors").read_bytes()
    bad = _corrupt(tmp_path / "bad.safetensors", mutate(good))
    with pytest.raises(ImportModelError):
        open_source(bad)
    shard = folder / "model-00001-of-00002.safetensors"
    shard.write_bytes(mutate(good))
    with pytest.raises(ImportModelError):
        open_source(folder)


def test_bad_folders_raise_import_error(sharded, tmp_path: Path) -> None:
    folder, _ = sharded
    with pytest.raises(ImportModelError, match="does not exist"):
        open_source(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImportModelError, match=r"config\.json"):
        open_source(tmp_path / "empty")
    index = folder / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    first = next(iter(doc["weight_map"]))
    doc["weight_map"][first] = "../escape.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(ImportModelError, match="outside"):
        open_source(folder)
    doc["weight_map"][first] = "model-00002-of-00002.safetensors"  # tensor not in that shard
    index.write_text(json.dumps(doc))
    with pytest.raises(ImportModelError, match="missing"):
        open_source(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ImportModelError, match=r"config\.json"):
        open_source(folder)
    with pytest.raises(ImportModelError, match="unsupported"):
        open_source(_corrupt(tmp_path / "model.bin", b"\0" * 16))

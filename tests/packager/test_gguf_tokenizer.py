"""The tokenizer rebuilt from GGUF metadata must encode exactly as the model's own.

References:
* transformers' GGUF tokenizer (an independent reader of the same vocab, merges and token
  types). It does not know llama.cpp's ``smollm`` pre-tokenizer and falls back to plain GPT-2
  splitting, so its pre-tokenizer is replaced by the one SmolLM2's published tokenizer.json
  has (``Digits(individual_digits)`` then ``ByteLevel``) before comparing.
* a direct transcription of llama.cpp's ``smollm`` split (``\\p{N}`` then the GPT-2 regex)
  with the ``regex`` module, checked against our pre-tokenizer piece by piece.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from runtime_fixtures import TRICKY_TEXTS as TRICKY
from tokenizers import Tokenizer, pre_tokenizers

from edgepack.packager.errors import ImportModelError
from edgepack.packager.importers import open_source
from edgepack.packager.importers.gguf_source import read_gguf_metadata
from edgepack.packager.importers.gguf_tokenizer import tokenizer_json_from_gguf

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers must never reach for a hub

def _corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf: Path) -> Tokenizer:
    model = open_source(smollm2_gguf)
    assert model.tokenizer_json is not None
    return Tokenizer.from_str(model.tokenizer_json)


@pytest.fixture(scope="module")
def reference(smollm2_gguf: Path) -> Tokenizer:
    """transformers' tokenizer for the same GGUF, with SmolLM2's published pre-tokenizer."""
    transformers = pytest.importorskip("transformers")
    try:
        hf = transformers.AutoTokenizer.from_pretrained(
            smollm2_gguf.parent, gguf_file=smollm2_gguf.name
        )
    except ImportError as exc:  # its GGUF reader needs torch
        pytest.skip(f"transformers cannot read GGUF here: {exc}")
    backend = hf.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    return backend


def test_smollm2_tokenizer_shape(smollm2_tokenizer: Tokenizer) -> None:
    doc = json.loads(smollm2_tokenizer.to_str())
    assert doc["model"]["type"] == "BPE" and len(doc["model"]["merges"]) == 48900
    assert smollm2_tokenizer.get_vocab_size() == 49152
    assert doc["pre_tokenizer"]["pretokenizers"][0] == {"type": "Digits", "individual_digits": True}
    specials = [t["content"] for t in doc["added_tokens"] if t["special"]]
    assert specials[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] and len(specials) == 17


def test_smollm2_encodes_identically_to_reference(smollm2_tokenizer, reference) -> None:
    corpus = _corpus()
    assert len(corpus) > 400_000
    ours = smollm2_tokenizer.encode(corpus).ids
    assert ours == reference.encode(corpus).ids
    assert len(ours) > 100_000
    for text in TRICKY:
        assert smollm2_tokenizer.encode(text).ids == reference.encode(text).ids, text
        pair = smollm2_tokenizer.encode(text, "second " + text).ids
        assert pair == reference.encode(text, "second " + text).ids
    batch = [line for line in corpus.splitlines() if line.strip()][:2000]
    assert [e.ids for e in smollm2_tokenizer.encode_batch(batch)] == [
        e.ids for e in reference.encode_batch(batch)
    ]


def _llama_cpp_smollm_split(text: str) -> list[str]:
    """llama.cpp ``LLAMA_VOCAB_PRE_TYPE_SMOLLM``: isolate each \\p{N}, then the GPT-2 regex."""
    regex = pytest.importorskip("regex")
    gpt2 = regex.compile(
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    )
    pieces = []
    for chunk in regex.split(r"(\p{N})", text):
        if chunk:
            pieces.extend(m.group(0) for m in gpt2.finditer(chunk))
    return pieces


def test_pre_tokenizer_follows_llama_cpp_smollm_split(smollm2_tokenizer: Tokenizer) -> None:
    from edgepack.packager.importers.gguf_tokenizer import _byte_alphabet

    decode = {ch: b for b, ch in enumerate(_byte_alphabet())}
    texts = [_corpus(), *TRICKY[:12]]
    for text in texts:
        pieces = smollm2_tokenizer.pre_tokenizer.pre_tokenize_str(text)
        ours = [bytes(decode[c] for c in piece).decode("utf-8") for piece, _ in pieces]
        assert ours == _llama_cpp_smollm_split(text)


def test_smollm2_specific_encodings(smollm2_tokenizer: Tokenizer) -> None:
    vocab = smollm2_tokenizer.get_vocab()
    # llama.cpp splits "  1" as "  " + "1": one double-space token, then the digit
    assert smollm2_tokenizer.encode("x  1").ids == [vocab["x"], vocab["ĠĠ"], vocab["1"]]
    chat = smollm2_tokenizer.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert chat[0] == 1 and chat[-1] == 2 and 1 not in chat[1:-1]
    assert smollm2_tokenizer.encode("hi").ids == [vocab["hi"]]  # add_bos_token is false
    corpus = _corpus()
    ids = smollm2_tokenizer.encode(corpus).ids
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == corpus


# --- synthetic GGUFs ---------------------------------------------------------------------


def _write_vocab_gguf(path: Path, kv: dict) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in kv.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_array(key, value)
    writer.add_tensor(
        "token_embd.weight", np.zeros((len(kv["tokenizer.ggml.tokens"]), 32), np.float32)
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _spm_vocab() -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    pieces = [
        "▁", "e", "t", "h", "o", "l", "w", "r", "d", "a", "n", "i", "s", "H",
        "▁t", "he", "▁the", "ll", "▁w", "or", "ld", "▁wor", "▁world", "in", "▁a", "an",
        "ello", "el", "lo", "▁H", "▁He", "▁Hello", "is", "▁is", "▁i", "on", "er",
    ]  # fmt: skip
    for rank, piece in enumerate(pieces):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    tokens.append("<|user|>")
    types.append(4)
    scores.append(0.0)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def test_sentencepiece_gguf_matches_transformers(tmp_path: Path) -> None:
    path = _write_vocab_gguf(tmp_path / "spm.gguf", _spm_vocab())
    meta = read_gguf_metadata(gguf.GGUFReader(path))
    ours = Tokenizer.from_str(tokenizer_json_from_gguf(meta))
    texts = [
        "Hello world",
        " the world is on",
        "Hello  world\n\nthe end",
        "héllo wörld 😀 ∑",
        "<s>the</s> <|user|>is",
        "tttthhhee",
        "",
    ]
    vocab = ours.get_vocab()
    assert ours.encode("the world").ids == [1, vocab["▁the"], vocab["▁world"]]
    assert ours.encode("é").ids == [1, vocab["▁"], vocab["<0xC3>"], vocab["<0xA9>"]]
    for text in texts[:-1]:
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False).endswith(text.strip())
    transformers = pytest.importorskip("transformers")
    try:
        hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    except ImportError as exc:
        pytest.skip(f"transformers cannot read GGUF here: {exc}")
    for text in texts:
        assert ours.encode(text).ids == hf(text)["input_ids"], text


def test_synthetic_bpe_respects_pre_and_specials(tmp_path: Path) -> None:
    from edgepack.packager.importers.synthetic import tiny_bpe_vocab

    tokens, types, merges = tiny_bpe_vocab()
    kv = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": True,
    }
    meta = read_gguf_metadata(gguf.GGUFReader(_write_vocab_gguf(tmp_path / "b.gguf", kv)))
    tok = Tokenizer.from_str(tokenizer_json_from_gguf(meta))
    vocab = tok.get_vocab()
    assert tok.encode(" the").ids == [1, vocab["Ġthe"]]
    assert tok.encode("<|im_end|>  1").ids == [1, 2, vocab["ĠĠ"], vocab["1"]]
    assert tok.encode("a", "b").ids == [1, vocab["a"], 1, vocab["b"]]
    for pre in ("gpt-2", "llama-bpe", "qwen2"):
        meta["tokenizer.ggml.pre"] = pre
        tok = Tokenizer.from_str(tokenizer_json_from_gguf(meta))
        assert tok.decode(tok.encode("x  12 the").ids) == "x  12 the"
    meta["tokenizer.ggml.pre"] = "gpt-2"
    plain = Tokenizer.from_str(tokenizer_json_from_gguf(meta))
    assert plain.encode("  1").ids == [1, vocab["Ġ"], vocab["Ġ"], vocab["1"]]  # GPT-2 regex


def test_unsupported_tokenizers_are_import_errors() -> None:
    base = {"tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": ["a b"]}
    with pytest.raises(ImportModelError, match="pre-tokenizer"):
        tokenizer_json_from_gguf(
            {**base, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "?"}
        )
    with pytest.raises(ImportModelError, match="tokenizer model"):
        tokenizer_json_from_gguf({**base, "tokenizer.ggml.model": "rwkv"})
    with pytest.raises(ImportModelError, match="merges"):
        tokenizer_json_from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ImportModelError, match="length"):
        tokenizer_json_from_gguf(
            {**base, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.token_type": [1]}
        )
    assert tokenizer_json_from_gguf({}) is None

"""A tokenizer that released its encoder decodes as the ``tokenizers`` library did (every
id, random runs with added tokens and split UTF-8, streaming) and encodes again on demand;
kinds it cannot mirror keep the library's tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from runtime_fixtures import TRICKY_TEXTS, smollm2_package

from edgepack.runtime_shim import open as open_model
from edgepack.runtime_shim.byte_decoder import ByteLevelDecoder
from edgepack.runtime_shim.tokenizer import Tokenizer, _byte_map

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def released(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    """SmolLM2's tokenizer with its encoder released, and the library's tokenizer it had."""
    pkg = smollm2_package(smollm2_gguf, tmp_path_factory.mktemp("smol"), "int8")
    with open_model(pkg, verify="none") as model:
        tok = model.tokenizer
        library = tok._impl.tk
        assert tok.release_encoder()
        yield tok, library


def test_every_id_and_random_runs_decode_as_the_library(released) -> None:
    tok, library = released
    assert not tok._impl.encodes  # the check itself is live
    n = tok.vocab_size
    for skip in (False, True):
        assert [tok.decode([i], skip) for i in range(n)] == library.decode_batch(
            [[i] for i in range(n)], skip_special_tokens=skip
        )
    rng = random.Random(7)
    for _ in range(2000):  # special ids (0..16) often: they split the byte runs
        ids = [rng.randrange(n) if rng.random() < 0.8 else rng.randrange(20) for _ in range(9)]
        for skip in (False, True):
            assert tok.decode(ids, skip) == library.decode(ids, skip_special_tokens=skip), ids


def test_streamed_text_is_the_librarys_and_encoding_comes_back(released) -> None:
    tok, library = released
    for text in TRICKY_TEXTS:
        ids = library.encode(text).ids
        stream = tok.stream()
        pieces = [stream.feed(i) for i in ids] + [stream.flush()]
        assert "".join(pieces) == library.decode(ids, skip_special_tokens=True)
    assert tok.encode(TRICKY_TEXTS[-1]) == library.encode(TRICKY_TEXTS[-1]).ids
    assert getattr(tok._impl, "encodes", True)  # built anew from the package


def test_other_decoders_and_other_sources_keep_the_librarys_tokenizer() -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    word_level = HFTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    assert ByteLevelDecoder.of(word_level, _byte_map()[1]) is None
    spec = {
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True},
    }
    assert not Tokenizer(spec, "tokenizers").release_encoder()  # no package to rebuild from


def test_gaps_and_characters_outside_the_byte_map() -> None:
    byte_of = _byte_map()[1]
    plain = ByteLevelDecoder(["a", "\u0120b", "\u00e9"], {0: ("<s>", True)}, byte_of)
    assert plain.decode([1, 2, 0, 1], skip=False) == " b\ufffd<s> b"  # é: byte 0xE9 alone
    assert plain.decode([1, 0, 1, 9], skip=True) == " b b"
    mixed = ByteLevelDecoder(["a", None, "\u0120b", "\u4e00x"], {}, byte_of)
    assert mixed.decode([0, 1, 2, 3], skip=False) == "a b\u4e00x"  # its UTF-8, as it is
    assert mixed.vocab_size == 4


def test_ids_containing_a_character_are_those_whose_text_holds_it(released) -> None:
    """The released table's byte scan finds what decoding every id finds, the library's
    tokenizer (the per-id path) the same; text it cannot scan takes that path too."""
    tok, library = released
    n = tok.vocab_size
    for char in ("\n", " ", "<", "."):
        expected = frozenset(i for i in range(n) if char in library.decode([i], False))
        assert expected and tok.ids_containing(char) == expected, char
    spaced = frozenset(i for i in range(n) if "\n\n" in library.decode([i], False))
    assert tok.ids_containing("\n\n") == spaced

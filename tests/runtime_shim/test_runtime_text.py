"""Tokenizer backends (tokenizers vs the built-in byte-level BPE), streaming
detokenization, chat template rendering (jinja2 vs the built-in ChatML renderer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runtime_fixtures import TRICKY_TEXTS as TRICKY
from runtime_fixtures import calibration_text

from edgepack.runtime_shim import ChatTemplateError
from edgepack.runtime_shim.chat import render_chat
from edgepack.runtime_shim.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smollm2_source(smollm2_gguf: Path):
    from edgepack.packager.importers import open_source

    return open_source(smollm2_gguf)


@pytest.fixture(scope="module")
def spec(smollm2_source) -> dict:
    return json.loads(smollm2_source.tokenizer_json)


@pytest.fixture(scope="module")
def both(spec: dict) -> tuple[Tokenizer, Tokenizer]:
    pytest.importorskip("tokenizers")
    return Tokenizer(spec, "tokenizers"), Tokenizer(spec, "python")


@pytest.mark.parametrize("text", TRICKY)
def test_python_bpe_encodes_like_tokenizers(both, text: str) -> None:
    hf, py = both
    assert hf.backend == "tokenizers" and py.backend == "python"
    assert py.encode(text) == hf.encode(text)
    ids = hf.encode(text)
    assert py.decode(ids) == hf.decode(ids)


def test_python_bpe_on_long_text(both) -> None:
    hf, py = both
    text = calibration_text()[:20000]
    ids = hf.encode(text)
    assert py.encode(text) == ids
    assert py.decode(ids) == hf.decode(ids) == text


def test_special_tokens(both) -> None:
    hf, py = both
    for tok in (hf, py):
        assert tok.token_to_id("<|im_end|>") == 2 and tok.is_special(2)
        assert tok.decode([1, 2], skip_special_tokens=True) == ""
        assert tok.id_to_token(2) == "<|im_end|>"


def test_special_tokens_agree_with_the_json(both, spec: dict) -> None:
    """The stop ids come from the built tokenizer when there is one, else from the JSON:
    both sources must name the same special tokens."""
    from edgepack.runtime_shim.tokenizer import special_tokens

    from_json = special_tokens(spec)
    assert from_json[2] == "<|im_end|>" and len(from_json) > 2
    for tok in both:
        assert tok.special_tokens() == from_json


def test_stream_decoder_holds_back_partial_utf8(both) -> None:
    hf, _ = both
    text = "naïve 🙂 漢字 done"
    ids = hf.encode(text)
    stream = hf.stream()
    pieces = [stream.feed(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_unsupported_tokenizer_needs_tokenizers() -> None:
    from edgepack.runtime_shim import TokenizerUnavailableError

    spec = {"model": {"type": "Unigram", "vocab": []}, "pre_tokenizer": None}
    with pytest.raises(TokenizerUnavailableError, match="tokenizers"):
        Tokenizer(spec, "python")


MESSAGES = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


def test_chatml_builtin_matches_jinja(smollm2_source) -> None:
    pytest.importorskip("jinja2")
    template = smollm2_source.chat_template
    for messages in (MESSAGES, [{"role": "system", "content": "Be brief."}, *MESSAGES]):
        a = render_chat(template, messages, engine="jinja2")
        b = render_chat(template, messages, engine="builtin")
        assert a == b
    # the template's default system prompt appears when the conversation has none
    out = render_chat(template, MESSAGES, engine="builtin")
    assert out.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert out.endswith("<|im_start|>assistant\n")


def test_non_chatml_template_without_jinja_is_refused() -> None:
    llama2 = "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    with pytest.raises(ChatTemplateError, match="jinja2"):
        render_chat(llama2, MESSAGES, engine="builtin")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat(None, MESSAGES)
    with pytest.raises(ValueError):
        render_chat(llama2, [{"content": "no role"}])


def test_jinja_is_sandboxed() -> None:
    pytest.importorskip("jinja2")
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(Exception):  # noqa: B017 - SecurityError or ChatTemplateError
        render_chat(evil, MESSAGES, engine="jinja2")
    raising = "{{ raise_exception('no system role') }}"
    with pytest.raises(ChatTemplateError, match="no system role"):
        render_chat(raising, MESSAGES, engine="jinja2")


def test_a_chat_template_is_compiled_once_per_text() -> None:
    """Every chat turn renders the template; compiling it each time cost milliseconds."""
    pytest.importorskip("jinja2")
    from edgepack.runtime_shim import chat as chat_mod

    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    chat_mod._compiled.cache_clear()
    for turn in range(3):
        out = render_chat(template, [{"role": "user", "content": f"hi {turn}"}])
        assert out == f"[user] hi {turn}\n"
    assert chat_mod._compiled.cache_info().misses == 1
    with pytest.raises(ChatTemplateError):
        render_chat("{% for %}", [{"role": "user", "content": "x"}])

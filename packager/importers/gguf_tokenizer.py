"""Rebuild a HF ``tokenizers`` tokenizer from the vocabulary a GGUF file carries.

A GGUF has no ``tokenizer.json``: it stores llama.cpp's view of the tokenizer (tokens, merges,
scores, token types, a pre-tokenizer name). This module turns that back into a
``tokenizers.Tokenizer`` that encodes exactly as llama.cpp does, and returns its JSON.

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE. The split regex follows
  ``tokenizer.ggml.pre`` the way llama.cpp's ``llama-vocab.cpp`` does; e.g. ``smollm`` and
  ``starcoder`` first isolate every ``\\p{N}`` and then apply the GPT-2 regex, which is also
  what SmolLM2's published tokenizer.json does (``Digits(individual_digits)`` + ``ByteLevel``).
* ``"llama"``: SentencePiece BPE with byte fallback; merges come from the file or are derived
  from the token scores (llama.cpp merges the best-scoring pair first).

Tokens typed CONTROL (and UNKNOWN) become special added tokens, USER_DEFINED become plain added
tokens; both are matched whole in the text, as llama.cpp does. BOS/EOS insertion follows
``tokenizer.ggml.add_bos_token``/``add_eos_token`` (defaults: BOS for SentencePiece, none for
byte-level BPE).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from ..errors import ImportModelError

__all__ = ["PRE_TOKENIZERS", "tokenizer_json_from_gguf"]

# llama.cpp token types (``llama_token_type``).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split(pattern: str) -> Any:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return build


# ``tokenizer.ggml.pre`` -> pre-tokenizer, mirroring llama.cpp's ``regex_exprs`` per pre type.
# A missing key or "default" gets plain GPT-2 splitting, as for the original GPT-2 vocabulary.
PRE_TOKENIZERS = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "mpt", "olmo", "jais", "trillion"), _gpt2),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        _digits_then_gpt2,
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "pixtral"),
        _split(_LLAMA3_SPLIT),
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _split(_QWEN2_SPLIT)),
}


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table (``bytes_to_unicode``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _split_merge(merge: str) -> tuple[str, str]:
    # llama.cpp splits at the first space after position 0, so a leading space belongs left.
    pos = merge.find(" ", 1)
    if pos < 0:
        raise ImportModelError(f"GGUF merge {merge!r} does not hold two tokens")
    return merge[:pos], merge[pos + 1 :]


def _vocab(tokens: Sequence[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)  # duplicates (padding slots) keep their first id
    return vocab


def _added_tokens(tokens: Sequence[str], types: Sequence[int]) -> list[AddedToken]:
    added = []
    for token, kind in zip(tokens, types, strict=False):
        if kind in (_CONTROL, _UNKNOWN):
            added.append(AddedToken(token, special=True, normalized=False))
        elif kind == _USER_DEFINED:
            added.append(AddedToken(token, special=False, normalized=False))
    return added


def _post_processor(
    meta: Mapping[str, Any], tokens: Sequence[str], default_bos: bool
) -> processors.PostProcessor | None:
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)) and bos_id is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    if not (add_bos or add_eos):
        return None
    for token_id in (bos_id if add_bos else 0, eos_id if add_eos else 0):
        if not 0 <= token_id < len(tokens):
            raise ImportModelError(f"GGUF BOS/EOS id {token_id} is outside the vocabulary")
    bos = [tokens[bos_id]] if add_bos else []
    eos = [tokens[eos_id]] if add_eos else []
    specials = {tokens[i]: i for i, on in ((bos_id, add_bos), (eos_id, add_eos)) if on}

    def seq(segment: str, type_id: int) -> list[str]:
        return [f"{t}:{type_id}" for t in (*bos, segment, *eos)]

    return processors.TemplateProcessing(
        single=seq("$A", 0),
        pair=seq("$A", 0) + seq("$B", 1),
        special_tokens=list(specials.items()),
    )


def _byte_level_bpe(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in PRE_TOKENIZERS:
        known = ", ".join(sorted(PRE_TOKENIZERS))
        raise ImportModelError(f"unsupported GGUF pre-tokenizer {pre!r} (known: {known})")
    merges_raw = meta.get("tokenizer.ggml.merges")
    if not merges_raw:
        raise ImportModelError("GGUF byte-level BPE vocabulary has no tokenizer.ggml.merges")
    alphabet = _byte_alphabet()
    allowed = set(alphabet)
    spelled = []
    for token, kind in zip(tokens, types, strict=True):
        # A normal token outside the byte alphabet is stored as raw text: respell it.
        if kind == _NORMAL and not set(token) <= allowed:
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        spelled.append(token)
    bpe = models.BPE(
        vocab=_vocab(spelled), merges=[_split_merge(m) for m in merges_raw], fuse_unk=False
    )
    tok = Tokenizer(bpe)
    tok.normalizer = None
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    post = _post_processor(meta, spelled, default_bos=False)
    tok.post_processor = post or processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([t for t in _added_tokens(spelled, types) if t.special])
    tok.add_tokens([t for t in _added_tokens(spelled, types) if not t.special])
    return tok


def _score_merges(
    tokens: list[str], scores: Sequence[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Merges implied by SentencePiece scores: best merged-token score first (llama.cpp order)."""
    ranked: list[tuple[str, str, float]] = []
    for token, score in dict(zip(tokens, scores, strict=True)).items():
        local = [
            (token[:i], token[i:], score)
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        ranked.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _sentencepiece_bpe(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> Tokenizer:
    vocab = _vocab(tokens)
    if meta.get("tokenizer.ggml.merges"):
        merges = [_split_merge(m) for m in meta["tokenizer.ggml.merges"]]
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if not scores or len(scores) != len(tokens):
            raise ImportModelError("GGUF SentencePiece vocabulary has neither merges nor scores")
        merges = _score_merges(tokens, scores, vocab)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    post = _post_processor(meta, tokens, default_bos=True)
    if post is not None:
        tok.post_processor = post
    tok.add_special_tokens([t for t in _added_tokens(tokens, types) if t.special])
    tok.add_tokens([t for t in _added_tokens(tokens, types) if not t.special])
    return tok


def tokenizer_json_from_gguf(meta: Mapping[str, Any]) -> str | None:
    """HF ``tokenizer.json`` text for a GGUF's metadata, or None when it carries no vocabulary."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind in (None, "none") or not tokens:
        return None
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ImportModelError("GGUF tokenizer.ggml.token_type and tokens differ in length")
    builders = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
    if kind not in builders:
        raise ImportModelError(f"unsupported GGUF tokenizer model {kind!r} (known: gpt2, llama)")
    try:
        tokenizer = builders[kind](meta, list(tokens), list(types))
    except ImportModelError:
        raise
    except Exception as exc:  # tokenizers rejects inconsistent vocab/merges with its own errors
        raise ImportModelError(f"GGUF {kind} tokenizer is inconsistent: {exc}") from exc
    return tokenizer.to_str()

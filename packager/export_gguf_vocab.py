"""A package's ``tokenizer.json`` as the ``tokenizer.ggml.*`` metadata llama.cpp reads.

The inverse of :func:`edgepack.packager.importers.gguf_tokenizer.tokenizer_json_from_gguf`
for byte-level BPE (``tokenizer.ggml.model == "gpt2"``): tokens by id, merges, token types
(special added tokens CONTROL, other added tokens USER_DEFINED), the pre-tokenizer name
(the :data:`PRE_TOKENIZERS` entry that builds the same pre-tokenizer), BOS/EOS and whether
they are added. Importing the export rebuilds the same tokenizer. SentencePiece
vocabularies need llama.cpp's scores, which ``tokenizer.json`` does not carry: refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tokenizers import Tokenizer, models
from tokenizers.pre_tokenizers import PreTokenizer

from .errors import UnexportableError
from .importers.gguf_tokenizer import _CONTROL, _NORMAL, _UNUSED, _USER_DEFINED, PRE_TOKENIZERS

__all__ = ["gguf_vocab_metadata"]


def _as_json(pre_tokenizer: PreTokenizer) -> Any:
    holder = Tokenizer(models.BPE())
    holder.pre_tokenizer = pre_tokenizer
    return json.loads(holder.to_str())["pre_tokenizer"]


def _pre_name(pre_tokenizer: Any) -> str:
    """The first ``tokenizer.ggml.pre`` name whose pre-tokenizer is ``pre_tokenizer``."""
    for name, build in PRE_TOKENIZERS.items():
        if _as_json(build()) == pre_tokenizer:
            return name
    raise UnexportableError(
        "the tokenizer's pre-tokenizer matches none llama.cpp names "
        f"(known: {', '.join(sorted(PRE_TOKENIZERS))})"
    )


def _merge_text(merge: Any) -> str:
    return merge if isinstance(merge, str) else " ".join(merge)  # newer files: [left, right]


def _template_ids(post: Any) -> tuple[bool, bool]:
    """Whether the post-processor adds a special token before / after the text."""
    if not isinstance(post, Mapping) or post.get("type") != "TemplateProcessing":
        return False, False
    single = post.get("single") or []
    return bool(single) and "SpecialToken" in single[0], bool(single) and (
        "SpecialToken" in single[-1]
    )


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):  # HF allows several EOS ids; llama.cpp takes one
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def gguf_vocab_metadata(
    tokenizer_json: str, vocab_size: int, config: Mapping[str, Any]
) -> dict[str, Any]:
    """``tokenizer.ggml.*`` key -> value (a GGUF ``add_key_value`` takes it as is);
    ids missing below ``vocab_size`` become ``[PAD{id}]`` UNUSED tokens, as llama.cpp's
    converter pads them."""
    spec = json.loads(tokenizer_json)
    model = spec.get("model") or {}
    pre = spec.get("pre_tokenizer")
    byte_level = model.get("type") == "BPE" and not model.get("byte_fallback")
    if not byte_level or spec.get("normalizer") is not None:
        raise UnexportableError(
            "only byte-level BPE tokenizers export to GGUF (a SentencePiece vocabulary needs "
            "scores tokenizer.json does not hold)"
        )
    by_id: dict[int, tuple[str, int]] = {i: (t, _NORMAL) for t, i in model["vocab"].items()}
    for added in spec.get("added_tokens") or []:
        kind = _CONTROL if added.get("special") else _USER_DEFINED
        by_id[int(added["id"])] = (added["content"], kind)
    size = max(vocab_size, max(by_id) + 1)
    tokens = [by_id.get(i, (f"[PAD{i}]", _UNUSED)) for i in range(size)]
    add_bos, add_eos = _template_ids(spec.get("post_processor"))
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": _pre_name(pre),
        "tokenizer.ggml.tokens": [t for t, _ in tokens],
        "tokenizer.ggml.token_type": [k for _, k in tokens],
        "tokenizer.ggml.merges": [_merge_text(m) for m in model.get("merges") or []],
        "tokenizer.ggml.add_bos_token": add_bos,
        "tokenizer.ggml.add_eos_token": add_eos,
    }
    for key in ("bos", "eos"):
        token_id = _first_id(config.get(f"{key}_token_id"))
        if token_id is not None:
            meta[f"tokenizer.ggml.{key}_token_id"] = token_id
    return meta

"""Tokenizer from the package's ``tokenizer.json`` section.

Two backends, same results on what both support:

* ``tokenizers`` (Hugging Face), imported lazily here and nowhere else, when installed;
* a small pure-Python byte-level BPE (GPT-2 / SmolLM2 / Qwen2 / Llama-3 style
  ``tokenizer.json``: added tokens, ``Split``/``Digits``/``ByteLevel`` pre-tokenizers,
  BPE merges, ``TemplateProcessing`` post-processor, ``ByteLevel`` decoder), so an app
  without ``tokenizers`` can still run. It needs the ``regex`` module for ``\\p{..}``
  classes and falls back to an approximation with :mod:`re` (ASCII-exact). Other kinds
  (SentencePiece-style ``byte_fallback``, normalizers) need ``tokenizers``.

``EDGEPACK_TOKENIZER=python|tokenizers`` forces a backend.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import Any

from edgepack.format import Package, SectionKind
from edgepack.format.errors import CorruptPackageError, EdgepackError

from .errors import TokenizerUnavailableError

__all__ = ["StreamDecoder", "Tokenizer", "special_tokens"]

ENV_VAR = "EDGEPACK_TOKENIZER"

_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


class Tokenizer:
    def __init__(self, spec: dict[str, Any] | bytes, backend: str | None = None) -> None:
        """``spec``: the parsed ``tokenizer.json``, or its bytes. From bytes the
        ``tokenizers`` backend never builds the Python objects of the JSON (tens of MiB
        for a 49k vocabulary, part of ``edgepack run``'s peak memory); nothing keeps it."""
        choice = _backend_choice(backend)
        self._impl: Any = None
        self._reload: Any = None  # -> the impl again, after release_encoder (from_package)
        if choice in ("auto", "tokenizers"):
            try:
                from tokenizers import Tokenizer as HFTokenizer
            except ImportError:
                if choice == "tokenizers":
                    raise TokenizerUnavailableError(
                        "the tokenizers package is not installed"
                    ) from None
            else:
                raw = spec if isinstance(spec, bytes) else json.dumps(spec).encode()
                tk = HFTokenizer.from_buffer(raw)
                self._impl = _HF(tk)
                self.backend = "tokenizers"
                added = tk.get_added_tokens_decoder().items()
                self._special = {int(i): t.content for i, t in added if t.special}
        if self._impl is None:
            spec = json.loads(spec) if isinstance(spec, bytes) else spec
            self._impl = _PyBPE(spec)
            self.backend = "python"
            self._special = special_tokens(spec)

    @classmethod
    def from_package(cls, pkg: Package, backend: str | None = None) -> Tokenizer:
        """The package's tokenizer. Its section is hash-checked but not parsed by the
        reader (``Package.section`` checks a JSON section with ``json.loads``: the Python
        objects of a 49k vocabulary, once more than the tokenizer's own parse, ~2.5 MiB
        of them left in the heap); a section that does not parse is corrupt all the same."""
        sections = pkg.sections(SectionKind.TOKENIZER)
        if not sections:
            raise TokenizerUnavailableError("the package has no tokenizer section")
        if len(sections) > 1:
            raise CorruptPackageError("the package has several tokenizer sections")
        raw = bytes(pkg.section_view(sections[0]))
        _backend_choice(backend)  # a bad choice is the caller's ValueError, not corruption
        try:
            tok = cls(raw, backend)
        except EdgepackError:
            raise
        except Exception as exc:  # tokenizers raises plain Exception on a bad document
            message = " ".join(str(exc).split()) or type(exc).__name__
            raise CorruptPackageError(f"the tokenizer section does not parse: {message}") from None
        tok._reload = lambda: cls.from_package(pkg, backend)._impl
        return tok

    @classmethod
    def from_json(cls, text: str, backend: str | None = None) -> Tokenizer:
        return cls(json.loads(text), backend)

    def release_encoder(self) -> bool:
        """Keep only what decoding needs (:mod:`.byte_decoder`: ~0.5 MiB where the
        ``tokenizers`` tokenizer of a 49k vocabulary holds 13 MiB) and return the freed heap
        and the library's resident code (6 MiB) to the OS: for a caller that encodes no more
        (``edgepack run`` once its prompt is encoded). Encoding again builds the tokenizer
        anew (from the package: ~0.2 s) and faults the library's code back in.
        False (nothing released): not read from a package, or not byte-level BPE."""
        from .byte_decoder import ByteLevelDecoder
        from .heap import release_code_pages, release_freed_memory

        if self._reload is None or not isinstance(self._impl, _HF):
            return False
        table = ByteLevelDecoder.of(self._impl.tk, _byte_map()[1])
        if table is None:
            return False
        self._impl = table
        release_freed_memory()
        release_code_pages(_library_file())
        return True

    def _encoder(self) -> Any:
        if not getattr(self._impl, "encodes", True):
            self._impl = self._reload()
        return self._impl

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._encoder().encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._impl.decode([int(i) for i in ids], skip_special_tokens)

    def ids_containing(self, text: str) -> frozenset[int]:
        """The ids whose decoding alone (special tokens kept) contains ``text``: a scan of
        the byte table after :meth:`release_encoder`, else every id decoded (~35 ms for a
        49k vocabulary)."""
        scan = getattr(self._impl, "ids_containing", None)
        found = scan(text) if scan is not None else None
        if found is not None:
            return found
        return frozenset(i for i in range(self.vocab_size) if text in self.decode([i]))

    def token_to_id(self, token: str) -> int | None:
        return self._encoder().token_to_id(token)

    def id_to_token(self, tid: int) -> str | None:
        return self._encoder().id_to_token(int(tid))

    def is_special(self, tid: int) -> bool:
        return int(tid) in self._special

    def special_tokens(self) -> dict[int, str]:
        """Id -> text of the special added tokens (what :func:`special_tokens` reads from
        the JSON, without parsing it again)."""
        return dict(self._special)

    @property
    def vocab_size(self) -> int:
        return self._impl.vocab_size

    def stream(self, skip_special_tokens: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)


def _backend_choice(backend: str | None) -> str:
    choice = (backend or os.environ.get(ENV_VAR, "") or "auto").lower()
    if choice not in ("auto", "python", "tokenizers"):
        raise ValueError(f"tokenizer backend must be python or tokenizers, got {choice!r}")
    return choice


def special_tokens(spec: dict[str, Any]) -> dict[int, str]:
    """Id -> text of the special added tokens of a parsed ``tokenizer.json``."""
    added = spec.get("added_tokens") or []
    return {int(t["id"]): str(t.get("content", "")) for t in added if t.get("special")}


class StreamDecoder:
    """Turn ids one at a time into text pieces; holds back incomplete UTF-8 sequences."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tok = tok
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # ids[prefix:read] already produced text we emitted
        self._read = 0

    def feed(self, tid: int) -> str:
        self.ids.append(int(tid))
        before = self.tok.decode(self.ids[self._prefix : self._read], self.skip)
        now = self.tok.decode(self.ids[self._prefix :], self.skip)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            piece = now[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
            return piece
        return ""

    def flush(self) -> str:
        before = self.tok.decode(self.ids[self._prefix : self._read], self.skip)
        now = self.tok.decode(self.ids[self._prefix :], self.skip)
        self._prefix = self._read = len(self.ids)
        return now[len(before) :]


def _library_file() -> str:
    """The file of the ``tokenizers`` extension (as the process maps it)."""
    from tokenizers import tokenizers as extension

    return os.path.realpath(extension.__file__)


class _HF:
    def __init__(self, tk: Any) -> None:
        self.tk = tk
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tk.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip: bool) -> str:
        return self.tk.decode(ids, skip_special_tokens=skip)

    def token_to_id(self, token: str) -> int | None:
        return self.tk.token_to_id(token)

    def id_to_token(self, tid: int) -> str | None:
        return self.tk.id_to_token(tid)


# ----------------------------------------------------------------------------------------
# pure-Python byte-level BPE
# ----------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _byte_map() -> tuple[dict[int, str], dict[str, int]]:
    """GPT-2's reversible byte <-> printable unicode mapping."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    enc = {b: chr(c) for b, c in zip(bs, cs, strict=True)}
    return enc, {c: b for b, c in enc.items()}


def _compile(pattern: str) -> Any:
    try:
        import regex
    except ImportError:
        import re

        approx = (
            pattern.replace(r"[^\s\p{L}\p{N}]", r"[^\s\w]|_")
            .replace(r"\p{L}", r"[^\W\d_]")
            .replace(r"\p{N}", r"\d")
        )
        return re.compile(approx)
    return regex.compile(pattern)


def _unsupported(what: str) -> TokenizerUnavailableError:
    return TokenizerUnavailableError(
        f"this tokenizer needs the `tokenizers` package ({what} is not supported by the "
        "built-in byte-level BPE): pip install tokenizers"
    )


class _PyBPE:
    def __init__(self, spec: dict[str, Any]) -> None:
        model = spec.get("model") or {}
        if model.get("type") != "BPE" or model.get("byte_fallback"):
            raise _unsupported(f"model {model.get('type')!r}")
        if spec.get("normalizer") not in (None, {}):
            raise _unsupported(f"normalizer {spec['normalizer'].get('type')!r}")
        self.vocab: dict[str, int] = dict(model["vocab"])
        merges = model.get("merges") or []
        self.ranks: dict[tuple[str, str], int] = {}
        for i, m in enumerate(merges):
            a, b = m.split(" ", 1) if isinstance(m, str) else m
            self.ranks[(a, b)] = i
        self.ignore_merges = bool(model.get("ignore_merges"))
        self.added = {t["content"]: int(t["id"]) for t in spec.get("added_tokens") or []}
        self.special_ids = {
            int(t["id"]) for t in spec.get("added_tokens") or [] if t.get("special")
        }
        self.inv: dict[int, str] = {i: s for s, i in self.vocab.items()}
        self.inv.update({i: s for s, i in self.added.items()})
        self.vocab_size = max(self.inv) + 1 if self.inv else 0
        self.added_re = (
            _compile("|".join(_escape(s) for s in sorted(self.added, key=len, reverse=True)))
            if self.added
            else None
        )
        self.steps = self._pre_tokenizer_steps(spec.get("pre_tokenizer"))
        self.post = self._post_processor(spec.get("post_processor"))
        dec = spec.get("decoder")
        if dec is not None and dec.get("type") not in ("ByteLevel",):
            raise _unsupported(f"decoder {dec.get('type')!r}")
        self._cache: dict[str, list[int]] = {}

    # -- configuration ------------------------------------------------------------------------
    def _pre_tokenizer_steps(self, pre: dict[str, Any] | None) -> list[tuple[str, Any]]:
        if pre is None:
            raise _unsupported("a missing pre-tokenizer")
        items = pre["pretokenizers"] if pre.get("type") == "Sequence" else [pre]
        steps: list[tuple[str, Any]] = []
        saw_byte_level = False
        for p in items:
            kind = p.get("type")
            if kind == "ByteLevel":
                saw_byte_level = True
                rx = _compile(_GPT2_PATTERN) if p.get("use_regex", True) else None
                steps.append(("bytelevel", (bool(p.get("add_prefix_space")), rx)))
            elif kind == "Digits":
                rx = _compile(r"\p{N}" if p.get("individual_digits") else r"\p{N}+")
                steps.append(("isolate", rx))
            elif kind == "Split":
                pattern = p.get("pattern") or {}
                if "Regex" in pattern:
                    rx = _compile(pattern["Regex"])
                else:
                    rx = _compile(_escape(pattern.get("String", "")))
                if p.get("behavior", "Isolated") != "Isolated" or p.get("invert"):
                    raise _unsupported(f"Split behavior {p.get('behavior')!r}")
                steps.append(("isolate", rx))
            else:
                raise _unsupported(f"pre-tokenizer {kind!r}")
        if not saw_byte_level:
            raise _unsupported("a pre-tokenizer without ByteLevel")
        return steps

    def _post_processor(self, post: dict[str, Any] | None) -> tuple[list[int], list[int]]:
        if post is None or post.get("type") == "ByteLevel":
            return [], []
        if post.get("type") == "Sequence":
            for p in post.get("processors", []):
                if p.get("type") == "TemplateProcessing":
                    return self._post_processor(p)
            return [], []
        if post.get("type") != "TemplateProcessing":
            raise _unsupported(f"post-processor {post.get('type')!r}")
        before: list[int] = []
        after: list[int] = []
        seen_seq = False
        specials = post.get("special_tokens", {})
        for item in post.get("single", []):
            if "Sequence" in item:
                seen_seq = True
            elif "SpecialToken" in item:
                name = item["SpecialToken"]["id"]
                ids = specials.get(name, {}).get("ids") or [
                    self.added.get(name, self.vocab.get(name))
                ]
                (after if seen_seq else before).extend(int(i) for i in ids)
        return before, after

    # -- encode --------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = []
        pos = 0
        if self.added_re is not None:
            for m in self.added_re.finditer(text):
                ids += self._encode_plain(text[pos : m.start()])
                ids.append(self.added[m.group(0)])
                pos = m.end()
        ids += self._encode_plain(text[pos:])
        if add_special_tokens:
            before, after = self.post
            ids = before + ids + after
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        if not text:
            return []
        pieces = [text]
        enc, _ = _byte_map()
        for kind, arg in self.steps:
            out: list[str] = []
            for piece in pieces:
                if kind == "isolate":
                    out += _isolate(arg, piece)
                else:
                    prefix, rx = arg
                    if prefix and not piece.startswith(" "):
                        piece = " " + piece
                    out += _isolate(rx, piece) if rx is not None else [piece]
            pieces = out
        ids: list[int] = []
        for piece in pieces:
            mapped = "".join(enc[b] for b in piece.encode("utf-8"))
            ids += self._bpe(mapped)
        return ids

    def _bpe(self, word: str) -> list[int]:
        hit = self._cache.get(word)
        if hit is not None:
            return hit
        if self.ignore_merges and word in self.vocab:
            out = [self.vocab[word]]
        else:
            parts = list(word)
            ranks = self.ranks
            while len(parts) > 1:
                best, best_rank = -1, None
                for i in range(len(parts) - 1):
                    r = ranks.get((parts[i], parts[i + 1]))
                    if r is not None and (best_rank is None or r < best_rank):
                        best, best_rank = i, r
                if best < 0:
                    break
                pair = (parts[best], parts[best + 1])
                merged: list[str] = []
                i = 0
                while i < len(parts):
                    if i < len(parts) - 1 and (parts[i], parts[i + 1]) == pair:
                        merged.append(parts[i] + parts[i + 1])
                        i += 2
                    else:
                        merged.append(parts[i])
                        i += 1
                parts = merged
            try:
                out = [self.vocab[p] for p in parts]
            except KeyError as exc:
                raise _unsupported(f"a symbol {exc.args[0]!r} missing from the vocab") from None
        if len(self._cache) < 65536:
            self._cache[word] = out
        return out

    # -- decode ----------------------------------------------------------------------------------
    def decode(self, ids: list[int], skip: bool) -> str:
        _, dec = _byte_map()
        buf = bytearray()
        for i in ids:
            if skip and i in self.special_ids:
                continue
            tok = self.inv.get(i)
            if tok is None:
                continue
            raw = [dec.get(c) for c in tok]
            if all(b is not None for b in raw):
                buf.extend(raw)  # type: ignore[arg-type]
            else:
                buf.extend(tok.encode("utf-8"))
        return buf.decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        return self.added.get(token, self.vocab.get(token))

    def id_to_token(self, tid: int) -> str | None:
        return self.inv.get(tid)


def _escape(s: str) -> str:
    import re

    return re.escape(s)


def _isolate(rx: Any, text: str) -> Iterator[str] | list[str]:
    """Split ``text`` so every match of ``rx`` and every gap between matches is a piece."""
    out = []
    pos = 0
    for m in rx.finditer(text):
        if m.start() > pos:
            out.append(text[pos : m.start()])
        if m.end() > m.start():
            out.append(m.group(0))
        pos = m.end()
    if pos < len(text):
        out.append(text[pos:])
    return out

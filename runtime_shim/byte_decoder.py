"""Decoding of byte-level BPE ids without the ``tokenizers`` library's tokenizer.

A built ``tokenizers`` tokenizer holds its vocabulary twice and its merges (13 MiB
resident for SmolLM2's 49k tokens); decoding needs only each id's bytes: here one
blob with offsets (~0.5 MiB). :meth:`~.tokenizer.Tokenizer.release_encoder` swaps it in
once a caller will encode no more (``edgepack run`` after its prompt), so the bytes are
not resident while the weights are. It decodes as the library (0.23) does: added tokens
verbatim, each run of other ids between them turned into bytes through GPT-2's byte map
(a token with a character outside the map: its UTF-8) and read as UTF-8 with
replacement; ids it does not know are skipped. :meth:`ByteLevelDecoder.of` checks that
on probes against the tokenizer it replaces and declines (None) where they differ.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Iterable
from functools import lru_cache
from itertools import accumulate, islice
from typing import Any

__all__ = ["ByteLevelDecoder"]

_MISSING, _VOCAB, _ADDED, _SPECIAL = range(4)
_CHUNK = 4096  # tokens converted at once


class ByteLevelDecoder:
    """The decode half of a byte-level BPE tokenizer (``encodes`` False)."""

    encodes = False

    def __init__(
        self,
        tokens: Iterable[str | None],
        added: dict[int, tuple[str, bool]],
        byte_of: dict[str, int],
    ) -> None:
        """``tokens``: the vocabulary by id (None: no such id), read :data:`_CHUNK` at a
        time (49k small strings alive at once would leave Python's heap 3 MiB larger);
        ``added``: id -> (text, special); ``byte_of``: GPT-2's character -> byte map."""
        chars = _byte_chars(tuple(sorted(byte_of.items())))
        self._kind = bytearray()
        self._end = array("Q")
        blob = bytearray()
        it = iter(tokens)
        while chunk := list(islice(it, _CHUNK)):
            try:  # at once: every character one byte (a byte-level vocabulary)
                if None in chunk:
                    raise UnicodeEncodeError("latin-1", "", 0, 0, "an id with no token")
                text: list[str] = chunk  # type: ignore[assignment]
                blob += "".join(text).translate(chars).encode("latin-1")
                self._kind += bytes([_VOCAB]) * len(text)
                ends = accumulate(map(len, text), initial=self._end[-1] if self._end else 0)
                self._end.extend(islice(ends, 1, None))
            except UnicodeEncodeError:  # token by token: a character outside the map, a gap
                for token in chunk:
                    self._kind.append(_MISSING if token is None else _VOCAB)
                    if token is not None:
                        try:
                            blob += token.translate(chars).encode("latin-1")
                        except UnicodeEncodeError:
                            blob += token.encode("utf-8")
                    self._end.append(len(blob))
        self._blob = bytes(blob)
        self.vocab_size = len(self._kind)
        for i, (_, special) in added.items():
            if 0 <= i < self.vocab_size:
                self._kind[i] = _SPECIAL if special else _ADDED
        self._added = {i: text for i, (text, _) in added.items()}

    @classmethod
    def of(cls, tk: Any, byte_of: dict[str, int]) -> ByteLevelDecoder | None:
        """The decoder of the ``tokenizers`` tokenizer ``tk``, or None when ``tk`` does not
        decode byte-level BPE (another decoder or model) or decodes a probe otherwise."""
        if type(tk.decoder).__name__ != "ByteLevel" or type(tk.model).__name__ != "BPE":
            return None
        n = tk.get_vocab_size(with_added_tokens=True)
        decoder = tk.get_added_tokens_decoder()
        added = {int(i): (t.content, bool(t.special)) for i, t in decoder.items()}
        table = cls((tk.id_to_token(i) for i in range(n)), added, byte_of)
        probes = _probes(tk, table, byte_of)
        return table if all(table._agrees(tk, ids) for ids in probes) else None

    def decode(self, ids: list[int], skip: bool) -> str:
        out: list[str] = []
        run: list[bytes] = []
        n, kind, blob, end = self.vocab_size, self._kind, self._blob, self._end
        for i in ids:
            k = kind[i] if 0 <= i < n else _MISSING
            if k == _VOCAB:
                run.append(blob[end[i - 1] if i else 0 : end[i]])
            elif k == _ADDED or (k == _SPECIAL and not skip):
                if run:
                    out.append(b"".join(run).decode("utf-8", errors="replace"))
                    run = []
                out.append(self._added[i])
        if run:
            out.append(b"".join(run).decode("utf-8", errors="replace"))
        return "".join(out)

    def ids_containing(self, text: str) -> frozenset[int] | None:
        """The ids whose decoding alone contains ``text``, for one ASCII character (its
        byte is never part of a multi-byte UTF-8 sequence, so a token's bytes hold it
        exactly when its text does); None for other text."""
        if len(text) != 1 or not text.isascii():
            return None
        found = {i for i, t in self._added.items() if text in t}
        byte, blob, end = ord(text), self._blob, self._end
        pos = blob.find(byte)
        while pos >= 0:
            i = bisect_right(end, pos)
            if self._kind[i] == _VOCAB:
                found.add(i)
            pos = blob.find(byte, end[i])
        return frozenset(found)

    def _agrees(self, tk: Any, ids: list[int]) -> bool:
        return all(
            self.decode(ids, skip) == tk.decode(ids, skip_special_tokens=skip)
            for skip in (False, True)
        )


@lru_cache(maxsize=1)
def _byte_chars(byte_of: tuple[tuple[str, int], ...]) -> dict[int, str]:
    """A ``str.translate`` table: each mapped character to the character of its byte
    (``latin-1`` then encodes it as that byte), every other one below the map's end to one
    ``latin-1`` cannot encode (so such a token falls back to its UTF-8)."""
    table = {ord(c): chr(b) for c, b in byte_of}
    for code in range(max(table) + 1):
        table.setdefault(code, "\ufffe")
    return table


def _probes(tk: Any, table: ByteLevelDecoder, byte_of: dict[str, int]) -> list[list[int]]:
    """Id sequences where decoders differ if they differ at all: each added token between
    the halves of a split UTF-8 character, an unknown id, and a stretch of the vocabulary."""
    char_of = {b: c for c, b in byte_of.items()}
    split = [i for i in (tk.token_to_id(char_of[b]) for b in (0xE2, 0x82)) if i is not None]
    probes = [[*split[:1], a, *split[1:], *split[1:]] for a in table._added]
    n = table.vocab_size
    probes.append([*split, n, *split])
    probes.append([i for i in range(0, n, max(1, n // 512)) if table._kind[i] != _MISSING])
    return probes

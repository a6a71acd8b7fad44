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
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

__all__ = ["ByteLevelDecoder"]

_MISSING, _VOCAB, _ADDED, _SPECIAL = range(4)


class ByteLevelDecoder:
    """The decode half of a byte-level BPE tokenizer (``encodes`` False)."""

    encodes = False

    def __init__(
        self,
        tokens: Sequence[str | None],
        added: dict[int, tuple[str, bool]],
        byte_of: dict[str, int],
    ) -> None:
        """``tokens``: the vocabulary by id (None: no such id); ``added``: id -> (text,
        special); ``byte_of``: GPT-2's character -> byte map."""
        self.vocab_size = len(tokens)
        self._kind = bytearray(_MISSING if t is None else _VOCAB for t in tokens)
        for i, (_, special) in added.items():
            if 0 <= i < self.vocab_size:
                self._kind[i] = _SPECIAL if special else _ADDED
        self._added = {i: text for i, (text, _) in added.items()}
        pieces = [b"" if t is None else _token_bytes(t, byte_of) for t in tokens]
        self._blob = b"".join(pieces)
        self._end = array("Q", accumulate(len(p) for p in pieces))

    @classmethod
    def of(cls, tk: Any, byte_of: dict[str, int]) -> ByteLevelDecoder | None:
        """The decoder of the ``tokenizers`` tokenizer ``tk``, or None when ``tk`` does not
        decode byte-level BPE (another decoder or model) or decodes a probe otherwise."""
        if type(tk.decoder).__name__ != "ByteLevel" or type(tk.model).__name__ != "BPE":
            return None
        n = tk.get_vocab_size(with_added_tokens=True)
        tokens: list[str | None] = [None] * n
        for text, i in tk.get_vocab(with_added_tokens=False).items():
            if 0 <= i < n:
                tokens[i] = text
        decoder = tk.get_added_tokens_decoder()
        added = {int(i): (t.content, bool(t.special)) for i, t in decoder.items()}
        table = cls(tokens, added, byte_of)
        probes = _probes(tokens, added, byte_of)
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

    def _agrees(self, tk: Any, ids: list[int]) -> bool:
        return all(
            self.decode(ids, skip) == tk.decode(ids, skip_special_tokens=skip)
            for skip in (False, True)
        )


def _token_bytes(token: str, byte_of: dict[str, int]) -> bytes:
    raw = [byte_of.get(c) for c in token]
    return token.encode("utf-8") if None in raw else bytes(raw)  # type: ignore[arg-type]


def _probes(
    tokens: Sequence[str | None], added: dict[int, tuple[str, bool]], byte_of: dict[str, int]
) -> list[list[int]]:
    """Id sequences where decoders differ if they differ at all: each added token between
    the halves of a split UTF-8 character, an unknown id, and a stretch of the vocabulary."""
    index = {t: i for i, t in enumerate(tokens) if t is not None and len(t) == 1}
    char_of = {b: c for c, b in byte_of.items()}
    lead, tail = (index.get(char_of.get(b, "")) for b in (0xE2, 0x82))
    split = [i for i in (lead, tail) if i is not None]
    probes = [[*split[:1], a, *split[1:], *split[1:]] for a in added]
    probes.append([*split, len(tokens), *split])
    known = [i for i, t in enumerate(tokens) if t is not None]
    probes.append(known[:: max(1, len(known) // 512)])
    return probes

"""Precomputed prefix KV caches: run the written package on fixed prefixes, store the K/V.

The cache must hold exactly the bytes the device would compute, so the packager does not
simulate anything: it opens the package it just wrote with the runtime (its kernels, KV
quantization and activations, through :mod:`edgepack.runtime_shim.instrument`), runs
each prefix, and stores the pages with their binding as PREFIX_KV_CACHE sections
(uncompressed: the device uses them in place). The final package is written once, with
the caches in, and signed then (:mod:`.prefix_write`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from edgepack.format import SectionKind
from edgepack.format.output_file import pid_temporary_directory
from edgepack.format.prefix_cache import encode_prefix_cache

from .errors import InputError
from .prefix_write import NewSection, rewrite_with_sections
from .recipe import PrefixSpec

__all__ = [
    "PREFIX_MEDIA_TYPE",
    "PrefixCacheInfo",
    "PrefixFileError",
    "PrefixRequest",
    "add_prefix_caches",
    "read_prefix_file",
    "recipe_prefixes",
    "write_with_prefixes",
]

T = TypeVar("T")
PREFIX_MEDIA_TYPE = "application/x-edgepack-prefix-kv"
MAX_PREFIXES = 64


class PrefixFileError(InputError):
    """The prefix file is unreadable, empty, or not a list of strings."""


@dataclass(frozen=True)
class PrefixRequest:
    """The prefixes a build stores caches for; ``system``: each is a system prompt."""

    texts: tuple[str, ...]
    system: bool = False


@dataclass(frozen=True)
class PrefixCacheInfo:
    """What the build report says about one stored cache."""

    name: str
    tokens: int
    nbytes: int
    text: str

    def to_json(self) -> dict:
        return {"name": self.name, "tokens": self.tokens, "bytes": self.nbytes}

    def summary(self) -> str:
        return f"prefix cache {self.name}: {self.tokens} tokens, {self.nbytes:,} bytes of K/V"


def recipe_prefixes(specs: Sequence[PrefixSpec]) -> PrefixRequest | None:
    """A recipe's ``[[prefixes]]`` as the request ``--prefix-file`` makes (None: none)."""
    if not specs:
        return None
    return PrefixRequest(tuple(p.text for p in specs), specs[0].system)


def read_prefix_file(path: str | os.PathLike[str]) -> list[str]:
    """Prefixes from a JSON list of strings, or else one prefix per non-empty line."""
    try:
        raw = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PrefixFileError(f"{path}: cannot read prefixes: {exc}") from None
    if raw.lstrip().startswith("["):
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise PrefixFileError(f"{path}: not a JSON list: {exc}") from None
        if not isinstance(doc, list) or not all(isinstance(p, str) and p for p in doc):
            raise PrefixFileError(f"{path}: the JSON list must hold non-empty strings")
        prefixes = doc
    else:
        prefixes = [line for line in raw.splitlines() if line.strip()]
    if not prefixes:
        raise PrefixFileError(f"{path}: holds no prefix")
    if len(prefixes) > MAX_PREFIXES:
        raise PrefixFileError(f"{path}: {len(prefixes)} prefixes, at most {MAX_PREFIXES}")
    return prefixes


def add_prefix_caches(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    prefixes: Sequence[str],
    sign_keys: Sequence[object] = (),
    *,
    system: bool = False,
    kernels: str | None = None,
) -> list[PrefixCacheInfo]:
    """Write ``out``: ``src`` with a cache for each prefix (replacing any it had).
    ``system``: each prefix is a system prompt, rendered through the chat template."""
    from edgepack.runtime_shim.instrument import compute_prefix_cache, open_device, prefix_ids

    sections: list[NewSection] = []
    infos = []
    with open_device(src, kernels=kernels) as model:
        for i, text in enumerate(prefixes):
            ids = prefix_ids(model, text, system=system)
            cache = compute_prefix_cache(model, ids, text)
            name = f"prefix-{i}"
            data = encode_prefix_cache(cache, paged=True)
            sections.append((SectionKind.PREFIX_KV_CACHE, data, name, PREFIX_MEDIA_TYPE, False))
            infos.append(PrefixCacheInfo(name, cache.num_tokens, cache.nbytes, text))
    rewrite_with_sections(
        src, out, sections, sign_keys, replace_kinds=(SectionKind.PREFIX_KV_CACHE,)
    )
    return infos


def write_with_prefixes(
    out: str | os.PathLike[str],
    write_plain: Callable[[Path], T],
    request: PrefixRequest,
    sign_keys: Sequence[object] = (),
) -> tuple[T, list[PrefixCacheInfo]]:
    """``write_plain(path)`` writes the package unsigned to a scratch path; ``out`` gets
    it with the caches of ``request``, signed once. Returns what ``write_plain`` did."""
    with pid_temporary_directory("edgepack-prefix-") as tmp:
        plain = Path(tmp) / Path(out).name
        written = write_plain(plain)
        texts, system = request.texts, request.system
        return written, add_prefix_caches(plain, out, texts, sign_keys, system=system)

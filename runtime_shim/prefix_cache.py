"""Stored prefix KV caches at run time: checked against the model, used instead of prefill.

A package may hold PREFIX_KV_CACHE sections (format/prefix_cache.py): the K/V the
packager computed for fixed prefixes (system prompts) on this very runtime. At open each
is hash-checked (a tampered one fails like any corrupt section) and its
:class:`~edgepack.format.prefix_cache.KVBinding` compared with what this model runs
(:func:`model_binding`); one that differs is ignored with one warning naming the field,
and its prefix is computed as if it were not there.

A valid cache's arrays are views of the package mapping. Where the payload keeps each
layer's slots on pages of their own (version 2, what the packager writes), its pages are
mapped read-only from the package file straight into reserved pool blocks at open
(:meth:`~.kv_cache.KVPool.map_pages`): no copy, shared by every session, never written
(a session appending into the prefix's last, partly filled block copies that block
first: the pool's copy-on-write). Otherwise (a version 1 payload, a platform that cannot
map at an address) the first prompt that starts with its tokens writes them into pool
blocks once (:func:`write_pages`, the same slots a prefill would fill). Either way the
store pins them, every later session attaches them by refcount, and the prompt's
remaining tokens are the only prefill.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from edgepack.format import SectionKind
from edgepack.format.constants import PAGE_SIZE
from edgepack.format.digests import sha256
from edgepack.format.prefix_cache import KVBinding, PrefixCache, decode_prefix_cache

from .kv_cache import KV_LAYOUT_VERSION, KVPool
from .kv_cache import Sequence as KVSequence
from .page_map import PAGE

if TYPE_CHECKING:
    from edgepack.format import Package

    from .model import Model

__all__ = [
    "NO_ADAPTER",
    "PrefixStore",
    "compute_prefix_cache",
    "kv_pages",
    "layout_mismatch",
    "model_binding",
    "prefix_ids",
    "write_pages",
]

_log = logging.getLogger("edgepack.runtime")

NO_ADAPTER = b""  # the adapter digest of a model running no adapter


def _section_hash(model: Model, kind: SectionKind) -> bytes:
    secs = model.package.sections(kind)
    return secs[0].hash if secs else b""


def rope_digest(inv_freq: np.ndarray, scaling: float) -> bytes:
    """SHA-256 of the RoPE table's inputs as the runtime uses them (float32)."""
    h = sha256(b"edgepack-rope-v1\x00")
    h.update(np.ascontiguousarray(inv_freq, "<f4").tobytes())
    h.update(np.float32(scaling).tobytes())
    return h.digest()


def model_binding(model: Model, adapter: bytes = NO_ADAPTER) -> KVBinding:
    """What a K/V cache made on ``model`` (running ``adapter``) is bound to."""
    pool, cfg = model.kv_pool, model.config
    return KVBinding(
        weights=model.package.weights_digest,
        adapter=adapter,
        kv_layout=pool.mode,
        kv_layout_version=KV_LAYOUT_VERSION,
        v_group=pool.v_group,
        tokenizer=_section_hash(model, SectionKind.TOKENIZER),
        chat_template=_section_hash(model, SectionKind.CHAT_TEMPLATE),
        rope=rope_digest(model.rope.inv_freq, float(model.rope.scaling)),
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        activations="int8" if model.act_int8 else "float",
    )


def _flat(pool: KVPool, layer: int, name: str) -> np.ndarray:
    """Layer ``layer``'s array ``name`` as ``[blocks * block_size, ...]`` (a view)."""
    arr = getattr(pool.layer(layer), name)
    return arr.reshape(arr.shape[0] * arr.shape[1], *arr.shape[2:])


def _slots(seq: KVSequence, n: int) -> np.ndarray:
    bs = seq.pool.block_size
    pos = np.arange(n, dtype=np.int64)
    return np.asarray(seq.blocks, np.int64)[pos // bs] * bs + pos % bs


def kv_pages(seq: KVSequence, n: int | None = None) -> dict[str, np.ndarray]:
    """The K/V of ``seq``'s first ``n`` tokens, ``[layers, n, ...]`` per array (copies)."""
    pool = seq.pool
    n = seq.length if n is None else n
    slots = _slots(seq, n)
    names = pool.layout.arrays(pool.num_kv_heads, pool.head_dim, pool.v_group)
    return {
        name: np.stack([_flat(pool, i, name)[slots] for i in range(pool.num_layers)])
        for name in names
    }


def write_pages(seq: KVSequence, tokens: Sequence[int], arrays: dict[str, np.ndarray]) -> None:
    """Append ``tokens`` to ``seq`` with their K/V from ``arrays`` instead of a forward
    pass: the same slots and bytes a prefill writes, registered in the prefix cache."""
    pool = seq.pool
    slots = seq.prepare([int(t) for t in tokens])
    for name, data in arrays.items():
        for i in range(pool.num_layers):
            _flat(pool, i, name)[slots] = data[i]
    seq.commit()


def prefix_ids(model: Model, text: str, *, system: bool = False) -> list[int]:
    """The token ids a prompt starting with ``text`` starts with: ``text`` as a system
    message rendered through the chat template (as ``Session.chat`` renders it), or as
    plain text (as ``Session.generate`` encodes it)."""
    tok = model.tokenizer
    if not system:
        return tok.encode(text)
    with model.session() as s:
        rendered = s.render_chat([{"role": "system", "content": text}], add_generation_prompt=False)
    return tok.encode(rendered, add_special_tokens=False)


def compute_prefix_cache(model: Model, ids: Sequence[int], text: str = "") -> PrefixCache:
    """Run ``ids`` through ``model`` (its kernels, KV layout and activations) and return
    their K/V as a cache bound to the model (what the packager stores)."""
    seq = model.new_sequence()
    try:
        model.forward(seq, list(ids), logits="none")
        pages = kv_pages(seq)
    finally:
        with model.lock:
            seq.release()
    return PrefixCache(model_binding(model), np.asarray(ids, np.int32), pages, text)


class PrefixStore:
    """The valid stored prefixes of one model; each written into the pool on first use."""

    def __init__(
        self,
        caches: list[tuple[str, PrefixCache]],
        ignored: list[tuple[str, PrefixCache, str]] | None = None,
    ) -> None:
        self.caches = caches
        self.ignored = ignored or []  # (section name, cache, the binding field that differs)
        self._seqs: dict[int, KVSequence] = {}  # cache index -> its pinned sequence
        self.mapped: set[int] = set()  # caches whose pages are mapped from the package
        self.hits = 0

    @classmethod
    def load(cls, model: Model) -> PrefixStore:
        """Hash-check and decode every PREFIX_KV_CACHE section; keep the ones bound to
        ``model``, warn once for each other one (CorruptPackageError on bad bytes)."""
        expected = model_binding(model)
        caches, ignored = [], []
        for sec in model.package.sections(SectionKind.PREFIX_KV_CACHE):
            cache = decode_prefix_cache(model.package.section_view(sec))
            field = cache.binding.mismatch(expected)
            if field is None:
                field = layout_mismatch(cache, model.kv_pool)
            if field is not None:
                _log.warning(
                    "prefix cache %r ignored: it was made for another %s; its %d tokens "
                    "are computed instead",
                    sec.name,
                    field,
                    cache.num_tokens,
                )
                ignored.append((sec.name, cache, field))
                continue
            caches.append((sec.name, cache))
        store = cls(caches, ignored)
        store._map(model.package, model.kv_pool)
        return store

    def _map(self, pkg: Package, pool: KVPool) -> None:
        """Map the pages of every cache that allows it into reserved pool blocks."""
        pages = {i: _file_pages(pkg, cache) for i, (_name, cache) in enumerate(self.caches)}
        wanted = [i for i, p in pages.items() if p is not None]
        if not wanted:
            return
        firsts = pool.reserve_mapped([self.caches[i][1].num_tokens for i in wanted])
        for i, first in zip(wanted, firsts, strict=True):
            cache = self.caches[i][1]
            if pool.map_pages(first, pages[i], cache.num_tokens):
                self._seqs[i] = pool.mapped_sequence(first, cache.tokens.tolist())
                self.mapped.add(i)
            else:
                _log.info("prefix cache %r: pages copied (not mappable here)", self.caches[i][0])

    def match(self, ids: Sequence[int]) -> int | None:
        """Index of the longest stored prefix of ``ids`` (None: none is)."""
        best, best_len = None, 0
        for i, (_name, cache) in enumerate(self.caches):
            n = cache.num_tokens
            if best_len < n <= len(ids) and list(ids[:n]) == cache.tokens.tolist():
                best, best_len = i, n
        return best

    def attach(self, seq: KVSequence, ids: Sequence[int], limit: int) -> KVSequence:
        """``seq``, or a sequence holding (at most ``limit`` tokens of) a stored prefix of
        ``ids`` when that is longer than what ``seq`` holds (``seq`` is then released).
        Call under ``Model.lock``."""
        i = self.match(ids)
        if i is None or min(self.caches[i][1].num_tokens, limit) <= seq.length:
            return seq
        pinned = self._seqs.get(i)
        if pinned is None:
            cache = self.caches[i][1]
            pinned = seq.pool.sequence()
            write_pages(pinned, cache.tokens.tolist(), cache.arrays)
            self._seqs[i] = pinned
        seq.release()
        self.hits += 1
        out = pinned.fork()
        if out.length > limit:  # the prompt is the prefix: its last token is computed
            out.truncate(limit)
        seq.pool.stats.prefix_hit_tokens += out.length
        return out


def _file_pages(pkg: Package, cache: PrefixCache) -> dict[str, list[tuple[int, int]]] | None:
    """(fd, file offset) of each layer's slots of each part, or None unless every one is
    contiguous and starts on a page of the package file (a version 2 payload) and this
    system's pages divide the format's (a mapping never reaches past a layer's pages)."""
    if PAGE_SIZE % PAGE:
        return None
    fd, out = pkg.fileno(), {}
    for name, a in cache.arrays.items():
        per_layer = []
        for layer in a:
            off = pkg.mapped_offset(layer) if layer.flags.c_contiguous else None
            if off is None or off % PAGE:
                return None
            per_layer.append((fd, off))
        out[name] = per_layer
    return out


def layout_mismatch(cache: PrefixCache, pool: KVPool) -> str | None:
    """``kv_layout`` when the arrays are not the shapes and dtypes the pool stores."""
    want = pool.layout.arrays(pool.num_kv_heads, pool.head_dim, pool.v_group)
    n, layers = cache.num_tokens, pool.num_layers
    got = {name: (a.shape, str(a.dtype)) for name, a in cache.arrays.items()}
    spec = {name: ((layers, n, *shape), dt) for name, (shape, dt) in want.items()}
    return None if got == spec else "kv_layout"

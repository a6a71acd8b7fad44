"""Paged KV cache: fixed-size blocks, prefix sharing with copy-on-write, LRU eviction.

One :class:`KVPool` per model holds every block for every layer (a block id names the
same ``block_size`` token slots in all layers, as in vLLM). How a token's K and V are
stored is a :class:`KVLayout`; :data:`KV_LAYOUTS` is the one table of them (measured by
bench/kv.py: bytes per token, KL against the float cache, decode speed):

``"int8"`` (default)
    K and V rotated first along ``head_dim`` by the orthonormal Walsh-Hadamard transform
    (:func:`rotate_heads`, QuaRot's trick: it spreads K's outlier channels over every
    channel, so one scale per token fits them all, and makes V's values alike), then K
    int8 with one float16 scale per token and KV head (as ``"int8-v5"``) and V int6
    symmetric with one scale byte per token and KV head (``v_group`` = head_dim):
    ``d = f16(absmax/31)`` rounded up to its 8 top magnitude bits (e5m3: the float16 whose
    bits are ``byte << 7``), ``c = clip(rint(v/d), -31, 31) + 32``, stored as a nibble
    plane (low 4 bits) plus a 2-bit plane (bits 4-5 of element ``i`` are bits
    ``2 (i % 4)`` and ``2 (i % 4) + 1`` of byte ``i // 4``). The rotation is its own
    inverse: the cache is read back with it (the native attention rotates q and its output
    instead), so ``q . k`` and ``sum p v`` are unchanged up to rounding. 0.449x the bytes
    of a float16 cache at head_dim 64 (0.443x at 128), at every context length.
``"int8-v5"`` codes below, taken of K and V rotated first along ``head_dim`` by
    the orthonormal Walsh-Hadamard transform (:func:`rotate_heads`; QuaRot's trick): the
    rotation spreads K's outlier channels over every channel, so one scale per token fits
    them all, and V's groups get a flatter range. The rotation is its own inverse: the
    cache is read back (and the native attention rotates q and its output) with the same
    transform, so ``q . k`` and ``sum p v`` are unchanged up to rounding. Same bytes as
    ``"int8-v5"`` (0.445x of float16 at head_dim 64), about 0.6x its KL (bench/kv.py).
``"int8-v5"``
    K int8 with one float16 scale per token and KV head (``d = absmax/127``,
    ``q = clip(rint(k/d), -127, 127)``); V int5 asymmetric in groups of ``v_group`` (32)
    along ``head_dim`` with a float16 scale and min per group (``m = min``,
    ``d = (max - min)/31``, ``c = clip(rint((v - m)/d), 0, 31)``, ``v = c*d + m`` with
    ``d``, ``m`` rounded to float16 first), stored as a nibble plane (low 4 bits, element
    ``2i`` in the low nibble of byte ``i``) plus a bit plane (bit 4 of element ``i`` is bit
    ``i % 8`` of byte ``i // 8``). 0.445x the bytes of a float16 cache at head_dim 64.
``"int8-legacy"``
    K int8 as above with a float32 scale; V int4 symmetric in groups of ``v_group``,
    float32 scale per group (``d = m/-8`` with ``m`` the element of largest magnitude,
    nibble ``clip(rint(v/d), -8, 7) + 8``), i.e. the weight codec of spec section 5 with
    float32 scales. Cheaper (0.42x of float16) but it changes greedy answers.
``"float"``
    float32 K and V: the reference.

Measured (bench/kv.py on the f32 SmolLM2-135M package: 30 layers, 3 KV heads, head_dim
64, so a float16 cache is 23040 B/token; KL against the float cache on the evaluation
text, ctx 512). Every layout here stores each token alone (no window, no per-channel
statistics over tokens), so its ratio to float16 is the same at every context length
(512, 2048, ...)::

    layout                             B/token  x f16   mean KL  KL chunks
    int8 (default)                       10350  0.449   0.00060      40
    int8-v5 (the default before)         10260  0.445   0.00204      40
    int8-legacy                           9720  0.422   0.00821      40
    tried on the way (quantize-dequantize on write into a float cache, 2 chunks;
    "rot": Hadamard-rotated; the same 2 chunks give int8 0.00055, int8-v5 0.00179):
    K int8/token, V float32                  -      -   0.00069         2
    rot K int8/token, V float32              -      -   0.00018         2
    K float32, V int5 asym g32               -      -   0.00107         2
    K float32, rot V int5 asym g32           -      -   0.00086         2
    rot K int8, V int5 asym g32          10260  0.445   0.00127         2
    rot K+V int8, int5 asym g32          10260  0.445   0.00103         2
    rot K+V int8, int5 asym g64           9900  0.430   0.00124         2
    rot K+V int8, int5 sym g32            9900  0.430   0.00131         2
    rot K+V int8, int4 asym g32           9540  0.414   0.00414         2
    rot K+V int7, int5 asym g32           9540  0.414   0.00172         2
    rot K+V int6, int5 asym g32           8820  0.383   0.00427         2
    rot K+V int8, int6/token f16 scale   10440  0.453   0.00047         2

The last one is the default with a float16 V scale: 0.8 B/token/head over the 0.45x
bar, hence the one-byte (e5m3, rounded up) scale. A float16 window of recent tokens was
not needed: on top of ``"int8-v5"`` it would cost 256 B per windowed token and head, so
at context 512 the 0.45x bar leaves room for two tokens. Attention in one decode step
(native AVX-512, one thread, 9 query heads over 1024 positions of 3 KV heads):
int8-legacy 0.15 ms, float 0.16 ms, int8 0.21 ms, int8-v5 0.23 ms (0.58 ms before its
int5 codes were assembled from byte tables ahead of the vector loads). Whole-model decode
tok/s (64 tokens after 256, 2 threads, a shared 2-core machine) varied more from run to
run than between layouts: int8 20-24, int8-v5 21-25, int8-legacy 23-30, float 21-22.

Quantized on write, dequantized on read. Arrays per layer (``NB`` blocks, ``BS`` tokens
per block, ``H`` KV heads, ``D`` head_dim, ``G = D/v_group``)::

    int8:        k_codes int8 [NB, BS, H, D]    k_scales f16 [NB, BS, H]
                 v_codes uint8 [NB, BS, H, D/2] v_high uint8 [NB, BS, H, D/4]
                 v_scales uint8 [NB, BS, H, G]  (of the rotated K and V; G = 1)
    int8-v5:     k_codes int8 [NB, BS, H, D]    k_scales f16 [NB, BS, H]
                 v_codes uint8 [NB, BS, H, D/2] v_high uint8 [NB, BS, H, D/8]
                 v_scales f16 [NB, BS, H, G]    v_mins f16 [NB, BS, H, G]
    int8-legacy: k_codes int8 [NB, BS, H, D]    k_scales f32 [NB, BS, H]
                 v_codes uint8 [NB, BS, H, D/2] v_scales f32 [NB, BS, H, G]
    float:       k f32 [NB, BS, H, D]           v f32 [NB, BS, H, D]

A :class:`Sequence` is a block table plus the token ids it holds. Full blocks are
content-addressed by a hash chain over the token ids before and in them; when a
sequence fills a block it is registered in the pool's prefix cache so another sequence
starting with the same tokens attaches it instead of recomputing (refcounts). A block
that is shared (refcount > 1) or registered is never written: the writer copies it first
(copy-on-write). Unreferenced registered blocks stay cached, oldest-used evicted first
when a new block is needed; when every block is referenced, :class:`KVCacheFullError`.

Memory: the pool is an anonymous mapping (pages are committed by the OS on first write),
so the budget bounds memory without costing it up front.

Mapped blocks: past the ``num_blocks`` the budget allows, :meth:`KVPool.reserve_mapped`
adds address room where a stored prefix's pages are mapped read-only straight from the
package file (:meth:`KVPool.map_pages`, :mod:`.page_map`; the payload keeps each layer's
slots on pages of their own). Those blocks are never allocated, freed or evicted and
always count as shared, so a sequence appending into the prefix's last, partly filled
block copies it first; the mapping itself is never written (a write would fault).
"""

from __future__ import annotations

import math
import mmap
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from edgepack.format.digests import blake2b

from .errors import KVCacheFullError
from .page_map import PAGE, map_file_pages

__all__ = [
    "DEFAULT_KV",
    "KV_LAYOUTS",
    "KV_LAYOUT_VERSION",
    "KV_MODES",
    "KVCacheConfig",
    "KVLayout",
    "KVPool",
    "KVStats",
    "LayerKV",
    "Sequence",
    "block_hash",
    "rotate_heads",
]


@dataclass(frozen=True)
class KVLayout:
    """How one token's K and V of one KV head are stored.

    ``k_bits``: 8 (int8, one scale per token and head) or 32 (float32). ``v_bits``: 4
    (symmetric int4, peak/-8), 5 (asymmetric int5, scale and min), 6 (symmetric int6, one
    scale byte) or 32 (float32), in groups of ``v_group`` along head_dim (head_dim itself
    when the group does not divide it, or when ``v_group`` is 0). ``scale_dtype``: the
    dtype of every float scale and min. ``native``: the native kernels implement it (else
    the native backend runs attention on numpy, with a typed reason). ``rotate``: K and V
    are quantized after :func:`rotate_heads` and read back through it.
    """

    name: str
    k_bits: int
    v_bits: int
    v_group: int
    scale_dtype: str
    native: bool
    summary: str
    rotate: bool = False  # K and V stored Hadamard-rotated (:func:`rotate_heads`)

    @property
    def quantized(self) -> bool:
        return self.k_bits != 32

    def group(self, head_dim: int, override: int | None = None) -> int:
        """The V group used at ``head_dim``: the layout's (or ``override``) when it divides."""
        g = override or self.v_group or head_dim
        return g if head_dim % g == 0 else head_dim

    def arrays(self, h: int, d: int, v_group: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """Shape and dtype of each array of one token slot (``H`` heads, ``D`` head_dim)."""
        if not self.quantized:
            return {"k": ((h, d), "float32"), "v": ((h, d), "float32")}
        sd, g = self.scale_dtype, d // v_group
        out = {"k": ((h, d), "int8"), "k_scales": ((h,), sd), "v": ((h, d // 2), "uint8")}
        if self.v_bits == 6:
            out["v_high"] = ((h, d // 4), "uint8")
            out["v_scales"] = ((h, g), "uint8")
            return out
        if self.v_bits == 5:
            out["v_high"] = ((h, d // 8), "uint8")
        out["v_scales"] = ((h, g), sd)
        if self.v_bits == 5:
            out["v_mins"] = ((h, g), sd)
        return out

    def bytes_per_token_layer(self, h: int, d: int, v_group: int | None = None) -> int:
        g = self.group(d, v_group)
        return sum(
            int(np.prod(shape)) * np.dtype(dt).itemsize
            for shape, dt in self.arrays(h, d, g).values()
        )

    def ratio_to_f16(self, h: int, d: int) -> float:
        """Bytes per token against a float16 K/V cache (``2 * H * D * 2``)."""
        return self.bytes_per_token_layer(h, d) / (2 * h * d * 2)


KV_LAYOUTS: dict[str, KVLayout] = {
    layout.name: layout
    for layout in (
        KVLayout("int8", 8, 6, 0, "float16", True, "rotated K int8, V int6 per token", rotate=True),
        KVLayout("int8-v5", 8, 5, 32, "float16", True, "K int8/token, V int5 asym g32 (f16)"),
        KVLayout("int8-legacy", 8, 4, 32, "float32", True, "K int8/token, V int4 sym g32 (f32)"),
        KVLayout("float", 32, 32, 1, "float32", True, "K and V float32 (the reference)"),
    )
}
KV_MODES = tuple(KV_LAYOUTS)
DEFAULT_KV = "int8"
# Bump when the bytes any layout writes for the same K/V change (rounding, packing, array
# order): stored prefix caches and saved sessions bind to it (runtime_shim/prefix_cache.py).
KV_LAYOUT_VERSION = 1


def rotation_block(head_dim: int) -> int:
    """The Hadamard block of :func:`rotate_heads`: the largest power of two dividing head_dim."""
    return head_dim & -head_dim


def rotate_heads(x: np.ndarray) -> np.ndarray:
    """Orthonormal Walsh-Hadamard transform of the last axis, in blocks of
    :func:`rotation_block` (a float32 copy; applying it twice gives ``x`` back up to rounding).

    The butterflies run in the native kernels' order (stride 1, 2, 4, ...: ``a + b``,
    ``a - b``), then one multiply by ``float32(1/sqrt(block))``, so both give the same bits."""
    d = x.shape[-1]
    b = rotation_block(d)
    y = np.array(x, np.float32).reshape(-1, d // b, b)
    h = 1
    while h < b:
        z = y.reshape(*y.shape[:2], b // (2 * h), 2, h)
        a, c = z[..., 0, :].copy(), z[..., 1, :]
        z[..., 0, :] += c
        np.subtract(a, c, out=z[..., 1, :])
        h *= 2
    y *= np.float32(1.0 / np.sqrt(b))
    return y.reshape(x.shape)


@dataclass(frozen=True)
class KVCacheConfig:
    mode: str = DEFAULT_KV
    block_size: int = 16
    budget_bytes: int = 128 * 1024 * 1024
    v_group: int | None = None  # None: the layout's V group (bench/kv.py measures others)

    def __post_init__(self) -> None:
        if self.mode not in KV_LAYOUTS:
            raise ValueError(f"kv mode must be one of {KV_MODES}, got {self.mode!r}")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.v_group is not None and (self.v_group < 8 or self.v_group % 8):
            raise ValueError("v_group must be a multiple of 8")

    @property
    def layout(self) -> KVLayout:
        return KV_LAYOUTS[self.mode]


@dataclass
class KVStats:
    prefix_hit_tokens: int = 0
    cow_copies: int = 0
    evictions: int = 0
    allocated: int = 0


@dataclass(frozen=True)
class LayerKV:
    """One layer's slice of the pool (views); arrays its layout does not have are None."""

    mode: str
    block_size: int
    v_group: int
    k: np.ndarray
    v: np.ndarray
    k_scales: np.ndarray | None
    v_scales: np.ndarray | None
    v_high: np.ndarray | None = None
    v_mins: np.ndarray | None = None

    @property
    def layout(self) -> KVLayout:
        return KV_LAYOUTS[self.mode]


def _lazy_zeros(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """Zeroed memory committed page by page on first write. (``np.zeros`` asks for
    transparent huge pages: one touched byte per layer would commit 2 MiB.)"""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = mmap.mmap(-1, max(size, 1))
    return np.frombuffer(buf, dtype, int(np.prod(shape))).reshape(shape)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def block_hash(parent: bytes, tokens: np.ndarray | list[int]) -> bytes:
    """Chain hash of a full block: the parent block's hash and this block's token ids."""
    data = np.asarray(tokens, dtype="<i4").tobytes()
    return blake2b(parent + data, digest_size=16).digest()


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        config: KVCacheConfig | None = None,
        *,
        salt: bytes = b"",
    ) -> None:
        cfg = config or KVCacheConfig()
        layout = cfg.layout
        v_group = layout.group(head_dim, cfg.v_group)
        if head_dim % (8 if layout.v_bits in (5, 6) else 2):
            raise ValueError(f"head_dim {head_dim} does not fit the {layout.name!r} KV layout")
        self.config = cfg
        self.layout = layout
        self.mode = cfg.mode
        self.block_size = bs = cfg.block_size
        self.v_group = v_group
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.root = blake2b(salt + cfg.mode.encode(), digest_size=16).digest()
        per_token_layer = layout.bytes_per_token_layer(num_kv_heads, head_dim, v_group)
        self.bytes_per_block = per_token_layer * bs * num_layers
        self.num_blocks = cfg.budget_bytes // self.bytes_per_block
        if self.num_blocks < 1:
            raise ValueError(
                f"KV budget {cfg.budget_bytes} B is below one block ({self.bytes_per_block} B)"
            )
        nb = self.num_blocks
        self._make_arrays(nb)
        self._free = list(range(nb - 1, -1, -1))  # pop() hands out low ids first
        self._cache: dict[bytes, int] = {}  # chain hash -> block
        self._hash_of: dict[int, bytes] = {}  # registered block -> its hash
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced registered blocks
        self.stats = KVStats()

    def _make_arrays(self, total_blocks: int) -> None:
        """Every part's array with room for ``total_blocks`` block ids (lazily committed)."""
        parts = self.layout.arrays(self.num_kv_heads, self.head_dim, self.v_group)
        lead = (self.num_layers, total_blocks, self.block_size)
        self._arrays = {
            name: _lazy_zeros((*lead, *shape), np.dtype(dt)) for name, (shape, dt) in parts.items()
        }
        self.refcount = np.zeros(total_blocks, np.int32)
        self._layer_views: list[LayerKV] | None = None  # views of these arrays, made on use

    # -- mapped blocks -------------------------------------------------------------
    def mapping_alignment(self) -> int:
        """Blocks per page-aligned step of every part's array: a mapped region starts at
        a multiple of it, so each layer's stretch of each part starts on a page."""
        step = 1
        parts = self.layout.arrays(self.num_kv_heads, self.head_dim, self.v_group)
        for shape, dt in parts.values():
            block_bytes = self.block_size * math.prod(shape) * np.dtype(dt).itemsize
            step = math.lcm(step, PAGE // math.gcd(PAGE, block_bytes))
        return step

    def reserve_mapped(self, token_counts: Seq[int]) -> list[int]:
        """Address room past the allocatable blocks for prefixes of ``token_counts``
        tokens to be mapped from a file; returns each one's first block id. Only while no
        block is in use (the arrays are made anew; nothing is committed yet)."""
        if self.refcount.any() or self._cache:
            raise RuntimeError("mapped blocks are reserved before any block is used")
        step = self.mapping_alignment()
        first, pos = [], _round_up(self.num_blocks, step)
        for n in token_counts:
            first.append(pos)
            pos += _round_up(-(-n // self.block_size), step)
        self._make_arrays(pos)
        return first

    def is_mapped(self, block: int) -> bool:
        return block >= self.num_blocks

    def mapped_region(self, name: str, layer: int, first: int, n_tokens: int) -> np.ndarray:
        """The ``n_tokens`` slots from block ``first`` of part ``name`` of ``layer``."""
        arr = self._arrays[name][layer]
        flat = arr.reshape(arr.shape[0] * arr.shape[1], *arr.shape[2:])
        start = first * self.block_size
        return flat[start : start + n_tokens]

    def map_pages(self, first: int, pages: dict[str, list[tuple[int, int]]], n_tokens: int) -> bool:
        """Map ``n_tokens`` slots of each part and layer, from ``pages[name][layer]`` =
        (fd, file offset), over the reserved blocks from ``first``. False (and the region
        left as it was where it was not mapped yet) when the platform or an offset does
        not allow it; the caller then writes the pages instead."""
        for name, per_layer in pages.items():
            for layer, (fd, offset) in enumerate(per_layer):
                region = self.mapped_region(name, layer, first, n_tokens)
                length = _round_up(region.nbytes, PAGE)
                if not map_file_pages(region.__array_interface__["data"][0], length, fd, offset):
                    return False
        return True

    def mapped_sequence(self, first: int, tokens: Seq[int]) -> Sequence:
        """A sequence holding ``tokens`` whose K/V are the mapped blocks from ``first``,
        registered in the prefix cache like a computed one."""
        seq = Sequence(self)
        seq.blocks = list(range(first, first + -(-len(tokens) // self.block_size)))
        for b in seq.blocks:
            self.retain(b)
        seq._pending = [int(t) for t in tokens]
        seq.commit()
        return seq

    # -- views ---------------------------------------------------------------------
    def layers(self) -> list[LayerKV]:
        """Every layer's view (made once per set of arrays: a forward asks for them all,
        and the native one-call step keeps the views it was given)."""
        if self._layer_views is None:
            self._layer_views = [self.layer(i) for i in range(self.num_layers)]
        return self._layer_views

    def layer(self, i: int) -> LayerKV:
        a = self._arrays

        def part(name: str) -> np.ndarray | None:
            return a[name][i] if name in a else None

        return LayerKV(
            self.mode,
            self.block_size,
            self.v_group,
            a["k"][i],
            a["v"][i],
            part("k_scales"),
            part("v_scales"),
            part("v_high"),
            part("v_mins"),
        )

    # -- accounting ----------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        return int(np.count_nonzero(self.refcount))

    @property
    def cached_blocks(self) -> int:
        """Unreferenced blocks kept for prefix reuse (evictable)."""
        return len(self._lru)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def is_shared(self, block: int) -> bool:
        """True when writing ``block`` in place would change what someone else sees."""
        return self.refcount[block] > 1 or block in self._hash_of or self.is_mapped(block)

    # -- block lifecycle ---------------------------------------------------------------
    def allocate(self) -> int:
        if self._free:
            b = self._free.pop()
        elif self._lru:
            b, _ = self._lru.popitem(last=False)  # least recently used
            del self._cache[self._hash_of.pop(b)]
            self.stats.evictions += 1
        else:
            raise KVCacheFullError(
                f"KV cache full: all {self.num_blocks} blocks ({self.capacity_tokens} tokens, "
                f"{self.num_blocks * self.bytes_per_block:,} B) are held by live sequences; "
                "raise kv_budget_bytes or close sessions"
            )
        self.refcount[b] = 1
        self.stats.allocated += 1
        return b

    def retain(self, block: int) -> None:
        if self.refcount[block] == 0:
            self._lru.pop(block, None)
        self.refcount[block] += 1

    def release(self, block: int) -> None:
        if self.refcount[block] <= 0:
            raise RuntimeError(f"KV block {block} released more often than retained")
        self.refcount[block] -= 1
        if self.refcount[block] == 0 and not self.is_mapped(block):
            if block in self._hash_of:
                self._lru[block] = None  # most recently used end
            else:
                self._free.append(block)

    def copy_block(self, src: int) -> int:
        """A private copy of ``src`` (all layers); the caller then releases ``src``."""
        dst = self.allocate()
        for arr in self._arrays.values():
            arr[:, dst] = arr[:, src]
        self.stats.cow_copies += 1
        return dst

    # -- prefix cache --------------------------------------------------------------------
    def lookup(self, h: bytes) -> int | None:
        """The cached block for chain hash ``h``, retained for the caller, or None."""
        b = self._cache.get(h)
        if b is None:
            return None
        self.retain(b)
        return b

    def register(self, block: int, h: bytes) -> bool:
        """Publish a full block under its chain hash (first writer wins)."""
        if h in self._cache or block in self._hash_of:
            return False
        self._cache[h] = block
        self._hash_of[block] = h
        return True

    def clear_cache(self) -> None:
        """Forget every cached prefix; unreferenced cached blocks become free."""
        for b in list(self._lru):
            self._free.append(b)
        self._lru.clear()
        self._cache.clear()
        self._hash_of.clear()

    def sequence(self, salt: bytes = b"") -> Sequence:
        """A new sequence; ``salt`` (an adapter's identity) keys its blocks apart from
        those computed under another salt, so the prefix cache never mixes them."""
        return Sequence(self, salt)


class Sequence:
    """A block table and the token ids whose K/V it holds (positions ``0..length-1``)."""

    def __init__(self, pool: KVPool, salt: bytes = b"") -> None:
        self.pool = pool
        self.salt = salt
        self.root = pool.root if not salt else block_hash(pool.root + salt, [])
        self.blocks: list[int] = []
        self.tokens: list[int] = []
        self.hashes: list[bytes] = []  # chain hash of each full block, in order
        self._pending: list[int] = []  # tokens reserved by prepare(), not yet committed

    @property
    def length(self) -> int:
        return len(self.tokens)

    def block_table(self, n_tokens: int | None = None) -> np.ndarray:
        n = self.length if n_tokens is None else n_tokens
        nb = -(-n // self.pool.block_size)
        return np.asarray(self.blocks[:nb], np.int32)

    # -- writing ---------------------------------------------------------------------
    def prepare(self, tokens: list[int]) -> np.ndarray:
        """Make the slots for ``tokens`` (appended after ``length``) writable; return them
        as flat indices ``block * block_size + offset``. Call :meth:`commit` after the
        forward pass wrote their K/V."""
        start, n, bs = self.length, len(tokens), self.pool.block_size
        if n == 0:
            return np.zeros(0, np.int64)
        self.reserve(tokens)
        pos = np.arange(start, start + n, dtype=np.int64)
        table = np.asarray(self.blocks, np.int64)
        return table[pos // bs] * bs + pos % bs

    def reserve(self, tokens: list[int]) -> None:
        """:meth:`prepare` without the slot indices (a forward pass finds the slots from
        the block table)."""
        pool, bs = self.pool, self.pool.block_size
        start, n = self.length, len(tokens)
        first, last = start // bs, (start + n - 1) // bs
        if n == 0:
            return
        # the partially filled block we append into must be private (copy-on-write)
        if first < len(self.blocks) and pool.is_shared(self.blocks[first]):
            old = self.blocks[first]
            self.blocks[first] = pool.copy_block(old)
            pool.release(old)
        # later blocks are written from their first slot: a fresh block will do
        for idx in range(first, last + 1):
            if idx >= len(self.blocks):
                self.blocks.append(pool.allocate())
            elif idx > first and pool.is_shared(self.blocks[idx]):
                old = self.blocks[idx]
                self.blocks[idx] = pool.allocate()
                pool.release(old)
        self._pending = list(tokens)

    def commit(self) -> None:
        """The pending tokens' K/V are written: advance and publish newly full blocks."""
        bs = self.pool.block_size
        self.tokens.extend(self._pending)
        self._pending = []
        while len(self.hashes) < self.length // bs:
            k = len(self.hashes)
            parent = self.hashes[-1] if self.hashes else self.root
            h = block_hash(parent, self.tokens[k * bs : (k + 1) * bs])
            self.hashes.append(h)
            self.pool.register(self.blocks[k], h)

    # -- sharing ---------------------------------------------------------------------
    def attach_prefix(self, tokens: list[int], limit: int | None = None) -> int:
        """Attach cached full blocks continuing this sequence with ``tokens[length:]``.

        Only when ``length`` is block aligned and ``tokens`` starts with what the
        sequence holds. At most ``limit`` tokens in total (callers keep one token to
        compute). Returns how many tokens were attached."""
        pool, bs = self.pool, self.pool.block_size
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        if self.length % bs or tokens[: self.length] != self.tokens:
            return 0
        before = self.length
        # a stale block after a truncate at this position would be replaced
        while self.length + bs <= limit:
            k = self.length // bs
            chunk = tokens[k * bs : (k + 1) * bs]
            parent = self.hashes[-1] if self.hashes else self.root
            h = block_hash(parent, chunk)
            b = pool.lookup(h)
            if b is None:
                break
            if k < len(self.blocks):
                pool.release(self.blocks[k])
                self.blocks[k] = b
            else:
                self.blocks.append(b)
            self.tokens.extend(chunk)
            self.hashes.append(h)
        gained = self.length - before
        pool.stats.prefix_hit_tokens += gained
        return gained

    def fork(self) -> Sequence:
        """A new sequence sharing every block (copy-on-write on the next write)."""
        other = Sequence(self.pool, self.salt)
        nb = -(-self.length // self.pool.block_size)
        other.blocks = list(self.blocks[:nb])
        for b in other.blocks:
            self.pool.retain(b)
        other.tokens = list(self.tokens)
        other.hashes = list(self.hashes)
        return other

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens; blocks past them are released."""
        if n < 0 or n > self.length:
            raise ValueError(f"cannot truncate a {self.length}-token sequence to {n}")
        bs = self.pool.block_size
        keep = -(-n // bs)
        for b in self.blocks[keep:]:
            self.pool.release(b)
        del self.blocks[keep:]
        del self.tokens[n:]
        del self.hashes[n // bs :]
        self._pending = []

    def release(self) -> None:
        self.truncate(0)

    def common_prefix(self, tokens: list[int]) -> int:
        n = min(self.length, len(tokens))
        mine = self.tokens
        i = 0
        while i < n and mine[i] == tokens[i]:
            i += 1
        return i

"""KV cache manager: paging, prefix sharing, copy-on-write, LRU eviction, budget."""

from __future__ import annotations

import numpy as np
import pytest

from edgepack.runtime_shim import KVCacheFullError
from edgepack.runtime_shim.kernels import NumpyKernels
from edgepack.runtime_shim.kv_cache import KVCacheConfig, KVPool, Sequence, block_hash

BS = 4


def make_pool(blocks: int = 8, mode: str = "int8-legacy", layers: int = 2) -> KVPool:
    """(int8-legacy by default: its f32 scales give back the integer K/V these tests write.)"""
    probe = KVPool(layers, 2, 32, KVCacheConfig(mode=mode, block_size=BS, budget_bytes=1 << 30))
    budget = probe.bytes_per_block * blocks
    return KVPool(layers, 2, 32, KVCacheConfig(mode=mode, block_size=BS, budget_bytes=budget))


def fill(seq: Sequence, tokens: list[int], value: float | None = None) -> None:
    """Append ``tokens``, writing a recognisable K/V (the token id, or ``value``) per slot."""
    pool = seq.pool
    start = seq.length
    seq.prepare(tokens)
    table = seq.block_table(start + len(tokens))
    nk = NumpyKernels(1)
    for layer in range(pool.num_layers):
        vals = np.array([value if value is not None else t for t in tokens], np.float32)
        shape = (len(tokens), pool.num_kv_heads, pool.head_dim)
        k = np.broadcast_to(vals[:, None, None], shape).copy()
        nk.kv_write(pool.layer(layer), k, k, table, start)
    seq.commit()


def read(seq: Sequence) -> np.ndarray:
    k, _ = NumpyKernels(1).read_kv(seq.pool.layer(0), seq.block_table(), seq.length)
    return k[:, 0, 0]


def test_budget_sets_block_count_and_bytes() -> None:
    pool = make_pool(8, mode="int8-legacy")
    assert pool.num_blocks == 8 and pool.capacity_tokens == 32
    # int8-legacy: K 1 byte + V 0.5 byte per element, one f32 K scale per head, V scale per 32
    per_token_layer = 2 * 32 + 2 * 4 + 2 * 16 + 2 * 1 * 4
    assert pool.bytes_per_block == per_token_layer * BS * 2
    pool = make_pool(8, mode="int8-v5")
    assert pool.num_blocks == 8 and pool.mode == "int8-v5"
    # int8-v5: K 1 byte + V 5 bits per element, f16 K scale per head, f16 V scale
    # and min per 32
    per_token_layer = 2 * 32 + 2 * 2 + 2 * (16 + 4) + 2 * 1 * (2 + 2)
    assert pool.bytes_per_block == per_token_layer * BS * 2
    pool = make_pool(8, mode="int8")
    assert pool.num_blocks == 8 and pool.mode == "int8"
    # int8 (default): K 1 byte + V 6 bits per element, f16 K scale and one V scale byte
    # per head
    per_token_layer = 2 * 32 + 2 * 2 + 2 * (16 + 8) + 2 * 1
    assert pool.bytes_per_block == per_token_layer * BS * 2
    fpool = make_pool(8, mode="float")
    assert fpool.bytes_per_block == 2 * 2 * 32 * 4 * BS * 2
    with pytest.raises(ValueError):
        KVPool(2, 2, 32, KVCacheConfig(budget_bytes=10))
    with pytest.raises(ValueError):
        KVCacheConfig(mode="fp8")


def test_paging_allocates_blocks_on_demand_and_releases() -> None:
    pool = make_pool(8)
    seq = pool.sequence()
    fill(seq, [1, 2, 3])
    assert len(seq.blocks) == 1 and pool.used_blocks == 1
    fill(seq, [4, 5])
    assert len(seq.blocks) == 2 and seq.length == 5
    fill(seq, list(range(6, 15)))
    assert seq.length == 14 and len(seq.blocks) == 4
    np.testing.assert_array_equal(read(seq), np.arange(1, 15))
    seq.truncate(6)
    assert len(seq.blocks) == 2 and seq.tokens == [1, 2, 3, 4, 5, 6]
    seq.release()
    assert pool.used_blocks == 0
    # the three blocks that were ever full stay cached (unreferenced) for reuse (their
    # contents are intact: writes would have copied them), the partial one is free
    assert pool.cached_blocks == 3 and pool.free_blocks == 5


def test_block_table_scatters_across_pool() -> None:
    pool = make_pool(8)
    a, b = pool.sequence(), pool.sequence()
    for i in range(3):  # interleave so neither sequence owns a contiguous run
        fill(a, [10 + 4 * i + j for j in range(4)])
        fill(b, [50 + 4 * i + j for j in range(4)])
    assert sorted(a.blocks + b.blocks) == list(range(6))
    assert a.blocks != list(range(3))
    np.testing.assert_array_equal(read(a), np.arange(10, 22))
    np.testing.assert_array_equal(read(b), np.arange(50, 62))


def test_prefix_sharing_by_hash_of_token_prefix() -> None:
    pool = make_pool(8)
    a = pool.sequence()
    prompt = list(range(100, 110))  # two full blocks and a partial one
    fill(a, prompt)
    assert len(a.hashes) == 2
    b = pool.sequence()
    got = b.attach_prefix([*prompt, 7, 8], limit=11)
    assert got == 8 and b.blocks == a.blocks[:2]
    assert pool.refcount[a.blocks[0]] == 2 and pool.stats.prefix_hit_tokens == 8
    np.testing.assert_array_equal(read(b), np.arange(100, 108))
    # a different second block only shares the first
    c = pool.sequence()
    other = prompt[:4] + [0] * 6
    assert c.attach_prefix(other) == 4
    # the hash chain covers everything before: same block contents after a
    # different first block do not match
    d = pool.sequence()
    assert d.attach_prefix([0, 0, 0, 0, *prompt[4:8]]) == 0
    assert block_hash(pool.root, prompt[:4]) == a.hashes[0]


def test_limit_keeps_one_token_to_compute() -> None:
    pool = make_pool(8)
    a = pool.sequence()
    fill(a, list(range(8)))
    b = pool.sequence()
    assert b.attach_prefix(list(range(8)), limit=7) == 4  # not the whole prompt


def test_copy_on_write_after_fork() -> None:
    pool = make_pool(8)
    a = pool.sequence()
    fill(a, [1, 2, 3, 4, 5, 6])  # one full block, one partial (2 tokens)
    b = a.fork()
    assert b.blocks == a.blocks and pool.refcount[a.blocks[1]] == 2
    fill(b, [70], value=70.0)  # writes into the shared partial block: copy first
    assert b.blocks[0] == a.blocks[0] and b.blocks[1] != a.blocks[1]
    assert pool.stats.cow_copies == 1
    fill(a, [80], value=80.0)  # a's block is private again: written in place
    assert pool.stats.cow_copies == 1
    np.testing.assert_array_equal(read(a), [1, 2, 3, 4, 5, 6, 80])
    np.testing.assert_array_equal(read(b), [1, 2, 3, 4, 5, 6, 70])


def test_copy_on_write_protects_cached_block_after_truncate() -> None:
    pool = make_pool(8)
    a = pool.sequence()
    fill(a, [1, 2, 3, 4, 5])
    cached = a.blocks[0]
    a.truncate(2)  # back into a registered (cached) full block
    fill(a, [9, 9], value=9.0)
    assert a.blocks[0] != cached and pool.stats.cow_copies == 1
    np.testing.assert_array_equal(read(a), [1, 2, 9, 9])
    b = pool.sequence()  # the cached block still serves the old prefix, unchanged
    assert b.attach_prefix([1, 2, 3, 4, 0]) == 4 and b.blocks == [cached]
    np.testing.assert_array_equal(read(b), [1, 2, 3, 4])


def test_lru_eviction_under_budget() -> None:
    pool = make_pool(4)
    seqs = []
    for p in range(4):  # four one-block prompts, released: all cached
        s = pool.sequence()
        fill(s, [p] * 4)
        seqs.append(s)
    for s in seqs:
        s.release()
    assert pool.cached_blocks == 4 and pool.free_blocks == 0
    # touch prompt 0 so prompt 1 becomes the least recently used
    t = pool.sequence()
    assert t.attach_prefix([0] * 4 + [9]) == 4
    t.release()
    n = pool.sequence()
    fill(n, [42] * 4)  # needs one block: evicts prompt 1
    assert pool.stats.evictions == 1
    probe = pool.sequence()
    assert probe.attach_prefix([1] * 4 + [9]) == 0
    assert probe.attach_prefix([0] * 4 + [9]) == 4
    probe.release()
    for p in (2, 3):
        q = pool.sequence()
        assert q.attach_prefix([p] * 4 + [9]) == 4
        q.release()


def test_full_when_every_block_is_referenced() -> None:
    pool = make_pool(2)
    a = pool.sequence()
    fill(a, list(range(8)))
    with pytest.raises(KVCacheFullError, match="KV cache full"):
        fill(a, [1])
    a.truncate(4)
    fill(a, [1])  # the freed block is reusable
    assert a.length == 5


def test_release_twice_is_an_error() -> None:
    pool = make_pool(2)
    b = pool.allocate()
    pool.release(b)
    with pytest.raises(RuntimeError):
        pool.release(b)


def test_clear_cache_frees_unreferenced_blocks() -> None:
    pool = make_pool(4)
    a = pool.sequence()
    fill(a, list(range(8)))
    a.release()
    assert pool.cached_blocks == 2
    pool.clear_cache()
    assert pool.cached_blocks == 0 and pool.free_blocks == 4
    assert pool.sequence().attach_prefix(list(range(9))) == 0


def test_pool_memory_is_committed_lazily() -> None:
    def rss_anon() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    before = rss_anon()
    if before == 0:
        pytest.skip("no /proc/self/status")
    pool = KVPool(30, 3, 64, KVCacheConfig(block_size=16, budget_bytes=256 << 20))
    seq = pool.sequence()
    fill(seq, list(range(16)))
    assert rss_anon() - before < 16 << 20  # one block of a 256 MiB pool

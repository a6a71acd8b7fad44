"""A short pass (prompt lookup's verify pass: 2..9 tokens after a long context) runs the
decode step's grouped attention with every token's query heads, split over the threads
in phases: its outputs must keep the bits of the same tokens' decode steps, for any
thread count, on every ISA and KV layout, with a sliding window and score soft-capping too."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from runtime_fixtures import kv_cache_args, native_runtime_module

from edgepack.runtime_shim.kv_cache import KV_LAYOUTS, KVCacheConfig, KVPool

H, D, BS, START = 3, 64, 16, 300  # SmolLM2's kv heads, a context where threads split


@pytest.fixture
def mod() -> Iterator[object]:
    m = native_runtime_module("attention_prefill")
    previous = m.get_threads()
    try:
        yield m
    finally:
        m.set_threads(previous)


def _filled(m: object, mode: str, n: int) -> tuple[tuple, dict, np.ndarray]:
    pool = KVPool(1, H, D, KVCacheConfig(mode=mode, block_size=BS, budget_bytes=1 << 24))
    pool.allocate()  # the sequence's blocks are not 0, 1, ...
    seq = pool.sequence()
    seq.prepare(list(range(START + n)))
    table = seq.block_table(START + n)
    arrays, kw = kv_cache_args(pool)
    r = np.random.default_rng(11)
    kx = (r.standard_normal((START, H, D)) * 2).astype(np.float32)
    vx = r.standard_normal((START, H, D)).astype(np.float32)
    m.kv_write(kx, vx, *arrays, table, 0, **kw)
    return arrays, kw, table


@pytest.mark.parametrize("mode", list(KV_LAYOUTS))
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (40, 0.0), (0, 3.0)])
@pytest.mark.parametrize("hq", [9, 3])  # SmolLM2's GQA, and none
def test_short_pass_equals_decode_steps_for_any_thread_count(
    mod: object, isa: str, mode: str, window: int, softcap: float, hq: int
) -> None:
    n = 9
    r = np.random.default_rng(12)
    kx = (r.standard_normal((n, H, D)) * 2).astype(np.float32)
    vx = r.standard_normal((n, H, D)).astype(np.float32)
    q = (r.standard_normal((n, hq, D)) * 2).astype(np.float32)
    opts = {"window": window, "softcap": softcap}
    mod.set_threads(1)
    arrays, kw, table = _filled(mod, mode, n)
    steps = np.stack([
        mod.attention_decode(q[i], kx[i], vx[i], *arrays, table, START + i, **kw, **opts)
        for i in range(n)
    ])  # fmt: skip
    for threads in (1, 2, 3):
        mod.set_threads(threads)
        for T in (2, 3, 5, 8, 9):
            arrays, kw, table = _filled(mod, mode, n)
            out = mod.attention_prefill(q[:T], kx[:T], vx[:T], *arrays, table, START, **kw, **opts)
            assert out.tobytes() == steps[:T].tobytes(), (threads, T)

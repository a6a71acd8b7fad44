"""The memory planner and its verifier (runtime_shim.memory_plan), and the native layer's
buffer table it plans (runtime_shim.kernels.layer_buffers)."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import pytest

from edgepack.runtime_shim.memory_plan import (
    ALIGNMENT,
    Buffer,
    BufferSpec,
    MemoryPlan,
    check,
    overlaps,
    plan,
)


def _specs() -> list[BufferSpec]:
    return [
        BufferSpec("a", 1000, 0, 1),
        BufferSpec("b", 5000, 1, 2),
        BufferSpec("c", 3000, 2, 3),
        BufferSpec("d", 4000, 3, 4),  # never live with a or b: may take their bytes
        BufferSpec("e", 100, 0, 4),
    ]


def test_greedy_plan_shares_bytes_of_buffers_never_live_together() -> None:
    p = check(plan(_specs()))
    off = plan(_specs(), reuse=False)
    assert overlaps(off) == []
    assert p.nbytes < off.nbytes == off.unshared_bytes
    # d is live only with c and e: it reuses bytes of a or b
    d, c = p["d"], p["c"]
    assert any(p[x].offset < d.end and d.offset < p[x].end for x in ("a", "b"))
    assert not (c.offset < d.end and d.offset < c.end)
    for b in p.buffers:
        assert b.offset % ALIGNMENT == 0 and b.spec.nbytes % ALIGNMENT == 0


def test_reuse_off_gives_every_buffer_its_own_region() -> None:
    p = plan(_specs(), reuse=False)
    spans = sorted((b.offset, b.end) for b in p.buffers)
    assert all(hi <= lo for (_, hi), (lo, _) in pairwise(spans))


def test_verifier_finds_live_buffers_sharing_bytes() -> None:
    a, b, c = BufferSpec("a", 128, 0, 1), BufferSpec("b", 128, 1, 2), BufferSpec("c", 64, 2, 3)
    ok = MemoryPlan((Buffer(a, 0), Buffer(c, 0), Buffer(b, 128)), 256, True)
    assert overlaps(ok) == []  # a and c share bytes but are never live together
    bad = MemoryPlan((Buffer(a, 0), Buffer(b, 64), Buffer(c, 256)), 320, True)
    assert overlaps(bad) == [("a", "b")]
    with pytest.raises(RuntimeError, match="a/b"):
        check(bad)
    outside = MemoryPlan((Buffer(a, 0), Buffer(b, 192)), 256, True)
    assert overlaps(outside) == [("b", "arena")]
    assert overlaps(replace(ok, buffers=(Buffer(a, 32),), nbytes=256)) == [("a", "arena")]


def test_plan_is_deterministic_and_lists_every_buffer() -> None:
    p = plan(_specs())
    assert p == plan(list(reversed(_specs())))
    text = p.table()
    assert all(s.name in text for s in _specs()) and f"arena {p.nbytes} bytes" in text
    with pytest.raises(ValueError, match="unique"):
        plan([*_specs(), BufferSpec("a", 64, 0, 0)])
    with pytest.raises(ValueError, match="first <= last"):
        BufferSpec("x", 64, 2, 1)


def test_layer_buffers_of_a_real_model_plan_soundly(tmp_path_factory) -> None:
    """Prefill and decode plans of a converted model verify, reuse bytes, and use only
    the slot names the native layer knows."""
    from runtime_fixtures import native_runtime_module, tiny_package

    from edgepack import runtime_shim
    from edgepack.runtime_shim.kernels.layer_buffers import LayerShape, layer_buffers

    slots = set(native_runtime_module("LayerArena").LayerArena.SLOTS)
    with runtime_shim.open(tiny_package(tmp_path_factory, "int8"), verify="none") as m:
        cfg = m.config
        shape = LayerShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        for tokens in (1, 64):
            specs = layer_buffers(m.weights.layers, shape, tokens, act_int8=True, lora_rank=8)
            assert {s.name for s in specs} <= slots
            p = check(plan(specs))
            assert p.nbytes < p.unshared_bytes
            assert check(plan(specs, reuse=False)).nbytes == p.unshared_bytes
        assert set(m.arena.plans) == {1, m.prefill_chunk}

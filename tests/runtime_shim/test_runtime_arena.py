"""The native layer's planned arena (runtime_shim.layer_arena): outputs are bit-identical
with buffer reuse on, off, and without a plan; a plan that gives a buffer too few bytes,
or too few tokens, is refused instead of overrunning."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from runtime_fixtures import native_runtime_module, tiny_package

from edgepack import runtime_shim as rt
from edgepack.runtime_shim.layer_arena import REUSE_ENV
from edgepack.runtime_shim.memory_plan import check

IDS = [(7 * i + 3) % 250 + 1 for i in range(21)]
CHUNK = 8  # prefill chunks of 8, 8, 5 tokens, then decode steps of 1


def _run(m: rt.Model) -> list[np.ndarray]:
    """Prefill logits of IDS, then 4 greedy decode steps' logits."""
    seq = m.new_sequence()
    out = [m.forward(seq, IDS, logits="all")]
    for _ in range(4):
        out.append(m.forward(seq, [int(np.argmax(out[-1][-1]))], logits="all"))
    seq.release()
    return out


@pytest.fixture(scope="module", params=["int8", "int4-g32", "f32"])
def pkg(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    native_runtime_module("LayerArena")
    return tiny_package(tmp_path_factory, request.param)


@pytest.mark.parametrize("activations", ["auto", "float"])
def test_outputs_are_bit_identical_with_reuse_on_and_off(
    pkg: Path, activations: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = {}
    for mode in ("reuse", "off", "unplanned"):
        monkeypatch.setenv(REUSE_ENV, "0" if mode == "off" else "1")
        with rt.open(
            pkg, kernels="native", activations=activations, verify="none", prefill_chunk=CHUNK
        ) as m:
            assert m.arena.nbytes > 0 and m.arena.reuse == (mode != "off")
            prefill = m.arena.plans[CHUNK]
            if mode == "reuse":
                assert prefill.nbytes < prefill.unshared_bytes  # bytes really are shared
            if mode == "unplanned":  # each buffer in its own per-thread region
                m.arena.native = None
            runs[mode] = _run(m)
    for mode in ("off", "unplanned"):
        for a, b in zip(runs["reuse"], runs[mode], strict=True):
            np.testing.assert_array_equal(a, b, strict=True)


@pytest.mark.parametrize("kv", ["int8", "float"])
def test_a_prefill_in_chunks_is_bit_identical_to_one_pass(pkg: Path, kv: str) -> None:
    """The arena is planned for a prefill chunk, so a long prompt runs in several passes
    over the cache: its logits at every position are the one pass's, whatever the chunk
    boundaries (8, 5 and 1 tokens against 64)."""
    ids = IDS * 2
    runs = {}
    for chunk in (64, 8, 5, 1):
        with rt.open(pkg, kernels="native", kv=kv, verify="none", prefill_chunk=chunk) as m:
            runs[chunk] = m.logits(ids)
    for chunk in (8, 5, 1):
        np.testing.assert_array_equal(runs[chunk], runs[64], strict=True)


def test_a_plan_without_the_stacks_second_buffer_gives_the_same_bits(pkg: Path) -> None:
    """stack_x (the one-call forward's second [T, hidden] buffer) missing from a plan: the
    Stack takes its own buffer, and the outputs keep their bits."""
    with rt.open(pkg, kernels="native", verify="none", prefill_chunk=CHUNK) as m:
        planned = _run(m)
        assert all("stack_x" in p.table() for p in m.arena.plans.values())
        m.arena.native = m.kernels.layer_arena(m.arena.nbytes, _spans(m, drop="stack_x"))
        for a, b in zip(planned, _run(m), strict=True):
            np.testing.assert_array_equal(a, b, strict=True)


def _spans(m: rt.Model, drop: str = "", tokens: int | None = None):
    return [
        (t, {b.spec.name: (b.offset, b.spec.nbytes) for b in p.buffers if b.spec.name != drop})
        for t, p in m.arena.plans.items()
        if tokens is None or t == tokens
    ]


def test_a_plan_without_a_buffer_the_layer_takes_is_refused(pkg: Path) -> None:
    with rt.open(pkg, kernels="native", verify="none", prefill_chunk=CHUNK) as m:
        nbytes = m.arena.nbytes
        m.arena.native = m.kernels.layer_arena(nbytes, _spans(m, drop="x1"))
        with pytest.raises(ValueError, match="memory plan gives x1 0 bytes"):
            m.logits(IDS[:3])


def test_more_tokens_than_planned_for_are_refused(pkg: Path) -> None:
    with rt.open(pkg, kernels="native", verify="none", prefill_chunk=CHUNK) as m:
        m.arena.native = m.kernels.layer_arena(m.arena.nbytes, _spans(m, tokens=1))
        assert m.logits(IDS[:1]).shape[0] == 1
        with pytest.raises(ValueError, match="planned for at most 1 tokens, not 2"):
            m.logits(IDS[:2])


def test_layer_arena_refuses_spans_outside_it() -> None:
    mod = native_runtime_module("LayerArena")
    with pytest.raises(ValueError, match="unknown slot"):
        mod.LayerArena(128, [(1, {"nope": (0, 64)})])
    with pytest.raises(ValueError, match="aligned span inside"):
        mod.LayerArena(128, [(1, {"x1": (64, 128)})])
    with pytest.raises(ValueError, match="aligned span inside"):
        mod.LayerArena(256, [(1, {"x1": (32, 64)})])
    assert mod.LayerArena(256, [(4, {"x1": (64, 192)})]).max_tokens == 4


def test_numpy_kernels_get_no_arena(pkg: Path) -> None:
    with rt.open(pkg, kernels="numpy", verify="none") as m:
        assert m.arena.native is None and m.arena.nbytes == 0
        assert m.arena.plans  # planned all the same: the figures are known


@pytest.mark.parametrize("activations", ["int8", "float"])
def test_adapter_outputs_are_bit_identical_with_reuse_on_and_off(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, activations: str
) -> None:
    """A session's adapter replans the arena for its rank; its buffers (and the dequantized
    inputs the layer caches by address) stay sound when bytes are shared."""
    pytest.importorskip("peft")
    native_runtime_module("LayerArena")
    from adapterfactory import IDS as AIDS
    from adapterfactory import int8_base_and_adapter

    base, adapter = int8_base_and_adapter(tmp_path_factory.mktemp("arena-lora"))
    runs = {}
    modes = ("reuse", "off", "unplanned") + (("aliased",) if activations == "int8" else ())
    for mode in modes:
        monkeypatch.setenv(REUSE_ENV, "0" if mode in ("off", "aliased") else "1")
        with rt.open(base, kernels="native", activations=activations, verify="none") as m:
            handle = m.load_adapter(adapter)
            s = m.session(adapter=handle)
            if mode == "unplanned":
                m.arena._make = lambda *_: None  # replanning for the rank binds nothing
            if mode == "aliased":  # the FFN's codes where the attention's were: still sound
                m.arena.native_for(s.adapter)
                m.arena.native = m.kernels.layer_arena(m.arena.nbytes, _aliased_codes(m))
            runs[mode] = s.logits(AIDS)
            assert m.arena.lora_rank == handle.rank > 0
    for mode in modes[1:]:
        np.testing.assert_array_equal(runs["reuse"], runs[mode], strict=True)


def _aliased_codes(m: rt.Model):
    """The arena's plans with ffn_q8 moved onto attn_q8 (never live together)."""
    out = []
    for t, p in m.arena.plans.items():
        moved = replace(p["ffn_q8"], offset=p["attn_q8"].offset)
        buffers = tuple(moved if b.spec.name == "ffn_q8" else b for b in p.buffers)
        p = check(replace(p, buffers=buffers))
        out.append((t, {b.spec.name: (b.offset, b.spec.nbytes) for b in p.buffers}))
    return out

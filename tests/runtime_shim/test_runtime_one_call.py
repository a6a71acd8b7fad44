"""The one-call forward (``decoder_stack``, the extension's ``Stack``: every layer, the final
norm and the head in one native call) gives the per-layer path's bits, and hands over to it
where a layer asks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from runtime_fixtures import convert_to, native_runtime_module, tiny_model_dir

import edgepack.runtime_shim as rt
from edgepack.runtime_shim.kernels import Fallback, LayerContext, NativeKernels
from edgepack.runtime_shim.kernels.interface import StackResult
from edgepack.runtime_shim.kv_cache import KVCacheConfig, KVPool
from edgepack.runtime_shim.stats import ForwardStats

IDS = [5, 17, 3, 99, 42, 7, 64, 2, 11]


@pytest.fixture(scope="module", params=["int8", "int4-g32", "f32"])
def pkg(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp(f"one-call-{request.param}")
    return convert_to(root, tiny_model_dir(root, num_hidden_layers=3), request.param)


def _steps(m: rt.Model) -> list[np.ndarray]:
    """Prefill logits, 6 greedy decode steps' logits, then all-token logits of 3 more."""
    seq = m.new_sequence()
    try:
        out = [m.forward(seq, IDS)]
        for _ in range(6):
            out.append(m.forward(seq, [int(np.argmax(out[-1]))]))
        out.append(m.forward(seq, [1, 2, 3], logits="all"))
        return out
    finally:
        seq.release()


def _count_layer_calls(m: rt.Model) -> list[int]:
    calls = [0]
    per_layer = m.kernels.decoder_layer

    def counted(*args):
        calls[0] += 1
        return per_layer(*args)

    m.kernels.decoder_layer = counted  # type: ignore[method-assign]
    return calls


def _call_ctx(m: rt.Model, n: int, table: np.ndarray) -> LayerContext:
    """The context of an ``n``-token call from position 0 over ``table``."""
    cfg, pos = m.config, np.arange(n, dtype=np.int64)
    cos, sin = m.rope.lookup(pos)
    return LayerContext(
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        eps=cfg.rms_norm_eps, cos=cos, sin=sin, positions=pos, block_table=table, n_ctx=n,
        kv=m.kv_pool.layers()[0], act_int8=m.act_int8,
    )  # fmt: skip

@pytest.mark.parametrize("kv", ["int8", "float"])
@pytest.mark.parametrize("activations", ["auto", "float"])
def test_one_call_forward_gives_the_per_layer_bits(pkg: Path, kv: str, activations: str) -> None:
    native_runtime_module("Stack")
    got = {}
    with rt.open(pkg, kernels="native", kv=kv, activations=activations, verify="none") as m:
        assert isinstance(m.kernels, NativeKernels)
        calls = _count_layer_calls(m)
        for one_call in (False, True):
            m.one_call = one_call
            calls[0] = 0
            got[one_call] = _steps(m)
            # the one-call forward really ran: no layer went through decoder_layer
            assert (calls[0] == 0) == one_call
    for a, b in zip(got[False], got[True], strict=True):
        np.testing.assert_array_equal(a, b)


def test_stack_stops_at_a_layer_it_cannot_run_and_returns_its_input(pkg: Path) -> None:
    """Layers before the one it cannot run (here: a KV layout it lacks) ran in the call;
    x is that layer's input, bit for bit what decoder_layer gives layer by layer."""
    mod = native_runtime_module("Stack")
    with rt.open(pkg, kernels="native", verify="none") as m:
        seq = m.new_sequence()
        seq.prepare(IDS)
        table = seq.block_table(len(IDS))
        pos = np.arange(len(IDS), dtype=np.int64)
        cos, sin = m.rope.lookup(pos)
        cfg = m.config
        ctxs = [
            LayerContext(
                num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, eps=cfg.rms_norm_eps, cos=cos, sin=sin,
                positions=pos, block_table=table, n_ctx=len(IDS),
                kv=m.kv_pool.layer(lw.index), act_int8=m.act_int8,
            )
            for lw in m.weights.layers
        ]
        x0 = m.weights.embed.lookup(np.asarray(IDS))
        ref = [x0]
        for lw, ctx in zip(m.weights.layers, ctxs, strict=True):
            out, reason = mod.decoder_layer(lw, ref[-1], ctx)
            assert reason is None
            ref.append(out)
        eps = cfg.rms_norm_eps
        stack = mod.Stack(m.weights.layers, ctxs[0], m.weights.norm, eps, m.weights.output)
        kvs = [ctx.kv for ctx in ctxs]
        windows = [None] * len(kvs)
        for stop in range(len(ctxs)):
            bad = list(kvs)
            bad[stop] = replace(kvs[stop], mode="int3-nowhere")
            x, done, reason, logits = stack.run(x0, ctxs[0], bad, windows)
            assert (done, logits) == (stop, None)
            assert reason == Fallback.KV_LAYOUT.value
            np.testing.assert_array_equal(x, ref[stop])
        x, done, reason, logits = stack.run(x0, ctxs[0], kvs, windows)
        assert (done, reason) == (len(ctxs), None)
        normed = m.kernels.rmsnorm(ref[-1], m.weights.norm, eps)
        np.testing.assert_array_equal(x, normed)
        np.testing.assert_array_equal(logits, m._project_head(normed[-1:], ForwardStats()))
        assert stack.run(x0, ctxs[0], kvs, windows, head=False)[3] is None
        seq.release()


def test_stack_checks_every_calls_block_table_and_reads_a_new_pools_arrays(pkg: Path) -> None:
    """The one call keeps each layer's parsed KV arrays while it is given the same views:
    a block table naming a block outside the pool is still refused, and the views of
    another pool (another layout) are read afresh, with the per-layer bits."""
    native_runtime_module("Stack")
    with rt.open(pkg, kernels="native", kv="int8", verify="none") as m:
        int8_steps = _steps(m)  # the stack now holds the int8 pool's views
        cfg, kvs = m.config, m.kv_pool.layers()
        ctx = _call_ctx(m, 1, np.asarray([m.kv_pool.num_blocks], np.int32))
        stack = m.kernels._stack(m.weights, ctx)
        x = m.weights.embed.lookup(np.asarray(IDS[:1]))
        with pytest.raises(ValueError, match="block_table"):
            stack.run(x, ctx, kvs, cfg.windows)
        pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, KVCacheConfig("float"))
        m.kv_pool = pool
        got = {}
        for one_call in (False, True):
            m.one_call = one_call
            got[one_call] = _steps(m)
    for a, b in zip(got[False], got[True], strict=True):
        np.testing.assert_array_equal(a, b)
    assert not all(np.array_equal(a, b) for a, b in zip(int8_steps, got[True], strict=True))


def test_model_resumes_layer_by_layer_where_the_stack_stopped(pkg: Path) -> None:
    native_runtime_module("Stack")
    with rt.open(pkg, kernels="native", verify="none") as m:
        m.one_call = False
        want = _steps(m)
        m.one_call = True
        calls = _count_layer_calls(m)

        def stops_at_layer_1(
            weights, x, ctx, kvs, windows, head, loras=None, rows=1, picks=None
        ) -> StackResult:
            kvs = list(kvs)
            kvs[1] = replace(kvs[1], mode="int3-nowhere")
            stack = m.kernels._stack(weights, ctx)
            out, done, _reason, logits = stack.run(x, ctx, kvs, windows, head, loras, rows, picks)
            assert done == 1
            return StackResult(out, done, logits)

        m.kernels.decoder_stack = stops_at_layer_1  # type: ignore[method-assign]
        got = _steps(m)
        assert calls[0] == 2 * len(got)  # layers 1 and 2 of every forward
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("activations", ["int8", "float"])
def test_one_call_forward_with_an_adapter_gives_the_per_layer_bits(
    tmp_path_factory: pytest.TempPathFactory, activations: str
) -> None:
    """A session's adapter runs inside the one call (each layer's LoRA read per call), with
    the bits of decoder_layer layer by layer; a session without one on the same model
    stays the base."""
    pytest.importorskip("peft")
    native_runtime_module("Stack")
    from adapterfactory import IDS as AIDS
    from adapterfactory import int8_base_and_adapter

    base, adapter = int8_base_and_adapter(tmp_path_factory.mktemp("one-call-lora"))
    with rt.open(base, kernels="native", activations=activations, verify="none") as m:
        handle = m.load_adapter(adapter)
        calls = _count_layer_calls(m)
        got = {}
        for one_call in (False, True):
            m.one_call = one_call
            calls[0] = 0
            got[one_call] = m.session(adapter=handle).logits(AIDS)
            assert (calls[0] == 0) == one_call
        base_logits = m.session().logits(AIDS)
    np.testing.assert_array_equal(got[False], got[True], strict=True)
    assert not np.array_equal(base_logits, got[True])


@pytest.mark.parametrize("encoding", ["int8", "int4-g32"])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_steps_give_the_single_ops_bits_where_the_pool_splits_the_products(
    tmp_path_factory: pytest.TempPathFactory, encoding: str, threads: int
) -> None:
    """A decode step runs q/k/v and gate/up as one pool job each: at sizes the pool splits
    (q and gate here; k and v too small to split), every logit is what the Python chain
    over the single native ops (one matmul per call) gives."""
    native_runtime_module("Stack")
    root = tmp_path_factory.mktemp(f"one-job-{encoding}")
    dims = {"hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8}
    pkg = convert_to(root, tiny_model_dir(root, num_hidden_layers=2, **dims), encoding)
    got = {}
    for fused in (True, False):
        with rt.open(pkg, kernels="native", threads=threads, verify="none") as m:
            assert isinstance(m.kernels, NativeKernels)
            m.kernels._fused_layer = fused
            got[fused] = _steps(m)
    for a, b in zip(got[True], got[False], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kernels", ["native", "numpy"])
def test_argmax_logits_are_each_rows_argmax_of_all_logits(pkg: Path, kernels: str) -> None:
    """``logits="argmax"`` (what a greedy verify pass asks for: the one call picks each
    row's argmax after its head) is numpy's float32 argmax of every ``"all"`` row, on the
    one call and layer by layer."""
    if kernels == "native":
        native_runtime_module("Stack")
    with rt.open(pkg, kernels=kernels, verify="none") as m:
        for one_call in (True, False):
            m.one_call = one_call
            seqs = [m.new_sequence() for _ in range(2)]
            for seq in seqs:
                m.forward(seq, IDS[:5], logits="none")
            rows = m.forward(seqs[0], IDS[5:], logits="all")
            picks = m.forward(seqs[1], IDS[5:], logits="argmax")
            assert picks.dtype == np.int64 and picks.shape == (len(IDS) - 5,)
            np.testing.assert_array_equal(picks, rows.argmax(axis=-1))
            assert seqs[0].tokens == seqs[1].tokens
            for seq in seqs:
                seq.release()


def test_stack_checks_its_rows_and_picks(pkg: Path) -> None:
    native_runtime_module("Stack")
    with rt.open(pkg, kernels="native", verify="none") as m:
        seq = m.new_sequence()
        seq.prepare(IDS[:3])
        cfg, kvs = m.config, m.kv_pool.layers()
        ctx = _call_ctx(m, 3, seq.block_table(3))
        stack = m.kernels._stack(m.weights, ctx)
        x = m.weights.embed.lookup(np.asarray(IDS[:3]))
        for rows, picks in ((0, None), (4, None), (3, np.empty(3, np.int32)), (2, np.empty(3))):
            with pytest.raises(ValueError, match=r"rows|picks"):
                stack.run(x, ctx, kvs, cfg.windows, True, None, rows, picks)
        picks = np.full(3, -1, np.int64)
        _x, done, _reason, logits = stack.run(x, ctx, kvs, cfg.windows, True, None, 3, picks)
        assert done == cfg.num_layers and logits.shape == (3, cfg.vocab_size)
        np.testing.assert_array_equal(picks, logits.argmax(axis=-1))
        seq.release()


def test_layer_views_follow_the_pools_arrays() -> None:
    """Reserving mapped blocks makes the pool's arrays anew: the views a forward is
    given must be of the new arrays, never kept from before."""
    from edgepack.runtime_shim.kv_cache import KVCacheConfig, KVPool

    pool = KVPool(2, 1, 64, KVCacheConfig())
    before = pool.layers()
    assert pool.layers() is before  # made once per set of arrays
    pool.reserve_mapped([40])
    after = pool.layers()
    assert after is not before
    fresh = pool.layer(0).k
    assert np.shares_memory(after[0].k, fresh)
    assert not np.shares_memory(before[0].k, fresh)

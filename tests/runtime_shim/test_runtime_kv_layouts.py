"""The KV layout table: the default's size bar, the legacy layout still selectable, the
native backend's typed fallback for layouts it lacks, and (slow, the real model) the
default keeping the float cache's answer."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from runtime_fixtures import convert_to, tiny_model_dir, tiny_package

import edgepack.runtime_shim as rt
from edgepack.runtime_shim.kernels import Fallback
from edgepack.runtime_shim.kv_cache import (
    DEFAULT_KV,
    KV_LAYOUTS,
    KVCacheConfig,
    KVPool,
)


@pytest.mark.parametrize("heads,head_dim", [(3, 64), (8, 64), (4, 128)])
def test_default_layout_is_at_most_045_of_f16(heads: int, head_dim: int) -> None:
    layout = KV_LAYOUTS[DEFAULT_KV]
    assert layout.ratio_to_f16(heads, head_dim) <= 0.45
    # what the pool really allocates per token agrees with the layout's arithmetic
    pool = KVPool(2, heads, head_dim, KVCacheConfig(block_size=4, budget_bytes=1 << 20))
    real = sum(a.nbytes for a in pool._arrays.values()) / (2 * pool.num_blocks * 4)
    assert real == layout.bytes_per_token_layer(heads, head_dim)
    assert real <= 0.45 * (2 * heads * head_dim * 2)


def test_legacy_layout_still_selectable(tmp_path_factory: pytest.TempPathFactory) -> None:
    legacy = KVCacheConfig(mode="int8-legacy").layout
    assert (legacy.k_bits, legacy.v_bits, legacy.v_group) == (8, 4, 32)
    pkg = tiny_package(tmp_path_factory, "f32")
    ids = list(range(1, 40))
    out = {}
    for kv in ("int8-legacy", "int8", "float"):
        with rt.open(pkg, kv=kv, kernels="numpy", verify="none") as m:
            assert m.kv_mode == kv
            out[kv] = m.logits(ids)
    assert not np.array_equal(out["int8-legacy"], out["int8"])  # two different caches
    err = {kv: np.abs(out[kv] - out["float"]).mean() for kv in ("int8-legacy", "int8")}
    assert err["int8"] < err["int8-legacy"] < 0.5, err
    with pytest.raises(ValueError):
        KVCacheConfig(mode="int4")


def test_head_dim_16_default_kv_runs_native(
    tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """8 heads of 16 (issue 14): no V group 32 fits, so V is grouped by 16, which the
    native kernels take (no fallback logged). With the float cache the result equals the
    numpy backend's to 1e-4; with the default cache the two attentions round differently,
    which may move a later layer's K/V code by one step, so the bound is that step's."""
    from edgepack import native

    if native.load() is None:
        pytest.skip("native extension not built")
    root = tmp_path_factory.mktemp("hd16")
    src = tiny_model_dir(root, num_attention_heads=8, num_key_value_heads=4)
    pkg = convert_to(root, src, "f32")
    ids = list(range(1, 30))
    out = {}
    for kv in (DEFAULT_KV, "float"):
        for kernels in ("native", "numpy"):
            with caplog.at_level(logging.WARNING, logger="edgepack.runtime"):
                with rt.open(pkg, kernels=kernels, kv=kv, verify="none") as m:
                    assert m.config.head_dim == 16
                    assert m.kv_pool.v_group == 16 or kv == "float"
                    s = m.session()
                    out[kernels, kv] = (m.logits(ids), list(s.generate(ids, max_tokens=8)))
    assert Fallback.KV_LAYOUT.value not in caplog.text
    nat, ref = out["native", "float"], out["numpy", "float"]
    np.testing.assert_allclose(nat[0], ref[0], rtol=1e-4, atol=1e-4)
    assert nat[1] == ref[1]
    nat, ref = out["native", DEFAULT_KV], out["numpy", DEFAULT_KV]
    np.testing.assert_allclose(nat[0], ref[0], rtol=1e-2, atol=1e-2)
    assert nat[1] == ref[1]


def test_native_layer_names_the_layout_it_lacks() -> None:
    """The fused native layer returns the typed reason instead of raising (a legacy cache
    at head_dim 12: V group 12, not a multiple of 8)."""
    from types import SimpleNamespace as NS

    from edgepack import native

    mod = native.load()
    if mod is None or not hasattr(mod, "decoder_layer"):
        pytest.skip("native extension without decoder_layer")
    cfg = KVCacheConfig(mode="int8-legacy", block_size=4, budget_bytes=1 << 16)
    pool = KVPool(1, 1, 12, cfg)
    assert pool.v_group == 12
    kv = pool.layer(0)
    ctx = NS(num_heads=1, num_kv_heads=1, head_dim=12, eps=1e-5, act_int8=False, kv=kv,
             positions=np.zeros(1, np.int64), n_ctx=1, cos=np.ones((1, 6), np.float32),
             sin=np.zeros((1, 6), np.float32), block_table=np.zeros(1, np.int32))  # fmt: skip
    out, reason = mod.decoder_layer(NS(), np.zeros((1, 12), np.float32), ctx)
    assert out is None and reason == Fallback.KV_LAYOUT.value


# -- the real model (slow) ------------------------------------------------------------------
@pytest.fixture(scope="module")
def f32_smollm2(smollm2_gguf, tmp_path_factory: pytest.TempPathFactory):
    from runtime_fixtures import smollm2_package

    root = tmp_path_factory.getbasetemp() / "smollm2-runtime"
    root.mkdir(exist_ok=True)
    return smollm2_package(smollm2_gguf, root, "f32")


@pytest.mark.slow
def test_default_kv_greedy_32_tokens_match_float_cache(f32_smollm2) -> None:
    got = {}
    for kv in (DEFAULT_KV, "float"):
        with rt.open(f32_smollm2, kv=kv, verify="none") as m:
            got[kv] = list(m.session().generate("The capital of France is", max_tokens=32,
                                                output="ids"))  # fmt: skip
    assert len(got["float"]) >= 16  # (it may stop at EOS)
    assert got[DEFAULT_KV] == got["float"]


@pytest.mark.slow
def test_default_kv_kl_against_float_cache_under_bar(f32_smollm2, tmp_path) -> None:
    from edgepack.packager.evaluate import evaluate

    res = evaluate(f32_smollm2, ref=f32_smollm2, kv=DEFAULT_KV, ref_kv="float",
                   activations="float", chunks=3, ref_cache=tmp_path)  # fmt: skip
    assert res.kl_mean <= 0.002, res.kl_mean
    legacy = evaluate(f32_smollm2, ref=f32_smollm2, kv="int8-legacy", ref_kv="float",
                      activations="float", chunks=3, ref_cache=tmp_path)  # fmt: skip
    assert legacy.kl_mean > res.kl_mean

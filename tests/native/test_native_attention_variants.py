"""The native kernels for what the Llama family varies, against the numpy reference:
GELU (exact and tanh) and ReLU gated activations, and attention with a sliding window,
score soft-capping and a custom scale on every KV layout (prefill equal to successive
decode steps bit for bit, both within float rounding of numpy's)."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_fixtures import kv_cache_args, native_runtime_module

from edgepack.runtime_shim.kernels.numpy_backend import NumpyKernels
from edgepack.runtime_shim.kv_cache import KV_LAYOUTS, KVCacheConfig, KVPool

H, D, BS = 2, 32, 4


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu"])
def test_gated_act_matches_numpy(act: str) -> None:
    mod = native_runtime_module("gated_act")
    r = np.random.default_rng(0)
    g = (r.standard_normal((5, 200)) * 4).astype(np.float32)
    g[0, :3] = [0.0, -0.0, 30.0]
    u = r.standard_normal((5, 200)).astype(np.float32)
    want = NumpyKernels(1).gated_activation(g, u, act)
    np.testing.assert_allclose(mod.gated_act(g, u, act), want, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="act"):
        mod.gated_act(g, u, "silu")


def _pool(mode: str) -> tuple[KVPool, np.ndarray]:
    pool = KVPool(1, H, D, KVCacheConfig(mode=mode, block_size=BS, budget_bytes=1 << 18))
    pool.allocate()  # the sequence's blocks are not 0, 1, ...
    seq = pool.sequence()
    seq.prepare(list(range(40)))
    return pool, seq.block_table(40)


@pytest.mark.parametrize("mode", list(KV_LAYOUTS))
@pytest.mark.parametrize(
    "window,softcap,scale", [(5, None, None), (None, 3.0, None), (6, 2.5, 0.2), (64, None, 0.3)]
)
def test_attention_variants_prefill_equals_decode_and_numpy(
    mode: str, window: int | None, softcap: float | None, scale: float | None
) -> None:
    mod = native_runtime_module("attention_prefill")
    hq, t0, n = 6, 7, 13
    r = np.random.default_rng(3)
    kx = (r.standard_normal((t0 + n, H, D)) * 2).astype(np.float32)
    vx = r.standard_normal((t0 + n, H, D)).astype(np.float32)
    q = (r.standard_normal((n, hq, D)) * 2).astype(np.float32)
    opts = {k: v for k, v in (("window", window), ("softcap", softcap), ("scale", scale))
            if v is not None}  # fmt: skip
    outs = []
    for call in ("prefill", "decode"):
        pool, table = _pool(mode)
        arrays, kw = kv_cache_args(pool)
        mod.kv_write(kx[:t0], vx[:t0], *arrays, table, 0, **kw)
        if call == "prefill":
            out = mod.attention_prefill(q, kx[t0:], vx[t0:], *arrays, table, t0, **kw, **opts)
            outs.append(out)
        else:
            outs.append(np.stack([
                mod.attention_decode(q[i], kx[t0 + i], vx[t0 + i], *arrays, table, t0 + i,
                                     **kw, **opts)
                for i in range(n)
            ]))  # fmt: skip
    assert outs[0].tobytes() == outs[1].tobytes()
    nk = NumpyKernels(1)

    def reference(*args: object) -> np.ndarray:
        pool, table = _pool(mode)
        nk.kv_write(pool.layer(0), kx[:t0], vx[:t0], table, 0)
        return nk.attend(q, kx[t0:], vx[t0:], pool.layer(0), table, t0, *args)

    want = reference(window, scale, softcap)
    np.testing.assert_allclose(outs[0], want.reshape(n, hq, D), rtol=1e-5, atol=1e-5)
    assert np.abs(reference() - want).max() > 1e-3  # the options change the result


def test_attention_rejects_bad_options() -> None:
    mod = native_runtime_module("attention_prefill")
    pool, table = _pool("float")
    arrays, _ = kv_cache_args(pool)
    x = np.zeros((1, H, D), np.float32)
    with pytest.raises(ValueError, match="window"):
        mod.attention_prefill(x, x, x, arrays[0], None, arrays[2], None, table, 0, window=-1)
    with pytest.raises(ValueError, match="softcap"):
        mod.attention_prefill(x, x, x, arrays[0], None, arrays[2], None, table, 0, softcap=np.inf)
    with pytest.raises(ValueError, match="rotate"):
        mod.attention_prefill(x, x, x, arrays[0], None, arrays[2], None, table, 0, rotate=True)

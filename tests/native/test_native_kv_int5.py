"""The native kernels on the float16-K-scale layouts ("int8-v5": K int8, V int5 asymmetric
with float16 scale and min per group; "int8", the default: Hadamard-rotated K int8 and V
int6 with one scale byte per token), at their V groups and at 16 (head_dim 16 models):
the codes equal the numpy reference's bit for bit, prefill equals successive decode steps
bit for bit, and attention agrees with numpy's within float rounding."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_fixtures import native_runtime_module

from edgepack.runtime_shim.errors import NumericError
from edgepack.runtime_shim.kernels.numpy_backend import NumpyKernels
from edgepack.runtime_shim.kv_cache import KVCacheConfig, KVPool

H, D, BS = 3, 64, 16
LAYOUTS = [("int8", None), ("int8-v5", None), ("int8", 16), ("int8-v5", 16)]


def _pool(mode: str = "int8", v_group: int | None = None) -> tuple[KVPool, np.ndarray]:
    cfg = KVCacheConfig(mode=mode, block_size=BS, budget_bytes=1 << 20, v_group=v_group)
    pool = KVPool(1, H, D, cfg)
    assert pool.layout.name == mode and pool.layout.native
    assert pool.v_group == (v_group or (D if mode == "int8" else 32))
    pool.allocate()  # scatter: the sequence's blocks are not 0, 1, ...
    seq = pool.sequence()
    seq.prepare(list(range(60)))
    return pool, seq.block_table(60)


def _args(pool: KVPool) -> tuple[tuple, dict]:
    kv = pool.layer(0)
    kw = {"v_high": kv.v_high, "rotate": pool.layout.rotate}
    if kv.v_mins is not None:
        kw["v_mins"] = kv.v_mins
    return (kv.k, kv.k_scales, kv.v, kv.v_scales), kw


def _tokens(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    r = np.random.default_rng(seed)
    k = r.standard_normal((n, H, D)).astype(np.float32) * 3
    v = r.standard_normal((n, H, D)).astype(np.float32) + 0.5
    return k, v


@pytest.mark.parametrize("mode,v_group", LAYOUTS)
def test_native_int5_codes_equal_numpy(mode: str, v_group: int | None) -> None:
    mod = native_runtime_module("kv_write")
    kx, vx = _tokens(40, 0)
    kx[3, 1] = 0.0  # zero head and group: scale 0
    vx[4, 2, :32] = 1.25  # constant group: scale 0, min carries it
    nat, table = _pool(mode, v_group)
    ref, _ = _pool(mode, v_group)
    arrays, kw = _args(nat)
    mod.kv_write(kx[:25], vx[:25], *arrays, table, 0, **kw)
    mod.kv_write(kx[25:], vx[25:], *arrays, table, 25, **kw)
    NumpyKernels(1).kv_write(ref.layer(0), kx, vx, table, 0)
    for name, arr in nat._arrays.items():
        np.testing.assert_array_equal(arr, ref._arrays[name], err_msg=name)
    kd, vd = mod.kv_read(*arrays, table, 40, **kw)
    kr, vr = NumpyKernels(1).read_kv(ref.layer(0), table, 40)
    np.testing.assert_allclose(kd, kr, rtol=0, atol=1e-6)  # (rotated back: float rounding)
    np.testing.assert_allclose(vd, vr, rtol=0, atol=1e-6)
    if not nat.layout.rotate:
        np.testing.assert_array_equal(kd, kr)


@pytest.mark.parametrize("mode,v_group", LAYOUTS)
def test_native_int5_prefill_equals_decode_and_numpy(mode: str, v_group: int | None) -> None:
    mod = native_runtime_module("attention_prefill")
    hq, t0, n = 9, 5, 21
    kx, vx = _tokens(t0 + n, 1)
    q = np.random.default_rng(2).standard_normal((n, hq, D)).astype(np.float32)
    outs = []
    for call in ("prefill", "decode"):
        pool, table = _pool(mode, v_group)
        arrays, kw = _args(pool)
        mod.kv_write(kx[:t0], vx[:t0], *arrays, table, 0, **kw)
        if call == "prefill":
            outs.append(mod.attention_prefill(q, kx[t0:], vx[t0:], *arrays, table, t0, **kw))
        else:
            outs.append(np.stack([
                mod.attention_decode(q[i], kx[t0 + i], vx[t0 + i], *arrays, table, t0 + i, **kw)
                for i in range(n)
            ]))  # fmt: skip
    assert outs[0].tobytes() == outs[1].tobytes()
    pool, table = _pool(mode, v_group)
    nk = NumpyKernels(1)
    nk.kv_write(pool.layer(0), kx[:t0], vx[:t0], table, 0)
    want = nk.attend(q, kx[t0:], vx[t0:], pool.layer(0), table, t0).reshape(n, hq, D)
    np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-5)


def test_native_int5_refuses_missing_planes() -> None:
    mod = native_runtime_module("kv_write")
    pool, table = _pool("int8-v5")
    arrays, _ = _args(pool)
    kx, vx = _tokens(1, 3)
    with pytest.raises(ValueError, match="v_high"):
        mod.kv_write(kx, vx, *arrays, table, 0)
    pool, table = _pool("int8")
    arrays, _ = _args(pool)
    with pytest.raises(ValueError, match="v_high"):
        mod.kv_write(kx, vx, *arrays, table, 0)


def test_native_int6_scale_overflow_writes_nothing() -> None:
    """A V whose int6 scale byte would reach float16 infinity is refused, all or nothing."""
    mod = native_runtime_module("kv_write")
    pool, table = _pool("int8")
    arrays, kw = _args(pool)
    kx, vx = _tokens(2, 4)
    vx[1, 0, :] = 60000.0 * 31  # absmax / 31 rounds up past the largest float16
    with pytest.raises(NumericError):
        mod.kv_write(kx, vx, *arrays, table, 0, **kw)
    assert not any(a.any() for a in pool._arrays.values())

"""The kernel interface: numpy reference against direct definitions, and the native
adapter (when the extension has runtime kernels) against numpy within stated tolerances."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from edgepack.format import Encoding, codecs
from edgepack.runtime_shim.kernels import (
    ACT_SCALE_MAX,
    NativeKernels,
    NumpyKernels,
    QuantizedActivations,
    select_kernels,
)
from edgepack.runtime_shim.kv_cache import KVCacheConfig, KVPool, rotate_heads
from edgepack.runtime_shim.weights import Linear

RNG = np.random.default_rng(1234)


def make_linear(enc: Encoding, rows: int, cols: int, group: int = 32, seed: int = 0) -> Linear:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
    if enc == Encoding.F32:
        return Linear("w", enc, rows, cols, codes=w)
    if enc == Encoding.F16:
        return Linear("w", enc, rows, cols, codes=w.astype(np.float16))
    if enc == Encoding.BF16:
        bits = (w.view(np.uint32) >> 16).astype(np.uint16)
        return Linear("w", enc, rows, cols, codes=bits)
    if enc == Encoding.INT8_CHANNEL:
        c, s = codecs.quantize_int8_channel(w)
        return Linear("w", enc, rows, cols, codes=c, scales=s)
    bits = getattr(enc, "bits", 4)
    sym = enc in SYMMETRIC
    if bits == 4:
        c, s, z = codecs.quantize_int4_group(w, group, symmetric=sym)
    else:
        c, s, z = codecs.quantize_group(w, bits, group, symmetric=sym)
    return Linear("w", enc, rows, cols, codes=c, scales=s, zeros=z, group_size=group)


def dense(lin: Linear) -> np.ndarray:
    if lin.encoding == Encoding.F32:
        return lin.codes
    if lin.encoding == Encoding.F16:
        return lin.codes.astype(np.float32)
    if lin.encoding == Encoding.BF16:
        return (lin.codes.astype(np.uint32) << 16).view(np.float32)
    if lin.encoding == Encoding.INT8_CHANNEL:
        return codecs.dequantize_int8_channel(lin.codes, lin.scales)
    bits = getattr(lin.encoding, "bits", 4)
    if bits == 4:
        return codecs.dequantize_int4_group(lin.codes, lin.scales, lin.zeros, lin.group_size)
    return codecs.dequantize_group(lin.codes, lin.scales, lin.zeros, bits, lin.group_size)


@pytest.fixture(scope="module")
def nk() -> NumpyKernels:
    k = NumpyKernels(threads=2)
    yield k
    k.close()


ENCODINGS = [
    Encoding.F32,
    Encoding.F16,
    Encoding.BF16,
    Encoding.INT8_CHANNEL,
    Encoding.INT4_GROUP_SYM,
    Encoding.INT4_GROUP_ASYM,
]
# int3 / int2 group codes, where this format version defines them
ENCODINGS += [
    getattr(Encoding, n)
    for n in ("INT3_GROUP_SYM", "INT3_GROUP_ASYM", "INT2_GROUP_SYM", "INT2_GROUP_ASYM")
    if hasattr(Encoding, n)
]
SYMMETRIC = {e for e in ENCODINGS if e.name.endswith("_SYM")}


@pytest.mark.parametrize("enc", ENCODINGS, ids=lambda e: e.name)
@pytest.mark.parametrize("tokens", [1, 7])
def test_matmul_equals_dequantized_reference(nk: NumpyKernels, enc: Encoding, tokens: int) -> None:
    lin = make_linear(enc, 1000, 256)  # several row blocks, both threads busy
    x = RNG.standard_normal((tokens, 256)).astype(np.float32)
    ref = x.astype(np.float64) @ dense(lin).astype(np.float64).T
    out = nk.matmul(x, lin)
    assert out.shape == (tokens, 1000) and out.dtype == np.float32
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_matmul_bias_residual_and_low_rank(nk: NumpyKernels) -> None:
    u = make_linear(Encoding.INT8_CHANNEL, 96, 16, seed=1)
    v = make_linear(Encoding.INT4_GROUP_SYM, 16, 64, seed=2)
    bias = RNG.standard_normal(96).astype(np.float32)
    lr = Linear("lr", Encoding.LOW_RANK, 96, 64, bias=bias, factors=(u, v))
    x = RNG.standard_normal((3, 64)).astype(np.float32)
    res = RNG.standard_normal((3, 96)).astype(np.float32)
    ref = x @ (dense(u) @ dense(v)).T + bias + res
    np.testing.assert_allclose(nk.matmul(x, lr, residual=res), ref, rtol=1e-4, atol=1e-4)


def test_quantize_activations_definition(nk: NumpyKernels) -> None:
    x = RNG.standard_normal((5, 96)).astype(np.float32)
    x[2, 40] = 300.0  # an outlier coarsens only its own group
    qa = nk.quantize_activations(x, 32)
    assert qa.q.dtype == np.int8 and qa.scales.shape == (5, 3) and not qa.overflow
    g = x.reshape(5, 3, 32)
    d = np.abs(g).max(-1) / np.float32(127)
    np.testing.assert_array_equal(qa.scales, d.astype(np.float32))
    expect = np.clip(np.rint(g * (np.float32(1) / d)[..., None]), -127, 127).reshape(5, 96)
    np.testing.assert_array_equal(qa.q, expect.astype(np.int8))
    err = np.abs(qa.dequantize() - x)
    assert (err <= np.repeat(d, 32, axis=1) / 2 + 1e-6).all()
    # deterministic bits
    again = nk.quantize_activations(x.copy(), 32)
    assert again.q.tobytes() == qa.q.tobytes() and again.scales.tobytes() == qa.scales.tobytes()


def test_quantize_activations_overflow(nk: NumpyKernels) -> None:
    x = np.ones((2, 64), np.float32)
    assert not nk.quantize_activations(x, 32).overflow
    x[1, 3] = ACT_SCALE_MAX * 127 * 2
    assert nk.quantize_activations(x, 32).overflow
    x[1, 3] = np.inf
    assert nk.quantize_activations(x, 64).overflow
    x[1, 3] = np.nan
    assert nk.quantize_activations(x, 64).overflow
    zeros = nk.quantize_activations(np.zeros((1, 32), np.float32), 32)
    assert not zeros.overflow and not zeros.q.any()


def test_rmsnorm_swiglu_rope(nk: NumpyKernels) -> None:
    x = RNG.standard_normal((4, 64)).astype(np.float32)
    w = RNG.standard_normal(64).astype(np.float32)
    ref = w * (x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5))
    np.testing.assert_allclose(nk.rmsnorm(x, w, 1e-5), ref, rtol=1e-5, atol=1e-6)
    g, u = x, RNG.standard_normal((4, 64)).astype(np.float32)
    np.testing.assert_allclose(nk.swiglu(g, u), g / (1 + np.exp(-g)) * u, rtol=1e-6, atol=1e-7)
    q = RNG.standard_normal((4, 3, 16)).astype(np.float32)
    ang = RNG.standard_normal((4, 8)).astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    out = nk.rope(q, cos, sin, np.arange(4))
    c = np.concatenate([cos, cos], -1)[:, None]
    s = np.concatenate([sin, sin], -1)[:, None]
    rot = np.concatenate([-q[..., 8:], q[..., :8]], -1)
    np.testing.assert_allclose(out, q * c + rot * s, rtol=1e-6, atol=1e-6)


def _naive_attention(q, k, v, start):
    t, nh, hd = q.shape
    nkv = k.shape[1]
    out = np.zeros((t, nh, hd))
    for i in range(t):
        for h in range(nh):
            kh = k[: start + i + 1, h // (nh // nkv)]
            s = kh @ q[i, h] / np.sqrt(hd)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, h] = p @ v[: start + i + 1, h // (nh // nkv)]
    return out.reshape(t, nh * hd)


@pytest.mark.parametrize("mode", ["float", "int8-legacy", "int8-v5", "int8"])
def test_attend_paged_matches_naive(nk: NumpyKernels, mode: str) -> None:
    pool = KVPool(1, 2, 64, KVCacheConfig(mode=mode, block_size=4, budget_bytes=1 << 20))
    seq = pool.sequence()
    n1, n2 = 9, 5
    k = RNG.standard_normal((n1 + n2, 2, 64)).astype(np.float32)
    v = RNG.standard_normal((n1 + n2, 2, 64)).astype(np.float32)
    q = RNG.standard_normal((n1 + n2, 6, 64)).astype(np.float32)
    # scatter the blocks: allocate some other block first
    pool.allocate()
    outs = []
    for a, b in ((0, n1), (n1, n1 + n2)):
        seq.prepare(list(range(a, b)))
        table = seq.block_table(b)
        outs.append(nk.attend(q[a:b], k[a:b], v[a:b], pool.layer(0), table, a))
        seq.commit()
    out = np.concatenate(outs)
    ref = _naive_attention(q, k, v, 0)
    if mode == "float":
        np.testing.assert_allclose(out, ref, atol=1e-5)
    else:  # V int4 error: at most half a step (max |v| / 8) of the group, averaged
        assert np.abs(out - ref).max() < np.abs(v).max() / 16
        cos = (out * ref).sum() / np.sqrt((out**2).sum() * (ref**2).sum())
        assert cos > 0.995
    if mode == "int8":  # read back: in the rotated basis, K int8 and V int6 per token/head
        kr, vr = (rotate_heads(a) for a in nk.read_kv(pool.layer(0), seq.block_table(), seq.length))
        kt, vt = rotate_heads(k), rotate_heads(v)
        kstep = np.abs(kt).max(-1, keepdims=True).astype(np.float16).astype(np.float32) / 127
        assert (np.abs(kr - kt) <= kstep / 2 * 1.01 + 1e-5).all()
        vstep = np.abs(vt).max(-1, keepdims=True) / 31 * 1.125  # scale byte: up to 1/8 above
        err = np.abs(vr - vt)
        assert (err <= vstep / 2 + 1e-5).all() and err.mean() < vstep.mean() / 3
    if mode == "int8-v5":  # read back: K int8 per token/head (f16 scale), V int5 asym g32
        kr, vr = nk.read_kv(pool.layer(0), seq.block_table(), seq.length)
        kstep = np.abs(k).max(-1, keepdims=True).astype(np.float16).astype(np.float32) / 127
        assert (np.abs(kr - k) <= kstep / 2 * 1.01 + 1e-6).all()
        vg = v.reshape(n1 + n2, 2, 2, 32)
        vstep = (vg.max(-1, keepdims=True) - vg.min(-1, keepdims=True)) / 31
        err = np.abs(vr.reshape(vg.shape) - vg)
        assert (err <= vstep * 0.51 + 2e-3).all() and err.mean() < vstep.mean() / 3
    if mode == "int8-legacy":  # read back: K int8 per token/head, V int4 groups of 32
        kr, vr = nk.read_kv(pool.layer(0), seq.block_table(), seq.length)
        kstep = np.abs(k).max(-1, keepdims=True) / 127
        assert (np.abs(kr - k) <= kstep / 2 + 1e-6).all()
        vg = v.reshape(n1 + n2, 2, 2, 32)
        vstep = np.abs(vg).max(-1, keepdims=True) / 8  # half a step, one where +8 clips to +7
        err = np.abs(vr.reshape(vg.shape) - vg)
        assert (err <= vstep * 1.001).all() and err.mean() < vstep.mean() / 3


def test_attend_refuses_non_finite_kv(nk: NumpyKernels) -> None:
    pool = KVPool(1, 1, 32, KVCacheConfig(block_size=4, budget_bytes=1 << 16))
    seq = pool.sequence()
    seq.prepare([1])
    k = np.full((1, 1, 32), np.nan, np.float32)
    with pytest.raises(FloatingPointError):
        nk.attend(np.ones((1, 2, 32), np.float32), k, k, pool.layer(0), seq.block_table(1), 0)


def test_select_kernels_honours_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEPACK_KERNELS", "numpy")
    k = select_kernels()
    assert isinstance(k, NumpyKernels) and k.name == "numpy"
    k.close()
    with pytest.raises(ValueError):
        select_kernels("fast")


# -- native adapter ------------------------------------------------------------------------
def _native() -> NativeKernels | None:
    from edgepack import native

    mod = native.load()
    if mod is None:
        return None
    k = NativeKernels(mod, threads=2)
    return k if k.implements_any else None


@pytest.fixture(scope="module")
def native_k():
    k = _native()
    if k is None:
        pytest.skip("native extension without runtime kernels")
    yield k
    k.close()


@pytest.mark.parametrize("enc", ENCODINGS, ids=lambda e: e.name)
def test_native_matmul_agrees_with_numpy(native_k, nk: NumpyKernels, enc: Encoding) -> None:
    lin = make_linear(enc, 256, 128)
    native_k.bind([lin])
    x = RNG.standard_normal((5, 128)).astype(np.float32)
    res = RNG.standard_normal((5, 256)).astype(np.float32)
    np.testing.assert_allclose(
        native_k.matmul(x, lin, res), nk.matmul(x, lin, res), rtol=1e-4, atol=1e-4
    )
    if lin.is_quantized:
        qa = nk.quantize_activations(x, lin.act_group)
        got = native_k.matmul(qa, lin)
        np.testing.assert_allclose(got, nk.matmul(qa, lin), rtol=1e-4, atol=1e-4)


def test_native_elementwise_agree_with_numpy(native_k, nk: NumpyKernels) -> None:
    x = RNG.standard_normal((3, 128)).astype(np.float32)
    w = RNG.standard_normal(128).astype(np.float32)
    np.testing.assert_allclose(native_k.rmsnorm(x, w, 1e-5), nk.rmsnorm(x, w, 1e-5), rtol=1e-5)
    qa_n, qa_r = native_k.quantize_activations(x, 32), nk.quantize_activations(x, 32)
    np.testing.assert_array_equal(qa_n.scales, qa_r.scales)
    np.testing.assert_array_equal(qa_n.q, qa_r.q)
    u = RNG.standard_normal((3, 128)).astype(np.float32)
    np.testing.assert_allclose(native_k.swiglu(x, u), nk.swiglu(x, u), rtol=1e-5, atol=1e-6)
    big = x.copy()
    big[0, 0] = np.inf
    assert native_k.quantize_activations(big, 32).overflow
    assert native_k.rmsnorm_quantize(big, w, 1e-5, 32).overflow


@pytest.mark.parametrize("mode", ["float", "int8-legacy", "int8"])
def test_native_attend_agrees_with_numpy(native_k, nk: NumpyKernels, mode: str) -> None:
    outs = []
    for kern in (native_k, nk):
        pool = KVPool(1, 2, 64, KVCacheConfig(mode=mode, block_size=16, budget_bytes=1 << 20))
        seq = pool.sequence()
        rng = np.random.default_rng(5)
        res = []
        for a, b in ((0, 20), (20, 21), (21, 22)):
            q = rng.standard_normal((b - a, 6, 64)).astype(np.float32)
            k = rng.standard_normal((b - a, 2, 64)).astype(np.float32)
            v = rng.standard_normal((b - a, 2, 64)).astype(np.float32)
            seq.prepare(list(range(a, b)))
            res.append(kern.attend(q, k, v, pool.layer(0), seq.block_table(b), a))
            seq.commit()
        outs.append(np.concatenate(res))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def test_native_missing_op_falls_back_with_one_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edgepack import native

    class Partial:  # a native module that only has rmsnorm
        @staticmethod
        def active_isa() -> str:
            return "test"

        @staticmethod
        def rmsnorm(x, w, eps):
            return NumpyKernels(1).rmsnorm(x, w, eps)

    monkeypatch.setattr(native, "load", lambda: Partial())
    monkeypatch.delenv("EDGEPACK_KERNELS", raising=False)
    with caplog.at_level(logging.INFO, logger="edgepack.runtime"):
        k = select_kernels(threads=1)
        lin = make_linear(Encoding.INT8_CHANNEL, 8, 32)
        x = np.ones((1, 32), np.float32)
        for _ in range(3):
            np.testing.assert_allclose(k.matmul(x, lin), NumpyKernels(1).matmul(x, lin))
            qa = k.quantize_activations(x, 32)
    assert isinstance(k, NativeKernels) and k.implements_any
    assert "matmul" in k.missing and "rmsnorm" not in k.missing and "numpy:" in k.name
    assert isinstance(qa, QuantizedActivations) and not qa.overflow
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "matmul" in warnings[0].getMessage()
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any(m.startswith("kernels: native:test") for m in infos)
    k.close()


def test_native_forced_but_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    from edgepack import native
    from edgepack.runtime_shim import KernelUnavailableError

    monkeypatch.setattr(native, "load", lambda: None)
    with pytest.raises(KernelUnavailableError):
        select_kernels("native")
    monkeypatch.setenv("EDGEPACK_KERNELS", "native")
    with pytest.raises(KernelUnavailableError):
        select_kernels()
    k = select_kernels("auto")
    assert isinstance(k, NumpyKernels)


@pytest.mark.parametrize("enc", [Encoding.INT8_CHANNEL, Encoding.INT4_GROUP_SYM], ids=str)
@pytest.mark.parametrize("tokens", [1, 3])
def test_threaded_matmul_is_bit_identical_to_one_thread(enc: Encoding, tokens: int) -> None:
    lin = make_linear(enc, 4096, 1024)  # large enough to be split over the pool
    x = RNG.standard_normal((tokens, 1024)).astype(np.float32)
    one, two = NumpyKernels(1), NumpyKernels(2)
    try:
        a, b = one.matmul(x, lin), two.matmul(x, lin)
    finally:
        one.close()
        two.close()
    assert a.tobytes() == b.tobytes()
    ref = x.astype(np.float64) @ dense(lin).astype(np.float64).T
    np.testing.assert_allclose(a, ref, rtol=1e-4, atol=1e-3)

"""Native inference kernels against independent numpy references, on every usable ISA.

Numerics contract (native/src/infer/infer.h):
* quantize_act / rmsnorm_quant / swiglu_quant / KV quantize-on-write: bit-identical to
  the numpy reference below (codecs semantics: d = amax/127, q = clip(rint(x * (1/d)))).
* rmsnorm, swiglu, rope, attention: bit-identical across ISAs (canonical 16-lane sums,
  unfused multiply/add), and within a few float32 ulp of a float64 numpy reference.
* matmul_q8 / matmul_f32 / lowrank: exact int32 block sums, float combination in SIMD
  lanes: |y - y_ref| <= 1e-5 * sum|terms| (+ tiny absolute), and ISAs agree with the
  scalar reference within the same bound; matmul_q8 on AVX-512 and NEON follows the
  reference's order and is bit-identical to it.  Bit-identical for any thread count, and a
  GEMM row equals the GEMV of that token.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest
from gilcheck import runs_python_during

from edgepack.format import codecs
from edgepack.format.errors import EdgepackError

k = pytest.importorskip("edgepack.native._kernels")

ISAS = k.available_isas()
RTOL_MM = 1e-5


@pytest.fixture
def threads() -> Iterator[None]:
    previous = k.get_threads()
    try:
        yield
    finally:
        k.set_threads(previous)


def on_each_isa(fn, *args, **kwargs) -> dict[str, object]:
    """fn(*args) evaluated under every usable ISA (restoring the active one)."""
    previous = k.active_isa()
    out = {}
    try:
        for name in ISAS:
            k.set_isa(name)
            out[name] = fn(*args, **kwargs)
    finally:
        k.set_isa(previous)
    return out


def same_bits(a, b) -> bool:
    if isinstance(a, tuple):
        return all(same_bits(x, y) for x, y in zip(a, b, strict=True))
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_same_on_all_isas(fn, *args, **kwargs):
    results = on_each_isa(fn, *args, **kwargs)
    ref = results["scalar"]
    for name, got in results.items():
        assert same_bits(got, ref), f"{name} differs from scalar"
    return ref


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# ------------------------------------------------------------------ numpy references


def np_quant(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """codecs int8 semantics per group of a float32 [T, K] matrix."""
    T, K = x.shape
    g = K if group == 0 else group
    xg = x.reshape(T, K // g, g)
    d = (np.abs(xg).max(axis=-1) / np.float32(127)).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # 1/subnormal = inf; 0 * inf = nan -> 0
        inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
        y = xg * inv[..., None]
        y[np.isnan(y)] = 0
    q = np.clip(np.rint(y), -127, 127).astype(np.int8)
    return q.reshape(T, K), d


def np_rmsnorm64(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    r = 1.0 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + eps)
    return x64 * r * w.astype(np.float64)


def np_swiglu64(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    g64 = g.astype(np.float64)
    return g64 / (1.0 + np.exp(-g64)) * u.astype(np.float64)


def np_inv_freq(D: int, theta: float) -> np.ndarray:
    """The kernel's default: theta ** (-2j / D) in float64, rounded once to float32."""
    return (float(theta) ** (-np.arange(0, D, 2, dtype=np.float64) / D)).astype(np.float32)


def np_rope64(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    ang = (pos.astype(np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)  # f32 product
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def np_matmul_q8(xq, xs, ga, enc, codes, scales, zeros, gw):
    """float64 result and sum|terms| bound of the int32-accumulation definition."""
    T, K = xq.shape
    ga = K if ga == 0 else ga
    x = xq.astype(np.int64)
    if enc == "int8":
        B = ga
        w = codes.astype(np.int64)
        N = w.shape[0]
        isum = np.einsum("tbk,nbk->tnb", x.reshape(T, K // B, B), w.reshape(N, K // B, B))
        terms = xs.astype(np.float64)[:, None, :] * isum * scales.astype(np.float64)[None, :, None]
    else:
        nib = codecs.unpack_nibbles(codes).astype(np.int64)
        N = nib.shape[0]
        w = nib if enc == "int4_asym" else nib - 8
        B = min(ga, gw)
        nb = K // B
        isum = np.einsum("tbk,nbk->tnb", x.reshape(T, nb, B), w.reshape(N, nb, B))
        bidx = np.arange(nb) * B
        s_b = xs.astype(np.float64)[:, bidx // ga]
        d_b = scales.astype(np.float64)[:, bidx // gw]
        terms = s_b[:, None, :] * d_b[None, :, :] * isum
        if enc == "int4_asym":
            xsum = x.reshape(T, nb, B).sum(-1)
            m_b = zeros.astype(np.float64)[:, bidx // gw]
            terms = terms + s_b[:, None, :] * m_b[None, :, :] * xsum[:, None, :]
    return terms.sum(-1), np.abs(terms).sum(-1)


def np_dequant(enc, codes, scales, zeros, gw) -> np.ndarray:
    if enc == "f32":
        return codes
    if enc == "f16":
        return codes.astype(np.float32)
    if enc == "bf16":
        return (codes.astype(np.uint32) << 16).view(np.float32)
    if enc == "int8":
        return codecs.dequantize_int8_channel(codes, scales)
    return codecs.dequantize_int4_group(codes, scales, zeros, gw)


def make_weight(enc: str, N: int, K: int, gw: int, seed: int = 1):
    w = rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05
    if enc == "f32":
        return w, None, None
    if enc == "f16":
        return w.astype(np.float16), None, None
    if enc == "bf16":
        return (w.view(np.uint32) >> 16).astype(np.uint16), None, None
    if enc == "int8":
        c, s = codecs.quantize_int8_channel(w)
        return c, s, None
    return codecs.quantize_int4_group(w, gw, enc == "int4_sym")


def check_close(got, want64, bound, rtol=RTOL_MM, what=""):
    err = np.abs(got.astype(np.float64) - want64)
    lim = rtol * bound + 1e-30
    bad = err > lim
    assert not bad.any(), f"{what}: {bad.sum()} outside tolerance, worst {(err / lim).max():.3g}x"


# ------------------------------------------------------------------ activation quantization


@pytest.mark.parametrize("K,group", [(576, 0), (576, 32), (1536, 64), (100, 0), (120, 24), (7, 7)])
def test_quantize_act_matches_numpy(isa: str, K: int, group: int) -> None:
    x = rng(K).standard_normal((5, K)).astype(np.float32) * 3
    x[1] = 0.0  # all-zero row: scale 0, codes 0
    x[2, :4] = [1e-3, -2.5, 2.5, 0.5]  # ties at .5 round to even
    x[3] *= 1e-40  # subnormal scale: 1/d overflows, zeros stay 0
    q, s = k.quantize_act(x, group)
    qr, sr = np_quant(x, group)
    assert q.dtype == np.int8 and s.dtype == np.float32
    assert s.shape == (5, K // (group or K))
    assert same_bits(s, sr.reshape(s.shape))
    assert same_bits(q, qr)


def test_quantize_act_strided_rows() -> None:
    big = rng(1).standard_normal((4, 1000)).astype(np.float32)
    x = big[:, 100:676]
    q, s = k.quantize_act(x, 32)
    q2, s2 = k.quantize_act(np.ascontiguousarray(x), 32)
    assert same_bits(q, q2) and same_bits(s, s2)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantize_act_non_finite_raises_numeric_error(bad: float) -> None:
    x = np.ones((3, 64), np.float32)
    x[2, 17] = bad
    with pytest.raises(k.NumericError) as info:
        k.quantize_act(x, 32)
    err = info.value
    assert isinstance(err, EdgepackError) and isinstance(err, FloatingPointError)
    assert err.kind == "non_finite" and err.op == "quantize_act"
    assert (err.row, err.col) == (2, 17)


# ------------------------------------------------------------------ RMSNorm / SwiGLU / RoPE


@pytest.mark.parametrize("K", [576, 64, 100, 3])
def test_rmsnorm_bit_identical_across_isas_and_close_to_numpy(K: int) -> None:
    x = rng(K).standard_normal((6, K)).astype(np.float32)
    w = rng(K + 1).standard_normal(K).astype(np.float32)
    y = assert_same_on_all_isas(k.rmsnorm, x, w, 1e-5)
    want = np_rmsnorm64(x, w, 1e-5)
    assert np.abs(y - want).max() <= 4e-7 * np.abs(want).max()


def test_rmsnorm_in_place_and_out() -> None:
    x = rng(2).standard_normal((3, 64)).astype(np.float32)
    w = np.ones(64, np.float32)
    want = k.rmsnorm(x, w, 1e-6)
    out = np.empty_like(x)
    assert k.rmsnorm(x, w, 1e-6, out=out) is out
    assert same_bits(out, want)
    y = x.copy()
    k.rmsnorm(y, w, 1e-6, out=y)
    assert same_bits(y, want)


@pytest.mark.parametrize("group", [0, 32, 576])
def test_rmsnorm_quant_equals_quantize_of_rmsnorm(isa: str, group: int) -> None:
    x = rng(3).standard_normal((4, 576)).astype(np.float32) * 10
    w = rng(4).standard_normal(576).astype(np.float32)
    q, s = k.rmsnorm_quant(x, w, 1e-5, group)
    qr, sr = np_quant(k.rmsnorm(x, w, 1e-5), group)
    assert same_bits(q, qr) and same_bits(s, sr)


def test_rmsnorm_quant_large_group_recompute_path() -> None:
    x = rng(5).standard_normal((2, 4608)).astype(np.float32)  # row > the 4096-float buffer
    w = rng(6).standard_normal(4608).astype(np.float32)
    q, s = assert_same_on_all_isas(k.rmsnorm_quant, x, w, 1e-5, 0)
    qr, sr = np_quant(k.rmsnorm(x, w, 1e-5), 0)
    assert same_bits(q, qr) and same_bits(s, sr)


@pytest.mark.parametrize("F", [1536, 100, 2500])
def test_swiglu_bit_identical_and_close(F: int) -> None:
    g = rng(F).standard_normal((3, F)).astype(np.float32) * 4
    g[0, :6] = [-100.0, 100.0, 0.0, -88.5, 88.5, 1e-30]
    u = rng(F + 1).standard_normal((3, F)).astype(np.float32)
    y = assert_same_on_all_isas(k.swiglu, g, u)
    want = np_swiglu64(g, u)
    assert np.all(np.abs(y - want) <= 1e-6 * np.abs(want) + 1e-30)
    q, s = assert_same_on_all_isas(k.swiglu_quant, g, u, 32 if F % 32 == 0 else 0)
    qr, sr = np_quant(y, 32 if F % 32 == 0 else 0)
    assert same_bits(q, qr) and same_bits(s, sr)


def test_swiglu_views_of_fused_gate_up() -> None:
    gu = rng(7).standard_normal((5, 2 * 96)).astype(np.float32)
    y = k.swiglu(gu[:, :96], gu[:, 96:])
    assert same_bits(
        y, k.swiglu(np.ascontiguousarray(gu[:, :96]), np.ascontiguousarray(gu[:, 96:]))
    )


def test_swiglu_nan_propagates_and_quant_raises() -> None:
    g = np.ones((1, 64), np.float32)
    u = np.ones((1, 64), np.float32)
    g[0, 5] = np.nan
    assert np.isnan(k.swiglu(g, u)[0, 5])
    with pytest.raises(k.NumericError):
        k.swiglu_quant(g, u)


@pytest.mark.parametrize("D", [64, 128, 6])
def test_rope_matches_numpy_and_tables(D: int) -> None:
    T, H = 5, 3
    x = rng(D).standard_normal((T, H, D)).astype(np.float32)
    pos = np.array([0, 1, 7, 300, 4095], np.int64)
    inv = np_inv_freq(D, 10000.0)
    want = np_rope64(x, pos, inv)

    def run(**kw):
        y = x.copy()
        k.rope(y, pos, **kw)
        return y

    y = assert_same_on_all_isas(run)
    assert np.abs(y - want).max() <= 2e-6 * np.abs(want).max()
    assert same_bits(run(inv_freq=inv), y)  # the theta default is exactly this table
    cos, sin = k.rope_table(np.arange(4096), D)
    assert same_bits(run(cos=cos, sin=sin), y)


def test_rope_llama3_inv_freq_and_strided_view() -> None:
    D = 64
    inv = np_inv_freq(D, 500000.0) / np.float32(8.0)  # any scaled table the runtime computes
    qkv = rng(9).standard_normal((4, (3 + 2) * D)).astype(np.float32)
    q = qkv[:, : 3 * D].reshape(4, 3, D)  # a view with token stride 5 * D
    pos = np.arange(10, 14)
    ref = np.ascontiguousarray(q)
    want = np_rope64(ref, pos, inv)
    k.rope(ref, pos, inv_freq=inv)
    k.rope(q, pos, inv_freq=inv)
    assert same_bits(np.ascontiguousarray(q), ref)
    assert np.abs(ref - want).max() <= 2e-6 * np.abs(want).max()


# ------------------------------------------------------------------ matmuls

Q8_CASES = [
    # enc, N, K, w_group, act_group
    ("int8", 70, 576, 0, 0),
    ("int8", 33, 576, 0, 32),
    ("int8", 40, 1536, 0, 64),
    ("int4_sym", 70, 576, 32, 0),
    ("int4_sym", 33, 576, 32, 32),
    ("int4_sym", 32, 576, 32, 32),  # a last tile of 16 rows (its scales read row by row)
    ("int4_sym", 48, 640, 64, 32),
    ("int4_sym", 40, 1536, 64, 0),
    ("int4_sym", 20, 1024, 128, 64),
    ("int4_sym", 20, 96, 32, 96),
    ("int4_sym", 12, 64, 16, 0),  # group 16: scalar path on every ISA
    ("int4_asym", 70, 576, 32, 0),
    ("int4_asym", 33, 576, 32, 32),
    ("int4_asym", 40, 1536, 128, 0),
    ("int4_sym", 17, 576, 96, 0),  # group not aligned with SIMD chunks
    ("int4_asym", 17, 576, 96, 0),
    ("int8", 9, 96, 0, 32),  # K below one 128-element chunk, a 1-row tail tile
]

# ISAs whose int8-activation matmuls follow ref::q8_row's operation order (bit-identical
# to the scalar reference); the others combine the exact block sums in SIMD lanes.
Q8_EXACT_ISAS = ("avx512", "amx", "neon")


def q8_inputs(K: int, T: int, ga: int, seed: int = 0):
    x = rng(seed).standard_normal((T, K)).astype(np.float32)
    x[:, ::7] *= 5  # uneven magnitudes
    return k.quantize_act(x, ga)


@pytest.mark.parametrize("enc,N,K,gw,ga", Q8_CASES)
@pytest.mark.parametrize("T", [1, 3, 6])
def test_matmul_q8_matches_int32_reference(isa: str, enc, N, K, gw, ga, T) -> None:
    codes, scales, zeros = make_weight(enc, N, K, gw)
    xq, xs = q8_inputs(K, T, ga, seed=T)
    y = k.matmul_q8(xq, xs, ga, codes, scales, zeros, enc, gw)
    assert y.shape == (T, N) and y.dtype == np.float32
    want, bound = np_matmul_q8(xq, xs, ga, enc, codes, scales, zeros, gw)
    check_close(y, want, bound, what=f"{isa} {enc}")


@pytest.mark.parametrize("enc,N,K,gw,ga", Q8_CASES)
def test_matmul_q8_isas_agree_with_scalar(enc, N, K, gw, ga) -> None:
    codes, scales, zeros = make_weight(enc, N, K, gw)
    for T in (1, 3, 5, 8, 12, 17):  # every token tile shape: GEMV, tails, lookup tiles, GEMM
        xq, xs = q8_inputs(K, T, ga)
        res = on_each_isa(k.matmul_q8, xq, xs, ga, codes, scales, zeros, enc, gw)
        _, bound = np_matmul_q8(xq, xs, ga, enc, codes, scales, zeros, gw)
        for name, y in res.items():
            check_close(y, res["scalar"].astype(np.float64), bound, what=name)
            # int8 per-token activations: one int32 sum per row, exact everywhere
            if name in Q8_EXACT_ISAS or (enc == "int8" and ga == 0):
                assert same_bits(y, res["scalar"]), f"{name} T={T} differs from scalar"


def test_matmul_q8_extreme_codes(isa: str) -> None:
    """int8 weights of -128 and activations of +-127 (sign-trick and vpdpbusd edge cases)."""
    N, K = 20, 4096
    r = rng(3)
    codes = r.integers(-128, 128, (N, K)).astype(np.int8)
    codes[0] = -128
    codes[1] = 127
    scales = np.full(N, 0.01, np.float32)
    xq = r.choice(np.array([-127, 127, 0, 1, -1], np.int8), (2, K))
    xq[0] = -127
    xs = np.ones((2, 1), np.float32)
    y = k.matmul_q8(xq, xs, 0, codes, scales, None, "int8", 0)
    want, bound = np_matmul_q8(xq, xs, 0, "int8", codes, scales, None, 0)
    check_close(y, want, bound)
    assert y[0, 0] == np.float32(np.float32(127 * 128 * K) * np.float32(0.01))
    nib = r.integers(0, 256, (N, K // 2)).astype(np.uint8)
    nib[0] = 0xFF
    sc = np.full((N, K // 32), 0.5, np.float16)
    for enc, z in (("int4_sym", None), ("int4_asym", sc)):
        y = k.matmul_q8(xq, xs, 0, nib, sc, z, enc, 32)
        want, bound = np_matmul_q8(xq, xs, 0, enc, nib, sc, z, 32)
        check_close(y, want, bound)


def test_matmul_q8_rejects_minus_128_activations() -> None:
    codes, scales, _ = make_weight("int8", 4, 64, 0)
    xq = np.zeros((1, 64), np.int8)
    xq[0, 3] = -128
    with pytest.raises(ValueError, match="-128"):
        k.matmul_q8(xq, np.ones((1, 1), np.float32), 0, codes, scales, None, "int8", 0)


@pytest.mark.parametrize("enc", ["int8", "int4_sym", "int4_asym"])
def test_matmul_q8_residual_bias_out(enc: str) -> None:
    N, K, T = 50, 576, 3
    codes, scales, zeros = make_weight(enc, N, K, 32)
    gw = 32 if enc != "int8" else 0
    xq, xs = q8_inputs(K, T, 0)
    base = k.matmul_q8(xq, xs, 0, codes, scales, zeros, enc, gw)
    res = rng(1).standard_normal((T, N)).astype(np.float32)
    bias = rng(2).standard_normal(N).astype(np.float32)
    y = k.matmul_q8(xq, xs, 0, codes, scales, zeros, enc, gw, res, bias=bias)
    assert same_bits(y, (base + bias) + res)
    acc = res.copy()
    out = k.matmul_q8(xq, xs, 0, codes, scales, zeros, enc, gw, acc, out=acc)
    assert out is acc and same_bits(acc, base + res)


@pytest.mark.parametrize("enc", ["int8", "int4_sym", "int4_asym"])
@pytest.mark.parametrize("T", [5, 6, 7, 8, 9, 11, 16, 17])  # 5-16: lookup verify tiles
def test_gemm_rows_equal_gemv(enc: str, T: int) -> None:
    N, K = 45, 1536
    gw = 32 if enc != "int8" else 0
    codes, scales, zeros = make_weight(enc, N, K, 32)
    w = k.Weight(codes, scales, zeros, enc, gw)
    for ga in (0, 32):
        xq, xs = q8_inputs(K, T, ga)
        y = k.linear_q8(xq, xs, ga, w)
        for t in range(T):
            assert same_bits(y[t : t + 1], k.linear_q8(xq[t : t + 1], xs[t : t + 1], ga, w))


@pytest.mark.parametrize("enc", ["f32", "f16", "bf16", "int8", "int4_sym", "int4_asym"])
@pytest.mark.parametrize("K", [576, 104, 64])
def test_matmul_f32_matches_dequantized_reference(isa: str, enc: str, K: int) -> None:
    gw = 0
    if enc.startswith("int4"):
        gw = 32 if K % 32 == 0 else 8  # K = 104: group 8 takes the scalar path
    N, T = 37, 5
    codes, scales, zeros = make_weight(enc, N, K, gw)
    x = rng(K).standard_normal((T, K)).astype(np.float32)
    y = k.matmul_f32(x, codes, scales, zeros, enc, gw)
    W = np_dequant(enc, codes, scales, zeros, gw).astype(np.float64)
    want = x.astype(np.float64) @ W.T
    bound = np.abs(x.astype(np.float64)) @ np.abs(W).T
    check_close(y, want, bound, what=f"{isa} {enc}")


def test_lowrank_matches_numpy() -> None:
    N, r, K, T = 64, 8, 576, 3
    U, V = (
        rng(s).standard_normal(shape).astype(np.float32) for s, shape in ((1, (N, r)), (2, (r, K)))
    )
    uc, us = codecs.quantize_int8_channel(U)
    u = k.Weight(uc, us, None, "int8")
    v = k.Weight(V.astype(np.float16), None, None, "f16")
    x = rng(3).standard_normal((T, K)).astype(np.float32)
    res = rng(4).standard_normal((T, N)).astype(np.float32)
    y = k.lowrank(x, u, v, res)
    Ud = codecs.dequantize_int8_channel(uc, us).astype(np.float64)
    Vd = V.astype(np.float16).astype(np.float64)
    want = (x.astype(np.float64) @ Vd.T) @ Ud.T + res
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()
    with pytest.raises(ValueError, match="chain"):
        k.lowrank(x, v, v)


def test_weight_object_and_validation() -> None:
    codes, scales, zeros = make_weight("int4_asym", 8, 64, 32)
    w = k.Weight(codes, scales, zeros, "int4_asym", 32)
    assert w.shape == (8, 64) and w.encoding == "int4_asym" and w.group == 32
    assert w.nbytes == 8 * 32 + 2 * 8 * 2 * 2
    assert k.Weight(codes, scales, zeros, 21, 32).encoding == "int4_asym"  # Encoding value
    with pytest.raises(ValueError, match="zeros"):
        k.Weight(codes, scales, None, "int4_asym", 32)
    with pytest.raises(TypeError, match="float16"):
        k.Weight(codes, scales.astype(np.float32), zeros, "int4_asym", 32)
    with pytest.raises(ValueError, match="shape"):
        k.Weight(codes, scales[:, :1], zeros, "int4_asym", 32)
    with pytest.raises(ValueError, match="group"):
        k.Weight(codes, scales, zeros, "int4_asym", 12)
    with pytest.raises(ValueError, match="unknown weight encoding"):
        k.Weight(codes, scales, zeros, "int3", 32)
    with pytest.raises(ValueError, match="C-contiguous"):
        k.Weight(np.zeros((8, 64), np.float32)[:, ::2], None, None, "f32")
    with pytest.raises(TypeError):
        k.Weight([[1.0]], None, None, "f32")


def test_matmul_argument_errors() -> None:
    codes, scales, _ = make_weight("int8", 8, 64, 0)
    xq, xs = q8_inputs(64, 2, 0)
    with pytest.raises(ValueError, match="columns"):
        k.matmul_q8(np.ascontiguousarray(xq[:, :32]), xs, 0, codes, scales, None, "int8", 0)
    with pytest.raises(ValueError, match="C-contiguous"):
        k.matmul_q8(xq[:, :32], xs, 0, codes, scales, None, "int8", 0)
    with pytest.raises(ValueError, match="xs"):
        k.matmul_q8(xq, xs[:1], 0, codes, scales, None, "int8", 0)
    with pytest.raises(TypeError, match="int8"):
        k.matmul_q8(xq.astype(np.int16), xs, 0, codes, scales, None, "int8", 0)
    with pytest.raises(ValueError, match="act_group"):
        k.matmul_q8(xq, xs, 48, codes, scales, None, "int8", 0)
    c4, s4, _ = make_weight("int4_sym", 8, 192, 64)
    xq3, xs3 = q8_inputs(192, 1, 48)
    with pytest.raises(ValueError, match="divide one another"):
        k.matmul_q8(xq3, xs3, 48, c4, s4, None, "int4_sym", 64)
    with pytest.raises(ValueError, match="out"):
        k.matmul_q8(xq, xs, 0, codes, scales, None, "int8", 0, out=np.empty((2, 9), np.float32))
    with pytest.raises(ValueError, match="integer weights"):
        k.matmul_q8(xq, xs, 0, np.zeros((8, 64), np.float32), None, None, "f32", 0)
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match="overlap"):
        k.linear_f32(x, k.Weight(np.zeros((64, 64), np.float32)), out=x)


# ------------------------------------------------------------------ KV cache and attention

NB, BS, HKV, D = 9, 16, 3, 64


def make_cache(v_scale_dtype=np.float16, float_cache: bool = False):
    if float_cache:
        return (
            np.zeros((NB, BS, HKV, D), np.float32),
            None,
            np.zeros((NB, BS, HKV, D), np.float32),
            None,
        )
    return (
        np.zeros((NB, BS, HKV, D), np.int8),
        np.zeros((NB, BS, HKV), np.float32),
        np.zeros((NB, BS, HKV, D // 2), np.uint8),
        np.zeros((NB, BS, HKV, D // 32), v_scale_dtype),
    )


def np_kv_quant(kx: np.ndarray, vx: np.ndarray, f16: bool = True):
    """Reference dequantized K/V ([L, H, D] float32) of the quantize-on-write rules."""
    L = kx.shape[0]
    q, d = np_quant(kx.reshape(L * HKV, D), 0)
    kd = (q.astype(np.float32) * d).reshape(L, HKV, D)
    vg = vx.reshape(-1, 32)
    peak = np.take_along_axis(vg, np.abs(vg).argmax(-1)[:, None], -1)[:, 0]
    d = peak / np.float32(-8) + np.float32(0)
    if f16:
        d = d.astype(np.float16).astype(np.float32)
    with np.errstate(over="ignore"):
        inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    n = np.clip(np.rint(vg * inv[:, None]), -8, 7).astype(np.int32)  # integer codes: +0
    vd = (n.astype(np.float32) * d[:, None]).reshape(L, HKV, D)
    return kd, vd


def np_attention64(q, kd, vd, start):
    """q [T, Hq, D]; kd/vd [L, Hkv, D] cache contents; causal from position start."""
    T, Hq, _ = q.shape
    rep = Hq // HKV
    out = np.zeros((T, Hq, D))
    for t in range(T):
        L = start + t + 1
        for h in range(Hq):
            kk = kd[:L, h // rep].astype(np.float64)
            vv = vd[:L, h // rep].astype(np.float64)
            s = kk @ q[t, h].astype(np.float64) / np.sqrt(D)
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ vv
    return out


TABLE = np.array([4, 0, 7, 2, 8, 1, 3, 5, 6], np.int32)  # scattered physical blocks


def kv_tokens(T: int, seed: int = 0):
    r = rng(seed)
    return (
        r.standard_normal((T, HKV, D)).astype(np.float32),
        r.standard_normal((T, HKV, D)).astype(np.float32),
    )


def test_kv_write_read_matches_numpy_quantization(isa: str) -> None:
    cache = make_cache()
    kx, vx = kv_tokens(40)
    kx[3, 1] = 0.0  # zero head: scale 0
    k.kv_write(kx[:25], vx[:25], *cache, TABLE, 0)
    k.kv_write(kx[25:], vx[25:], *cache, TABLE, 25)
    kd, vd = k.kv_read(*cache, TABLE, 40)
    kr, vr = np_kv_quant(kx, vx)
    assert same_bits(kd, kr) and same_bits(vd, vr)
    used = set(TABLE[: (40 + BS - 1) // BS].tolist())
    for b in set(range(NB)) - used:
        assert not cache[0][b].any() and not cache[2][b].any()


@pytest.mark.parametrize("n_heads", [3, 9])
@pytest.mark.parametrize("vdtype", [np.float16, np.float32])
def test_attention_decode_matches_numpy(isa: str, n_heads: int, vdtype) -> None:
    cache = make_cache(vdtype)
    L = 37
    kx, vx = kv_tokens(L)
    k.kv_write(kx[: L - 1], vx[: L - 1], *cache, TABLE, 0)
    q = rng(5).standard_normal((n_heads, D)).astype(np.float32)
    out = k.attention_decode(q, kx[L - 1], vx[L - 1], *cache, TABLE, L - 1)
    assert out.shape == (n_heads, D)
    kd, vd = np_kv_quant(kx, vx, f16=vdtype == np.float16)
    want = np_attention64(q[None], kd, vd, L - 1)[0]
    assert np.abs(out - want).max() <= 2e-6 * np.abs(vd).max()


def test_attention_bit_identical_across_isas_and_prefill_equals_decode() -> None:
    Hq, T = 9, 21

    def run_prefill():
        cache = make_cache()
        kx, vx = kv_tokens(T + 5, seed=1)
        k.kv_write(kx[:5], vx[:5], *cache, TABLE, 0)
        q = rng(2).standard_normal((T, Hq, D)).astype(np.float32)
        return k.attention_prefill(q, kx[5:], vx[5:], *cache, TABLE, 5)

    def run_decode():
        cache = make_cache()
        kx, vx = kv_tokens(T + 5, seed=1)
        k.kv_write(kx[:5], vx[:5], *cache, TABLE, 0)
        q = rng(2).standard_normal((T, Hq, D)).astype(np.float32)
        return np.stack(
            [k.attention_decode(q[t], kx[5 + t], vx[5 + t], *cache, TABLE, 5 + t) for t in range(T)]
        )

    pre = assert_same_on_all_isas(run_prefill)
    dec = assert_same_on_all_isas(run_decode)
    assert same_bits(pre, dec)


def test_attention_prefill_matches_numpy_float_cache() -> None:
    cache = make_cache(float_cache=True)
    T, Hq = 30, 6
    kx, vx = kv_tokens(T)
    q = rng(3).standard_normal((T, Hq, D)).astype(np.float32)
    out = k.attention_prefill(q, kx, vx, *cache, TABLE, 0, scale=1 / 8)
    want = np_attention64(q, kx, vx, 0)
    assert np.abs(out - want).max() <= 2e-6
    kd, vd = k.kv_read(*cache, TABLE, T)
    assert same_bits(kd, kx) and same_bits(vd, vx)


def test_attention_strided_qkv_views() -> None:
    T, Hq = 4, 3
    qkv = rng(4).standard_normal((T, (Hq + 2 * HKV) * D)).astype(np.float32)
    q = qkv[:, : Hq * D].reshape(T, Hq, D)
    kk = qkv[:, Hq * D : (Hq + HKV) * D].reshape(T, HKV, D)
    vv = qkv[:, (Hq + HKV) * D :].reshape(T, HKV, D)
    c1, c2 = make_cache(), make_cache()
    a = k.attention_prefill(q, kk, vv, *c1, TABLE, 0)
    b = k.attention_prefill(*(np.ascontiguousarray(t) for t in (q, kk, vv)), *c2, TABLE, 0)
    assert same_bits(a, b)


def test_attention_non_finite_leaves_cache_untouched() -> None:
    cache = make_cache()
    kx, vx = kv_tokens(4)
    vx[2, 1, 5] = np.inf
    with pytest.raises(k.NumericError) as info:
        k.attention_prefill(np.ones((4, 3, D), np.float32), kx, vx, *cache, TABLE, 0)
    assert info.value.kind == "non_finite" and info.value.row == 2
    assert not any(part.any() for part in cache)
    vx[2, 1, 5] = 1e6  # peak / -8 beyond float16
    with pytest.raises(k.NumericError) as info:
        k.kv_write(kx, vx, *cache, TABLE, 0)
    assert info.value.kind == "scale_overflow"
    assert not any(part.any() for part in cache)
    k.kv_write(kx, vx, *make_cache(np.float32), TABLE, 0)  # fine with float32 V scales


def test_attention_argument_errors() -> None:
    cache = make_cache()
    kx, vx = kv_tokens(1)
    q = np.ones((3, D), np.float32)
    with pytest.raises(ValueError, match="block_table"):
        k.attention_decode(q, kx[0], vx[0], *cache, np.array([0], np.int32), BS)
    with pytest.raises(ValueError, match="not a block"):
        k.attention_decode(q, kx[0], vx[0], *cache, np.array([NB], np.int32), 0)
    with pytest.raises(TypeError, match="int32"):
        k.attention_decode(q, kx[0], vx[0], *cache, TABLE.astype(np.int64), 0)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        k.attention_decode(np.ones((4, D), np.float32), kx[0], vx[0], *cache, TABLE, 0)
    with pytest.raises(ValueError, match="v_cache"):
        k.attention_decode(
            q, kx[0], vx[0], cache[0], cache[1], cache[2][..., :8], cache[3], TABLE, 0
        )
    with pytest.raises(ValueError, match="writeable"):
        ro = cache[0].copy()
        ro.flags.writeable = False
        k.attention_decode(q, kx[0], vx[0], ro, *cache[1:], TABLE, 0)
    with pytest.raises(ValueError, match="one token"):
        k.attention_decode(np.ones((2, 3, D), np.float32), *kv_tokens(2), *cache, TABLE, 0)


# ------------------------------------------------------------------ threads, GIL, determinism


def test_results_identical_for_any_thread_count(threads: None) -> None:
    codes, scales, zeros = make_weight("int4_sym", 1000, 1536, 32)
    w = k.Weight(codes, scales, zeros, "int4_sym", 32)
    xq, xs = q8_inputs(1536, 9, 0)
    x = rng(1).standard_normal((9, 1536)).astype(np.float32)
    norm_w = rng(2).standard_normal(1536).astype(np.float32)

    def run():
        cache = make_cache()
        kx, vx = kv_tokens(40)
        q = rng(3).standard_normal((40, 9, D)).astype(np.float32)
        return (
            k.linear_q8(xq, xs, 0, w),
            k.linear_f32(x, w),
            k.rmsnorm_quant(x, norm_w, 1e-5, 32),
            k.attention_prefill(q, kx, vx, *cache, TABLE, 0),
        )

    results = []
    for n in (1, 2, 3):
        k.set_threads(n)
        assert k.get_threads() == n
        results.append(run())
    assert same_bits(results[0], results[1]) and same_bits(results[0], results[2])


def test_long_decode_attention_identical_for_any_thread_count(threads: None) -> None:
    # From ~60 positions on, two threads split a decode step's scores by positions and its
    # V sums by output halves: every output must keep the one-thread (and prefill) bits.
    Hq, start, T = 9, 40, NB * BS - 40

    def filled():
        cache = make_cache()
        kx, vx = kv_tokens(start + T, seed=4)
        k.kv_write(kx[:start], vx[:start], *cache, TABLE, 0)
        return cache, kx[start:], vx[start:], rng(6).standard_normal((T, Hq, D)).astype(np.float32)

    def run_decode():
        cache, kx, vx, q = filled()
        steps = [k.attention_decode(q[t], kx[t], vx[t], *cache, TABLE, start + t) for t in range(T)]
        return np.stack(steps)

    results = []
    for n in (1, 2):
        k.set_threads(n)
        results.append(run_decode())
    cache, kx, vx, q = filled()
    prefill = k.attention_prefill(q, kx, vx, *cache, TABLE, start)
    assert same_bits(results[0], results[1]) and same_bits(results[0], prefill)


def test_set_threads_validation(threads: None) -> None:
    with pytest.raises(ValueError):
        k.set_threads(0)
    k.set_threads(2, spin_us=0)  # no spinning: workers sleep right away, still correct
    codes, scales, _ = make_weight("int8", 512, 576, 0)
    xq, xs = q8_inputs(576, 1, 0)
    a = k.matmul_q8(xq, xs, 0, codes, scales, None, "int8", 0)
    time.sleep(0.01)
    assert same_bits(a, k.matmul_q8(xq, xs, 0, codes, scales, None, "int8", 0))
    k.set_threads(2, spin_us=1000)


def test_concurrent_callers_get_correct_results() -> None:
    codes, scales, zeros = make_weight("int4_sym", 700, 576, 32)
    w = k.Weight(codes, scales, zeros, "int4_sym", 32)
    inputs = [q8_inputs(576, 4, 0, seed=s) for s in range(4)]
    want = [k.linear_q8(xq, xs, 0, w) for xq, xs in inputs]
    errors: list[str] = []

    def worker(i: int) -> None:
        xq, xs = inputs[i]
        for _ in range(50):
            if not same_bits(k.linear_q8(xq, xs, 0, w), want[i]):
                errors.append(f"thread {i}")
                return

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors


def test_gil_released_during_matmul(threads: None) -> None:
    """A pure-Python thread runs while another thread is inside a kernel."""
    previous = k.active_isa()
    k.set_isa("scalar")
    k.set_threads(1)
    try:
        codes, scales, _ = make_weight("int8", 2048, 2048, 0)
        w = k.Weight(codes, scales, None, "int8")
        xq, xs = q8_inputs(2048, 48, 0)
        assert runs_python_during(lambda: k.linear_q8(xq, xs, 0, w))
    finally:
        k.set_isa(previous)


# ------------------------------------------------------------------ NEON (cross-compiled)

NATIVE_SRC = Path(__file__).resolve().parents[2] / "native" / "src"


@pytest.mark.slow
@pytest.mark.skipif(
    not (shutil.which("aarch64-linux-gnu-g++") and shutil.which("qemu-aarch64")),
    reason="needs aarch64-linux-gnu-g++ and qemu-aarch64",
)
def test_neon_kernels_under_qemu(tmp_path: Path) -> None:
    """The NEON table against the reference, cross-compiled and run under qemu-aarch64."""
    exe = tmp_path / "selftest"
    build = subprocess.run(
        [
            "aarch64-linux-gnu-g++", "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror",
            "-ffp-contract=off", "-fno-fast-math", "-static", "-DEDGEPACK_HAVE_NEON",
            str(NATIVE_SRC / "infer" / "selftest_main.cpp"),
            str(NATIVE_SRC / "infer" / "ref_infer.cpp"),
            str(NATIVE_SRC / "arch" / "neon" / "infer_neon.cpp"),
            "-o", str(exe),
        ],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    run = subprocess.run(["qemu-aarch64", str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "neon: ok" in run.stdout


# ------------------------------------------------------------------ whole decoder layer

HID, NH, FFN_DIM = 128, 6, 192  # small Llama-shaped layer: head_dim 64, 3 kv heads


def layer_linear(enc: str, N: int, K: int, seed: int, bias: bool = False):
    gw = 32 if enc.startswith("int4") else 0
    codes, scales, zeros = make_weight(enc, N, K, gw, seed)
    quant = enc.startswith("int")
    return NS(
        native=k.Weight(codes, scales, zeros, enc, gw),
        factors=None,
        bias=rng(seed + 100).standard_normal(N).astype(np.float32) if bias else None,
        is_quantized=quant,
        act_group=gw if gw else (32 if K % 32 == 0 else K),
        rows=N,
    )


def make_layer(enc: str, lowrank_o: bool = False, bias: bool = False):
    qd, kd = NH * D, HKV * D
    lw = NS(
        attn_norm=rng(1).standard_normal(HID).astype(np.float32),
        ffn_norm=rng(2).standard_normal(HID).astype(np.float32),
        q=layer_linear(enc, qd, HID, 3, bias),
        k=layer_linear(enc, kd, HID, 4, bias),
        v=layer_linear(enc, kd, HID, 5, bias),
        o=layer_linear(enc, HID, qd, 6),
        gate=layer_linear(enc, FFN_DIM, HID, 7),
        up=layer_linear(enc, FFN_DIM, HID, 8),
        down=layer_linear(enc, HID, FFN_DIM, 9),
    )
    if lowrank_o:
        u = layer_linear("f16", HID, 16, 10)
        v = layer_linear(enc, 16, qd, 11)
        lw.o = NS(native=None, factors=(u, v), bias=None, is_quantized=v.is_quantized,
                  act_group=v.act_group, rows=HID)  # fmt: skip
    quant = enc.startswith("int")
    lw.qkv_group = 32 if quant else None
    lw.gate_up_group = 32 if quant else None
    return lw


def make_ctx(T: int, start: int, act: bool, float_kv: bool = False):
    cache = make_cache(np.float32, float_cache=float_kv)
    kv = NS(mode="float" if float_kv else "int8-legacy", v_group=32, k=cache[0], k_scales=cache[1],
            v=cache[2], v_scales=cache[3])  # fmt: skip
    pos = np.arange(start, start + T)
    cos, sin = k.rope_table(pos, D, theta=10000.0)
    return NS(num_heads=NH, num_kv_heads=HKV, head_dim=D, eps=1e-5, cos=cos, sin=sin,
              positions=pos, block_table=TABLE, n_ctx=start + T, kv=kv, act_int8=act)  # fmt: skip


def py_layer(lw, x, ctx):
    """The runtime's own layer chain (runtime_shim.kernels.layer) over the single native ops."""
    from edgepack.runtime_shim.kernels import NativeKernels
    from edgepack.runtime_shim.kernels.layer import CompositeLayer

    nk = NativeKernels(k, threads=k.get_threads())
    ctx = NS(**vars(ctx), inject_overflow=False, start=int(ctx.positions[0]), activation="silu",
             window=None, attn_scale=None, attn_softcap=None)  # fmt: skip
    lw = NS(**vars(lw), q_norm=None, k_norm=None, attn_post_norm=None, ffn_post_norm=None)
    try:
        return CompositeLayer.decoder_layer(nk, lw, x, ctx)  # not the fused entry point
    finally:
        nk.close()


@pytest.mark.parametrize(
    "enc,act,lowrank_o,bias,float_kv",
    [
        ("int4_sym", True, False, False, False),
        ("int4_asym", True, False, True, False),
        ("int8", True, True, False, False),
        ("int8", False, False, True, True),
        ("f16", False, True, False, False),
    ],
)
def test_decoder_layer_equals_op_by_op(enc, act, lowrank_o, bias, float_kv) -> None:
    lw = make_layer(enc, lowrank_o, bias)
    x0 = rng(20).standard_normal((5, HID)).astype(np.float32)
    x1 = rng(21).standard_normal((1, HID)).astype(np.float32)
    results = []
    for fused in (True, False):
        ctx_p = make_ctx(5, 0, act, float_kv)
        run = k.decoder_layer if fused else py_layer
        y0, r0 = run(lw, x0, ctx_p)
        ctx_d = make_ctx(1, 5, act, float_kv)
        for name in ("k", "k_scales", "v", "v_scales"):
            setattr(ctx_d.kv, name, getattr(ctx_p.kv, name))  # same cache, next position
        y1, r1 = run(lw, x1, ctx_d)
        assert r0 is None and r1 is None
        results.append((y0, y1, *(a for a in (ctx_p.kv.k, ctx_p.kv.v) if a is not None)))
    assert same_bits(results[0], results[1])


def test_decoder_layer_fallback_reasons() -> None:
    lw = make_layer("int4_sym")
    x = rng(22).standard_normal((2, HID)).astype(np.float32)
    x[1, 3] = 1e30  # RMSNorm keeps it finite: the scale is fine
    out, reason = k.decoder_layer(lw, x, make_ctx(2, 0, True))
    assert reason is None and np.isfinite(out).all()
    lw.attn_norm = lw.attn_norm * np.float32(1e7)  # normalized activations above 127 * 65504
    out, reason = k.decoder_layer(lw, x, make_ctx(2, 0, True))
    assert out is None and reason == "activation scale overflow (attention input)"
    out, reason = k.decoder_layer(lw, x, make_ctx(2, 0, False))  # float path recomputes
    assert reason is None or reason == "non-finite layer output"
    x[0, 0] = np.nan
    out, reason = k.decoder_layer(make_layer("int4_sym"), x, make_ctx(2, 0, True))
    assert out is None and reason.startswith("activation scale overflow")


def test_decoder_layer_argument_errors() -> None:
    lw = make_layer("int8")
    x = np.zeros((1, HID), np.float32)
    with pytest.raises(ValueError, match="q is"):
        bad = make_layer("int8")
        bad.q = layer_linear("int8", NH * D, HID + 32, 3)
        k.decoder_layer(bad, x, make_ctx(1, 0, True))
    with pytest.raises(TypeError, match="native"):
        bad = make_layer("int8")
        bad.k.native = None
        k.decoder_layer(bad, x, make_ctx(1, 0, True))
    with pytest.raises(ValueError, match="consecutive"):
        ctx = make_ctx(2, 0, True)
        ctx.positions = np.array([0, 2])
        k.decoder_layer(lw, np.zeros((2, HID), np.float32), ctx)
    with pytest.raises(ValueError, match="block_table"):
        ctx = make_ctx(1, 0, True)
        ctx.block_table = np.array([NB + 1], np.int32)
        k.decoder_layer(lw, x, ctx)
    with pytest.raises(TypeError, match="float32"):
        k.decoder_layer(lw, x.astype(np.float64), make_ctx(1, 0, True))


# ------------------------------------------------------------------ hostile inputs


def test_random_bad_arguments_raise_typed_errors() -> None:
    """Wrong dtypes, shapes, strides and values: TypeError/ValueError, never a crash."""
    r = rng(99)
    good = {
        "x": np.ones((2, 64), np.float32),
        "xq": np.ones((2, 64), np.int8),
        "xs": np.ones((2, 2), np.float32),
        "w": np.ones(64, np.float32),
    }
    cands = [
        np.ones((2, 64), np.float64),
        np.ones((2, 63), np.float32),
        np.ones((64,), np.float32),
        np.ones((2, 64, 1), np.float32),
        np.ones((2, 128), np.float32)[:, ::2],
        np.ones((0, 64), np.float32),
        np.ones((2, 64), np.int8),
        np.ones((2, 2), np.float16),
        np.array(3.0, np.float32),
        [[1.0] * 64] * 2,
        None,
    ]
    codes, scales, zeros = make_weight("int4_asym", 8, 64, 32)
    w4 = k.Weight(codes, scales, zeros, "int4_asym", 32)
    kv1 = kv_tokens(1)
    calls = [
        lambda a: k.quantize_act(a, 32),
        lambda a: k.rmsnorm(a, good["w"], 1e-5),
        lambda a: k.rmsnorm(good["x"], a, 1e-5),
        lambda a: k.rmsnorm_quant(a, good["w"], 1e-5, 7),
        lambda a: k.swiglu(a, good["x"]),
        lambda a: k.swiglu_quant(good["x"], a, 32),
        lambda a: k.linear_q8(a, good["xs"], 32, w4),
        lambda a: k.linear_q8(good["xq"], a, 32, w4),
        lambda a: k.linear_f32(a, w4),
        lambda a: k.linear_f32(good["x"], w4, a),
        lambda a: k.linear_f32(good["x"], w4, bias=a),
        lambda a: k.rope(a, np.arange(2)),
        lambda a: k.Weight(a, scales, zeros, "int4_asym", 32),
        lambda a: k.attention_decode(a, kv1[0][0], kv1[1][0], *make_cache(), TABLE, 0),
        lambda a: k.attention_decode(
            np.ones((3, D), np.float32), a, kv1[1][0], *make_cache(), TABLE, 0
        ),
    ]
    for call in calls:
        for a in cands:
            try:
                call(a)
            except (TypeError, ValueError, k.NumericError):
                pass
    for _ in range(200):  # random integer parameters
        T, K = int(r.integers(0, 4)), int(r.integers(0, 80))
        g = int(r.integers(-2, 80))
        x = r.standard_normal((T, K)).astype(np.float32)
        try:
            q, _ = k.quantize_act(x, g)
            assert q.shape == (T, K)
        except (TypeError, ValueError):
            pass
        try:
            table = r.integers(-3, NB + 3, int(r.integers(0, 4))).astype(np.int32)
            pos = int(r.integers(-2, 70))
            k.attention_decode(
                np.ones((3, D), np.float32), kv1[0][0], kv1[1][0], *make_cache(), table, pos
            )
        except (TypeError, ValueError):
            pass


def test_stub_declares_every_public_name() -> None:
    """native/_kernels.pyi is the runtime's contract: it must match the module exactly."""
    import ast

    stub = Path(__file__).resolve().parents[2] / "native" / "_kernels.pyi"
    tree = ast.parse(stub.read_text())
    declared = {
        n.name
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.ClassDef) and not n.name.startswith("_")
    }
    declared |= {  # constants (NAME: type) and re-exported classes (import X as X)
        n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)
    } | {a.asname for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names if a.asname}
    public = {n for n in dir(k) if not n.startswith("_")}
    assert declared == public, (sorted(public - declared), sorted(declared - public))

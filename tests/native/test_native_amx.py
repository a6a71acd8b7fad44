"""The AMX tile GEMM (native/src/arch/amx/infer_amx.cpp) is bit-identical to the scalar
reference: same int32 block sums, same float combination order per output element, for
every token count (tile tails included), thread count and weight encoding."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
from test_native_infer import Q8_CASES, make_weight, q8_inputs, rng, same_bits

k = pytest.importorskip("edgepack.native._kernels")

# infer_amx.cpp's swapped tiles (weights as A) for few tokens of int8 weights (9..16),
# below them the avx512 kernels (exact too); from 16 on, always tiles of one layout
TOKENS = [*range(1, 18), 40, 515]
DEFAULT_ISA = k.active_isa()  # at import, before any test switches it


@pytest.fixture(autouse=True)
def restore() -> Iterator[None]:
    if "amx" not in k.available_isas():
        pytest.skip("no AMX-INT8 here (CPU, OS tile state or build)")
    isa, threads = k.active_isa(), k.get_threads()
    try:
        yield
    finally:
        k.set_isa(isa)
        k.set_threads(threads)


def matmul_on(isa: str, *args, **kwargs):
    k.set_isa(isa)
    return k.matmul_q8(*args, **kwargs)


@pytest.mark.parametrize("enc,N,K,gw,ga", Q8_CASES)
@pytest.mark.parametrize("T", TOKENS)
def test_amx_matmul_q8_bit_identical_to_scalar(enc, N, K, gw, ga, T) -> None:
    codes, scales, zeros = make_weight(enc, N, K, gw)
    xq, xs = q8_inputs(K, T, ga, seed=T)
    want = matmul_on("scalar", xq, xs, ga, codes, scales, zeros, enc, gw)
    got = matmul_on("amx", xq, xs, ga, codes, scales, zeros, enc, gw)
    assert same_bits(got, want), f"{enc} T={T}: {np.sum(got != want)} outputs differ"


@pytest.mark.parametrize("T", [9, 16, 37])  # int8: swapped, swapped, big; int4: avx512, big, big
@pytest.mark.parametrize("enc,gw,ga", [("int8", 0, 32), ("int4_sym", 32, 32), ("int4_asym", 64, 0)])
def test_amx_any_thread_count_and_bias_residual(enc, gw, ga, T) -> None:
    N, K = 75, 576
    codes, scales, zeros = make_weight(enc, N, K, gw)
    xq, xs = q8_inputs(K, T, ga)
    bias = rng(5).standard_normal(N).astype(np.float32)
    res = rng(6).standard_normal((T, N)).astype(np.float32)
    args = (xq, xs, ga, codes, scales, zeros, enc, gw)
    k.set_threads(1)
    want = matmul_on("scalar", *args, bias=bias, residual=res)
    for n in (1, 2, 3):
        k.set_threads(n)
        assert same_bits(matmul_on("amx", *args, bias=bias, residual=res), want), f"threads={n}"


@pytest.mark.parametrize(
    "enc,gw,ga", [("int8", 0, 0), ("int8", 0, 32), ("int4_sym", 32, 32), ("int4_asym", 32, 0)]
)
def test_amx_gemm_row_equals_its_gemv(enc, gw, ga) -> None:
    """The contract prompt lookup and prefix caches rely on: a batch row is the GEMV of
    its token.  The GEMV (T = 1) is avx512's: both give the reference's bits."""
    codes, scales, zeros = make_weight(enc, 64, 576, gw)
    xq, xs = q8_inputs(576, 24, ga)
    args = (codes, scales, zeros, enc, gw)
    gemv = [matmul_on("amx", xq[t : t + 1], xs[t : t + 1], ga, *args)[0] for t in range(24)]
    batch = matmul_on("amx", xq, xs, ga, *args)
    for t in range(24):
        assert same_bits(gemv[t], batch[t])


@pytest.mark.parametrize("T", [16, 33])
def test_amx_extreme_int8_codes(T) -> None:
    """-128 weights against +-127 activations: the int32 sums of signed x signed bytes."""
    K = 2048
    ramp = np.arange(33 * K) % 256 - 128  # every code, -128 included, in each row
    codes = ramp.reshape(33, K).astype(np.int8)
    codes[0] = -128
    scales = np.linspace(0.001, 0.02, 33).astype(np.float32)
    xq = np.where(rng(4).random((T, K)) < 0.5, -127, 127).astype(np.int8)
    xq[0] = 127
    for ga in (0, 64):
        xs = np.full((T, K // (ga or K)), 0.25, np.float32)
        want = matmul_on("scalar", xq, xs, ga, codes, scales, None, "int8", 0)
        got = matmul_on("amx", xq, xs, ga, codes, scales, None, "int8", 0)
        assert same_bits(got, want)
        if ga == 0:  # row 0 x token 0: K products -128 * 127 in one exact int32 sum
            assert got[0, 0] == (np.float32(0.25) * np.float32(-128 * 127 * K)) * scales[0]


@pytest.mark.parametrize("enc,K,gw,ga", [("int4_sym", 8192, 32, 32), ("int8", 8192, 0, 0)])
def test_amx_leaves_what_its_tiles_do_not_take_to_avx512(enc, K, gw, ga) -> None:
    """K > 4096 (the stack panel's limit): the avx512 kernels, their bits exactly."""
    codes, scales, zeros = make_weight(enc, 24, K, gw)
    xq, xs = q8_inputs(K, 16, ga)
    args = (xq, xs, ga, codes, scales, zeros, enc, gw)
    assert same_bits(matmul_on("amx", *args), matmul_on("avx512", *args))


def test_amx_is_the_default_where_offered() -> None:
    """Its GEMM rows equal its GEMVs (above), so nothing holds it back."""
    if "EDGEPACK_ISA" in os.environ:
        pytest.skip("EDGEPACK_ISA chose the default")
    assert DEFAULT_ISA == "amx"

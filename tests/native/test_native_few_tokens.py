"""The int8-activation GEMMs of prompt lookup's verify passes (a few tokens: the AVX-512
kernels that turn 16 weight rows into vector lanes, infer_avx512.cpp i4_turned_kernel and
i8_turned_kernel) are bit-identical to the scalar reference at every token count 1..16,
on row counts that leave partial tiles and activation groups that span several blocks, and
each row of a pass equals its token's own decode step."""

from __future__ import annotations

import numpy as np
import pytest
from test_native_infer import Q8_EXACT_ISAS, make_weight, q8_inputs, rng, same_bits

k = pytest.importorskip("edgepack.native._kernels")

TOKENS = list(range(1, 17))
CASES = [  # enc, N, K, weight group, activation group
    ("int8", 45, 576, 0, 32),  # SmolLM2's head shape in K: a last 64-byte piece of one block
    ("int8", 33, 160, 0, 32),  # 2 whole tiles and 1 row, K = 2.5 pieces
    ("int8", 50, 576, 0, 64),  # activation groups of two blocks
    ("int8", 20, 384, 0, 96),
    ("int4_sym", 45, 576, 32, 32),
    ("int4_sym", 33, 1536, 32, 64),
]


def exact(isa: str) -> None:
    if isa not in Q8_EXACT_ISAS:
        pytest.skip(f"{isa}'s int8-activation matmuls are not bit-identical to the reference")


def on_scalar(fn, *args, **kwargs):
    previous = k.active_isa()
    k.set_isa("scalar")
    try:
        return fn(*args, **kwargs)
    finally:
        k.set_isa(previous)


@pytest.mark.parametrize("enc,N,K,gw,ga", CASES)
def test_few_token_passes_bit_identical_to_scalar(isa, enc, N, K, gw, ga) -> None:
    exact(isa)
    codes, scales, zeros = make_weight(enc, N, K, gw)
    w = k.Weight(codes, scales, zeros, enc, gw)
    res = rng(5).standard_normal((16, N)).astype(np.float32)
    bias = rng(6).standard_normal(N).astype(np.float32)
    for T in TOKENS:
        xq, xs = q8_inputs(K, T, ga, seed=T)
        got = k.linear_q8(xq, xs, ga, w, res[:T], bias=bias)
        want = on_scalar(k.linear_q8, xq, xs, ga, w, res[:T], bias=bias)
        assert same_bits(got, want), f"{isa} {enc} T={T} differs from scalar"
        for t in (0, T - 1):  # a pass's row is its token's decode step
            one = k.linear_q8(xq[t : t + 1], xs[t : t + 1], ga, w, res[t : t + 1], bias=bias)
            assert same_bits(got[t : t + 1], one), f"{isa} {enc} T={T} row {t} differs from GEMV"


@pytest.mark.parametrize("T", [4, 5, 8, 12, 16])
def test_few_token_int8_extreme_codes(isa, T) -> None:
    """Weights of -128 / 127 against activations of +-127: the w ^ 0x80 operand and the
    -128 * sum(x) correction of the turned int8 kernel, exact at the int32 extremes."""
    exact(isa)
    N, K, ga = 32, 4096, 32
    r = rng(7)
    codes = r.integers(-128, 128, (N, K)).astype(np.int8)
    codes[0] = -128
    codes[1] = 127
    scales = np.full(N, 0.01, np.float32)
    xq = r.choice(np.array([-127, 127, 0, 1, -1], np.int8), (T, K))
    xq[0] = -127
    xs = np.full((T, K // ga), 0.5, np.float32)
    w = k.Weight(codes, scales, None, "int8", 0)
    got = k.linear_q8(xq, xs, ga, w)
    assert same_bits(got, on_scalar(k.linear_q8, xq, xs, ga, w))
    assert got[0, 0] == np.float32(np.float32(0.5 * 127 * 128 * ga) * (K // ga)) * np.float32(0.01)


@pytest.mark.parametrize("n", [1, 7, 255, 256, 257, 1000, 49152])
def test_argmax_rows_is_numpys(n) -> None:
    """Stack.run's picks (the vectorised blocks and the scalar tail): numpy's first
    maximum, ties across blocks, +-0, infinities, and the first NaN."""
    r = rng(n)
    rows = [
        r.standard_normal(n),
        r.integers(-3, 3, n),  # many ties: the first maximum, possibly in a later block
        r.choice(np.array([0.0, -0.0, -1.0]), n),
        np.full(n, -np.inf),
    ]
    x = np.stack(rows).astype(np.float32)
    if n > 2:
        y = x.copy()
        y[:, n // 2] = np.nan
        y[1, n - 1] = np.nan
        y[2, n // 3] = np.inf
        x = np.concatenate([x, y])
    np.testing.assert_array_equal(k.argmax_rows(x), x.argmax(axis=-1))

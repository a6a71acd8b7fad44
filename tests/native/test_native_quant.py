"""The native kernels must be bit-identical to edgepack.format.codecs on every usable ISA."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from gilcheck import runs_python_during

from edgepack.format import codecs
from edgepack.format.errors import EncodingError

k = pytest.importorskip("edgepack.native._kernels")

ISAS = k.available_isas()


def assert_identical(got: np.ndarray | None, want: np.ndarray | None, what: str) -> None:
    if want is None:
        assert got is None, what
        return
    assert got is not None, what
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if got.tobytes() != want.tobytes():
        bits = {1: np.uint8, 2: np.uint16, 4: np.uint32}[want.dtype.itemsize]
        diff = np.flatnonzero(got.view(bits).ravel() != want.view(bits).ravel())
        i = int(diff[0])
        pytest.fail(
            f"{what}: {diff.size} differing elements, first at flat {i}: "
            f"got {got.ravel()[i]!r} want {want.ravel()[i]!r}"
        )


# ---------------------------------------------------------------- test matrices


def _with_group_structure(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Constant, all-zero (signed), exact-tie and +/- peak groups mixed with noise."""
    w = rng.standard_normal(shape).astype(np.float32).reshape(shape[0], -1)
    cols = w.shape[1]
    for r in range(w.shape[0]):
        kind = r % 5
        if kind == 0:
            w[r, : cols // 2] = 0.0
            w[r, 1 : cols // 2 : 3] = -0.0
        elif kind == 1:
            w[r, :8] = 1.25  # constant group
        elif kind == 2:
            w[r] = np.rint(w[r] * 4) * 0.5  # many exact rounding ties
        elif kind == 3 and cols >= 16:
            w[r, 3], w[r, 5] = -3.0, 3.0  # |peak| tie with both signs
            w[r, 8:16] = [2, -2, 2, -2, 1, 0, -1, 0]
    return w.reshape(shape)


def _f16_boundaries(rng: np.random.Generator, symmetric: bool) -> np.ndarray:
    """Groups of 8 whose scale (sym) or min (asym) lands on float16 rounding boundaries."""
    sub = [k * 2.0**-25 for k in range(1, 17)]  # subnormal midpoints and exact values
    edge = [2.0**-14 - 2.0**-25, 2.0**-14 - 2.0**-26, 2.0**-14]  # subnormal/normal edge
    ties = [(1024 + j + 0.5) * 2.0 ** (e - 10) for j in (0, 1, 511, 1022) for e in (-3, 0, 7)]
    top = [65504.0, float(np.nextafter(np.float32(65520), np.float32(0)))]
    vals = np.array(sub + edge + ties + top, np.float32)
    vals = np.concatenate([vals, np.nextafter(vals, np.float32(0)), np.nextafter(vals, np.inf)])
    vals = vals[np.abs(vals) < 65520]
    vals = np.concatenate([vals, -vals])
    u = rng.uniform(-0.99, 0.99, (vals.size, 8)).astype(np.float32)
    pos = rng.integers(0, 8, vals.size)
    if symmetric:  # the peak is the group's largest |w|, and d = peak / -8
        peak = vals * np.float32(-8)
        w = peak[:, None] * u
        w[np.arange(vals.size), pos] = peak
    else:  # the group's min is the boundary value
        w = vals[:, None] + np.abs(vals[:, None]) * np.abs(u)
        w[np.arange(vals.size), pos] = vals
    return w.astype(np.float32).reshape(-1, 32)[:, :32]


def _matrices(int8: bool) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(1234)
    shapes: list[tuple[int, ...]] = [
        (1, 8),
        (1, 40),
        (3, 24),
        (5, 120),  # C multiple of 8 and of 24/40, not of 16/32
        (7, 96),
        (33, 384),
        (2, 4096),
        (4, 3, 64),  # 3-D: viewed as [4, 192]
    ]
    if int8:
        shapes += [(3, 1), (5, 7), (2, 13), (4, 17), (3, 1000), (6, 65)]
    out = []
    for shape in shapes:
        normal = rng.standard_normal(shape).astype(np.float32)
        out += [
            (f"normal{shape}", normal),
            (f"large{shape}", rng.uniform(-6e4, 6e4, shape).astype(np.float32)),
            (f"f32-subnormal{shape}", (normal * 1e-40).astype(np.float32)),
            (f"f16-subnormal-scale{shape}", (normal * 3e-6).astype(np.float32)),
            (f"structured{shape}", _with_group_structure(rng, shape)),
            (f"zeros{shape}", np.zeros(shape, np.float32)),
        ]
    # A row whose 1/d overflows and contains zeros (the defined 0 * inf case).
    sub = np.zeros((3, 40), np.float32)
    sub[:, ::3] = 1e-39
    sub[1, ::7] = -4e-40
    out.append(("int8-inf-reciprocal", sub))
    return out


INT8_CASES = _matrices(int8=True)
INT4_PARAMS = [
    (name, w, g)
    for name, w in _matrices(int8=False)
    for g in (8, 24, 32, 40, 64, 128)
    if int(np.prod(w.shape[1:])) % g == 0
]


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_int4_f16_rounding_boundaries_identical(isa: str, symmetric: bool) -> None:
    w = _f16_boundaries(np.random.default_rng(8), symmetric)
    want = codecs.quantize_int4_group(w, 8, symmetric)
    got = k.quantize_int4_group(w, 8, symmetric)
    for a, b, what in zip(got, want, ("codes", "scales", "mins"), strict=True):
        assert_identical(a, b, f"{isa} {what}")


# ---------------------------------------------------------------- bit-identity


@pytest.mark.parametrize(("name", "w"), INT8_CASES, ids=[n for n, _ in INT8_CASES])
def test_int8_identical(isa: str, name: str, w: np.ndarray) -> None:
    codes, scales = codecs.quantize_int8_channel(w)
    got_codes, got_scales = k.quantize_int8_channel(w)
    assert_identical(got_codes, codes, f"{isa} {name} codes")
    assert_identical(got_scales, scales, f"{isa} {name} scales")
    want = codecs.dequantize_int8_channel(codes, scales)
    assert_identical(k.dequantize_int8_channel(codes, scales), want, f"{isa} {name} dequant")


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize(
    ("name", "w", "g"), INT4_PARAMS, ids=[f"{n}-g{g}" for n, _, g in INT4_PARAMS]
)
def test_int4_identical(isa: str, name: str, w: np.ndarray, g: int, symmetric: bool) -> None:
    codes, scales, mins = codecs.quantize_int4_group(w, g, symmetric)
    got = k.quantize_int4_group(w, g, symmetric)
    tag = f"{isa} {name} g{g} {'sym' if symmetric else 'asym'}"
    assert_identical(got[0], codes, f"{tag} codes")
    assert_identical(got[1], scales, f"{tag} scales")
    assert_identical(got[2], mins, f"{tag} mins")
    want = codecs.dequantize_int4_group(codes, scales, mins, g)
    assert_identical(k.dequantize_int4_group(codes, scales, mins, g), want, f"{tag} dequant")


def test_arbitrary_scales_dequant_identical(isa: str) -> None:
    # Dequant must match for any stored scale bits, not only ones quantize produces.
    rng = np.random.default_rng(5)
    codes = rng.integers(0, 256, (9, 96), dtype=np.uint8)
    scales = rng.standard_normal((9, 6)).astype(np.float16) * np.float16(300)
    mins = (rng.standard_normal((9, 6)) * 1000).astype(np.float16)
    for m in (None, mins):
        want = codecs.dequantize_int4_group(codes, scales, m, 32)
        assert_identical(k.dequantize_int4_group(codes, scales, m, 32), want, f"{isa} {m is None}")
    c8 = rng.integers(-128, 128, (9, 77), dtype=np.int8)
    s8 = rng.standard_normal(9).astype(np.float32)
    assert_identical(
        k.dequantize_int8_channel(c8, s8), codecs.dequantize_int8_channel(c8, s8), f"{isa} int8"
    )


def test_non_contiguous_and_other_dtypes(isa: str) -> None:
    rng = np.random.default_rng(9)
    base = rng.standard_normal((64, 128))
    for w in (base[:, ::2], base.T[:64], base.astype(np.float16), base.astype(np.float32)[::2]):
        want = codecs.quantize_int4_group(w, 32, True)
        got = k.quantize_int4_group(w, 32, True)
        assert_identical(got[0], want[0], f"{isa} codes {w.dtype}")
        assert_identical(got[1], want[1], f"{isa} scales {w.dtype}")
        assert_identical(k.quantize_int8_channel(w)[0], codecs.quantize_int8_channel(w)[0], isa)


@pytest.mark.parametrize("op", ["int8", "sym", "asym"])
def test_thread_count_does_not_change_output(isa: str, op: str) -> None:
    w = np.random.default_rng(11).standard_normal((257, 512)).astype(np.float32)

    def run(threads: int) -> list[np.ndarray | None]:
        if op == "int8":
            codes, scales = k.quantize_int8_channel(w, threads=threads)
            deq = k.dequantize_int8_channel(codes, scales, threads=threads)
            return [codes, scales, deq]
        codes, scales, mins = k.quantize_int4_group(w, 32, op == "sym", threads=threads)
        deq = k.dequantize_int4_group(codes, scales, mins, 32, threads=threads)
        return [codes, scales, mins, deq]

    one = run(1)
    for threads in (2, 3, 7):
        for a, b in zip(run(threads), one, strict=True):
            assert_identical(a, b, f"{isa} {op} threads={threads}")


def test_dequant_out_parameter() -> None:
    w = np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32)
    codes, scales, mins = k.quantize_int4_group(w, 32, False)
    out = np.empty((8, 64), np.float32)
    res = k.dequantize_int4_group(codes, scales, mins, 32, out=out)
    assert res is out
    assert_identical(out, codecs.dequantize_int4_group(codes, scales, mins, 32), "out")
    c8, s8 = k.quantize_int8_channel(w)
    assert k.dequantize_int8_channel(c8, s8, out=out) is out
    for bad in (np.empty((8, 64), np.float64), np.empty((8, 32), np.float32), out.T.copy().T):
        with pytest.raises(ValueError, match="out must be"):
            k.dequantize_int4_group(codes, scales, mins, 32, out=bad)


# ---------------------------------------------------------------- errors


def _error_message(call: Callable[[], object]) -> str:
    with pytest.raises(EncodingError) as info:
        call()
    return str(info.value)


ERROR_CASES = {
    # (index into a (6, 2, 256) tensor = [6, 512] matrix = 16 groups of 32 per row, value)
    "nan": [((3, 1, 17), np.nan)],  # group 8: inside a later 8-group block
    "inf": [((5, 0, 63), -np.inf)],
    "overflow": [((2, 1, 40), 1e6)],  # group 9
    "overflow-then-nan": [((1, 0, 3), 1e6), ((4, 0, 0), np.nan)],  # earlier row wins
    "nan-beats-overflow": [((1, 0, 3), 1e6), ((1, 1, 60), np.nan)],  # same row: nan wins
    "scale-and-min": [((0, 1, 100), -1e6), ((0, 1, 101), 1e6)],  # scale checked first
    "min-before-scale": [((0, 0, 64), -7e4), ((0, 1, 0), 2e6), ((0, 1, 1), -2e6)],
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_match_reference(isa: str, case: str) -> None:
    w = np.zeros((6, 2, 256), np.float32)
    for index, value in ERROR_CASES[case]:
        w[index] = value
    if case == "min-before-scale":
        w[0, 0, 64:96] = -7e4  # the whole group: d = 0, min overflows
    calls = {
        "int4-sym": (
            lambda: codecs.quantize_int4_group(w, 32, True),
            lambda: k.quantize_int4_group(w, 32, True),
        ),
        "int4-asym": (
            lambda: codecs.quantize_int4_group(w, 32, False),
            lambda: k.quantize_int4_group(w, 32, False),
        ),
    }
    if not np.isfinite(w).all():
        calls["int8"] = (
            lambda: codecs.quantize_int8_channel(w),
            lambda: k.quantize_int8_channel(w),
        )
    messages = {}
    for kind, (ref_call, native_call) in calls.items():
        want = _error_message(ref_call)
        assert _error_message(native_call) == want, f"{isa} {kind}"
        messages[kind] = want
    if case == "min-before-scale":
        assert "min overflows in row 0, group 2" in messages["int4-asym"]
    if case == "scale-and-min":
        assert "scale overflows in row 0, group 11" in messages["int4-asym"]
    if case == "nan-beats-overflow":
        assert "non-finite" in messages["int4-sym"]


def test_nan_raises_with_every_thread_count(isa: str) -> None:
    w = np.random.default_rng(4).standard_normal((300, 256)).astype(np.float32)
    w[299, 255] = np.nan
    w[150, 7] = np.nan
    for threads in (1, 2, 4):
        with pytest.raises(EncodingError, match=r"at index \(150, 7\)"):
            k.quantize_int4_group(w, 64, True, threads=threads)
        with pytest.raises(EncodingError, match=r"at index \(150, 7\)"):
            k.quantize_int8_channel(w, threads=threads)


@pytest.mark.parametrize(
    ("w", "g"),
    [
        (np.ones((2, 7), np.float32), 8),
        (np.ones((2, 40), np.float32), 32),
        (np.ones((2, 64), np.float32), 12),
        (np.ones(16, np.float32), 8),
        (np.ones((0, 16), np.float32), 8),
        (np.ones((2, 16), np.int32), 8),
    ],
)
def test_bad_inputs_match_reference(w: np.ndarray, g: int) -> None:
    want = _error_message(lambda: codecs.quantize_int4_group(w, g, True))
    assert _error_message(lambda: k.quantize_int4_group(w, g, True)) == want


def test_dequant_bad_arguments_raise_encoding_error() -> None:
    codes, scales, mins = codecs.quantize_int4_group(np.ones((2, 64), np.float32), 32, False)
    for args in [
        (codes, scales.astype(np.float32), mins, 32),
        (codes, scales, scales[:1], 32),
        (codes, scales, mins, 48),
        (codes.astype(np.int8), scales, mins, 32),
        (codes[0], scales, mins, 32),
    ]:
        want = _error_message(lambda a=args: codecs.dequantize_int4_group(*a))
        assert _error_message(lambda a=args: k.dequantize_int4_group(*a)) == want
    c8, s8 = codecs.quantize_int8_channel(np.ones((2, 8), np.float32))
    for args8 in [(c8, s8[:1]), (c8.astype(np.uint8), s8), (c8, s8.astype(np.float64))]:
        want = _error_message(lambda a=args8: codecs.dequantize_int8_channel(*a))
        assert _error_message(lambda a=args8: k.dequantize_int8_channel(*a)) == want


def test_empty_dequant_inputs_match_reference() -> None:
    for rows, nbytes in ((0, 16), (3, 0)):
        codes = np.zeros((rows, nbytes), np.uint8)
        scales = np.zeros((rows, nbytes * 2 // 32), np.float16)
        want = codecs.dequantize_int4_group(codes, scales, None, 32)
        assert_identical(k.dequantize_int4_group(codes, scales, None, 32), want, "int4")
        c8 = np.zeros((rows, nbytes), np.int8)
        s8 = np.zeros(rows, np.float32)
        want8 = codecs.dequantize_int8_channel(c8, s8)
        assert_identical(k.dequantize_int8_channel(c8, s8), want8, "int8")


def test_bad_thread_count_is_value_error() -> None:
    with pytest.raises(ValueError, match="threads"):
        k.quantize_int8_channel(np.ones((2, 8), np.float32), threads=0)


# ---------------------------------------------------------------- dispatch and GIL


def test_isa_selection() -> None:
    assert ISAS[0] == "scalar"
    assert k.active_isa() in ISAS
    feats = k.cpu_features()
    assert all(isinstance(v, bool) for v in feats.values())
    if "avx512" in ISAS:
        assert feats["avx512f"] and feats["avx512bw"] and feats["os_zmm"]
    if "avx2" in ISAS:
        assert feats["avx2"] and feats["f16c"] and feats["os_ymm"]
    with pytest.raises(ValueError, match="not usable"):
        k.set_isa("sse9")
    for name in ("avx2", "avx512", "neon"):
        if name not in ISAS:
            with pytest.raises(ValueError):
                k.set_isa(name)


def test_loader_returns_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    from edgepack import native

    monkeypatch.delenv("EDGEPACK_KERNELS", raising=False)
    assert native.load() is k
    monkeypatch.setenv("EDGEPACK_KERNELS", "numpy")
    assert native.load() is None


def test_gil_is_released_during_kernel() -> None:
    """A pure-Python thread runs while another thread is inside the kernel."""
    previous = k.active_isa()
    k.set_isa("scalar")  # slowest path: the call lasts long enough to overlap
    try:
        w = np.random.default_rng(0).standard_normal((4096, 4096)).astype(np.float32)
        assert runs_python_during(lambda: k.quantize_int4_group(w, 32, True, threads=1))
    finally:
        k.set_isa(previous)

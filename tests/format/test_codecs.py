"""Tests for the normative numpy quantizers in edgepack.format.codecs.

Golden values below are derived by hand from the formulas in the module docstring.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgepack.format import codecs
from edgepack.format.errors import EncodingError

F16_NEG_ONE = 0xBC00
F16_NEG_TWO = 0xC000
F16_ONE = 0x3C00
F16_NEG_FIVE = 0xC500


def f16_bits(a: np.ndarray) -> list[int]:
    return [int(x) for x in np.asarray(a, np.float16).view(np.uint16).ravel()]


# ---------------------------------------------------------------- int8 golden values


def test_int8_golden_rows_ties_and_zero_row() -> None:
    w = np.array(
        [
            [0, 1, -2, 127, 0.5, -0.5, 1.5, 2.5],  # d = 1: ties 0.5->0, 1.5->2, 2.5->2
            [254, -254, 127, 1, 3, 5, -1, 0],  # d = 2: 63.5->64, 0.5->0, 1.5->2, 2.5->2
            [0, 0, 0, 0, 0, 0, 0, 0],  # d = 0 -> inv = 0 -> all codes 0
        ],
        np.float32,
    )
    codes, scales = codecs.quantize_int8_channel(w)
    assert codes.dtype == np.int8 and scales.dtype == np.float32
    assert codes.tolist() == [
        [0, 1, -2, 127, 0, 0, 2, 2],
        [127, -127, 64, 0, 2, 2, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
    ]
    assert scales.tolist() == [1.0, 2.0, 0.0]
    deq = codecs.dequantize_int8_channel(codes, scales)
    assert deq.dtype == np.float32
    assert deq[1].tolist() == [254, -254, 128, 0, 4, 4, 0, 0]


def test_int8_subnormal_row_with_overflowing_reciprocal() -> None:
    # amax/127 is a tiny subnormal, so 1/d = inf: nonzero weights saturate, zeros stay 0.
    w = np.array([[1e-39, 0.0, -1e-39, 5e-40, -0.0]], np.float32)
    codes, scales = codecs.quantize_int8_channel(w)
    with np.errstate(over="ignore"):
        assert np.isinf(np.float32(1) / scales[0])
    assert codes.tolist() == [[127, 0, -127, 127, 0]]


def test_int8_shape_view_and_dtypes() -> None:
    w = np.arange(24, dtype=np.float64).reshape(2, 3, 4) - 11
    codes, scales = codecs.quantize_int8_channel(w)
    assert codes.shape == (2, 12) and scales.shape == (2,)
    ref_codes, ref_scales = codecs.quantize_int8_channel(w.astype(np.float32).reshape(2, 12))
    assert np.array_equal(codes, ref_codes) and np.array_equal(scales, ref_scales)
    w16 = w.astype(np.float16)
    assert np.array_equal(
        codecs.quantize_int8_channel(w16)[0],
        codecs.quantize_int8_channel(w16.astype(np.float32))[0],
    )


# ---------------------------------------------------------------- int4 golden values


def test_int4_sym_golden_first_peak_wins_and_ties() -> None:
    w = np.array(
        [
            # |8| == |-8|: the first (+8) is the peak, so d = 8 / -8 = -1 and -8 clips to 7.
            [8, -4, 2, 1, 0, -8, 3, 5],
            # d = 16 / -8 = -2: x = w * -0.5 has ties -0.5, -1.5, -2.5, 0.5, 1.5.
            [16, 1, 3, 5, -1, -3, 0, 2],
        ],
        np.float32,
    ).reshape(1, 16)
    codes, scales, mins = codecs.quantize_int4_group(w, 8, symmetric=True)
    assert mins is None
    assert codes.dtype == np.uint8 and scales.dtype == np.float16
    # nibbles row0: [0, 12, 6, 7, 8, 15, 5, 3]; row1: [0, 8, 6, 6, 8, 10, 8, 7]
    assert codes.tolist() == [[0xC0, 0x76, 0xF8, 0x35, 0x80, 0x66, 0xA8, 0x78]]
    assert f16_bits(scales) == [F16_NEG_ONE, F16_NEG_TWO]
    deq = codecs.dequantize_int4_group(codes, scales, None, 8)
    assert deq.tolist() == [[8, -4, 2, 1, 0, -7, 3, 5, 16, 0, 4, 4, 0, -4, 0, 2]]


def test_int4_sym_negative_peak_and_f16_scale_rounding() -> None:
    w = np.array([[-8, 8, 1, 2, 3, 4, 5, 6], [0.3, 0, 0, 0, 0, 0, 0, 0]], np.float32)
    codes, scales, _ = codecs.quantize_int4_group(w.reshape(1, 16), 8, symmetric=True)
    # Group 0: peak -8 (first), d = +1, +8 clips to 7: nibbles [0,15,9,10,11,12,13,14].
    assert codes[0, :4].tolist() == [0xF0, 0xA9, 0xCB, 0xED]
    # Group 1: d = 0.3 / -8 = -0.0375 -> f16 1.2 * 2^-5 rounds mantissa 204.8 -> 205: 0xA8CD.
    assert f16_bits(scales) == [F16_ONE, 0xA8CD]
    assert codes[0, 4:].tolist() == [0x80, 0x88, 0x88, 0x88]


def test_int4_sym_scale_f16_subnormal_ties() -> None:
    # d = -k * 2^-25 sits exactly between float16 subnormals (k odd): ties go to even.
    peaks = np.float32(2.0**-22) * np.array([1, 3, 5, 2], np.float32)  # d = -k * 2^-25
    w = np.zeros((1, 32), np.float32)
    w[0, ::8] = peaks
    codes, scales, _ = codecs.quantize_int4_group(w, 8, symmetric=True)
    # k=1 -> -0 (0x8000); k=3 -> 2 * 2^-24 (0x8002); k=5 -> 2 * 2^-24; k=2 -> 1 * 2^-24
    assert f16_bits(scales) == [0x8000, 0x8002, 0x8002, 0x8001]
    assert codes[0, :4].tolist() == [0x88] * 4  # d == 0: everything encodes as 0 -> nibble 8
    # d = -2 * 2^-24 for a peak of 3 * 2^-22: x = peak / d = -6 -> nibble 2.
    assert codes[0, 4] & 0x0F == 2


def test_int4_asym_golden() -> None:
    w = np.array([[-5, 10, 0, 1, 2.5, 3.5, -4.5, 7]], np.float32)
    codes, scales, mins = codecs.quantize_int4_group(w, 8, symmetric=False)
    # d = 15 / 15 = 1, m = -5: w - m = [0, 15, 5, 6, 7.5, 8.5, 0.5, 12] -> ties to even.
    assert codes.tolist() == [[0xF0, 0x65, 0x88, 0xC0]]
    assert f16_bits(scales) == [F16_ONE]
    assert mins is not None and f16_bits(mins) == [F16_NEG_FIVE]
    deq = codecs.dequantize_int4_group(codes, scales, mins, 8)
    assert deq.tolist() == [[-5, 10, 0, 1, 3, 3, -5, 7]]


def test_int4_zero_and_constant_groups() -> None:
    w = np.zeros((2, 16), np.float32)
    w[1, 8:] = 3.0
    w[0, 1::2] = -0.0
    codes, scales, _ = codecs.quantize_int4_group(w, 8, symmetric=True)
    assert (codes[0] == 0x88).all() and (scales == 0).sum() == 3
    assert np.array_equal(codecs.dequantize_int4_group(codes, scales, None, 8)[0], w[0])
    codes, scales, mins = codecs.quantize_int4_group(w, 8, symmetric=False)
    assert (codes == 0).all() and (scales == 0).all()
    assert mins is not None
    # Signed zeros are canonicalised: the all-(+-)0 groups store +0 mins (bits 0).
    assert f16_bits(mins) == [0, 0, 0, 0x4200]
    deq = codecs.dequantize_int4_group(codes, scales, mins, 8)
    assert np.array_equal(deq, w)


def test_pack_nibbles_order() -> None:
    q = np.array([[1, 2, 3, 4], [15, 0, 0, 15]], np.uint8)
    packed = codecs.pack_nibbles(q)
    assert packed.tolist() == [[0x21, 0x43], [0x0F, 0xF0]]
    assert np.array_equal(codecs.unpack_nibbles(packed), q)
    rng = np.random.default_rng(1)
    q = rng.integers(0, 16, size=(3, 5, 64), dtype=np.uint8)
    assert np.array_equal(codecs.unpack_nibbles(codecs.pack_nibbles(q)), q)
    with pytest.raises(EncodingError):
        codecs.pack_nibbles(np.array([1, 2, 3], np.uint8))
    with pytest.raises(EncodingError):
        codecs.pack_nibbles(np.array([16, 0], np.uint8))


# ---------------------------------------------------------------- round-trip bounds


def _matrices() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [
        rng.standard_normal((17, 256)).astype(np.float32),
        (rng.standard_normal((5, 512)) * 1e3).astype(np.float32),
        rng.uniform(-1e-3, 5e-3, (9, 128)).astype(np.float32),
        (rng.standard_t(2, (6, 384)) * 0.02).astype(np.float32),  # heavy tails
    ]


@pytest.mark.parametrize("w", _matrices())
def test_int8_round_trip_bound(w: np.ndarray) -> None:
    codes, scales = codecs.quantize_int8_channel(w)
    err = np.abs(codecs.dequantize_int8_channel(codes, scales) - w)
    tiny = np.abs(w) * 2.0**-20
    assert (err <= scales[:, None] * 0.5 * (1 + 2.0**-16) + tiny).all()


@pytest.mark.parametrize("w", _matrices())
@pytest.mark.parametrize("g", [32, 64, 128])
def test_int4_sym_round_trip_bound(w: np.ndarray, g: int) -> None:
    codes, scales, mins = codecs.quantize_int4_group(w, g, symmetric=True)
    deq = codecs.dequantize_int4_group(codes, scales, mins, g)
    d = np.repeat(np.abs(scales.astype(np.float32)), g, axis=1)
    err = np.abs(deq - w)
    tiny = np.abs(w) * 2.0**-20
    # The element opposite to the peak maps to +8 and clips to 7: error up to one step.
    assert (err <= d * 1.001 + tiny).all()
    x = w / np.where(d == 0, 1, d)
    inside = np.abs(x) < 7.5  # not clipped: half a step
    assert (err[inside] <= d[inside] * 0.5 * 1.001 + tiny[inside]).all()


@pytest.mark.parametrize("w", _matrices())
@pytest.mark.parametrize("g", [32, 64, 128])
def test_int4_asym_round_trip_bound(w: np.ndarray, g: int) -> None:
    codes, scales, mins = codecs.quantize_int4_group(w, g, symmetric=False)
    assert mins is not None
    deq = codecs.dequantize_int4_group(codes, scales, mins, g)
    d = np.repeat(scales.astype(np.float32), g, axis=1)
    lo = w.reshape(w.shape[0], -1, g).min(axis=-1)
    min_err = np.repeat(np.abs(lo - mins.astype(np.float32)), g, axis=1)
    err = np.abs(deq - w)
    tiny = (np.abs(w) + 15 * d) * 2.0**-20
    assert (err <= d * (0.5 + 15 * 2.0**-11) + min_err + tiny).all()


def test_chunked_processing_matches_row_by_row() -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((1100, 512)).astype(np.float32)  # several row chunks
    codes, scales, mins = codecs.quantize_int4_group(w, 32, symmetric=False)
    assert mins is not None
    for r in (0, 511, 512, 1099):
        c1, s1, m1 = codecs.quantize_int4_group(w[r : r + 1], 32, symmetric=False)
        assert m1 is not None
        assert np.array_equal(c1[0], codes[r]) and np.array_equal(s1[0], scales[r])
        assert np.array_equal(m1[0], mins[r])
    c8, _ = codecs.quantize_int8_channel(w)
    assert np.array_equal(codecs.quantize_int8_channel(w[700:701])[0][0], c8[700])
    deq = codecs.dequantize_int4_group(codes, scales, mins, 32)
    deq_row = codecs.dequantize_int4_group(codes[1099:], scales[1099:], mins[1099:], 32)
    assert np.array_equal(deq[1099:], deq_row)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_raises_with_position(bad: float) -> None:
    w = np.ones((2, 3, 16), np.float32)
    w[1, 2, 5] = bad
    for call in (
        lambda: codecs.quantize_int8_channel(w),
        lambda: codecs.quantize_int4_group(w, 16, symmetric=True),
        lambda: codecs.quantize_int4_group(w, 16, symmetric=False),
    ):
        with pytest.raises(EncodingError, match=r"non-finite .* at index \(1, 2, 5\)"):
            call()


def test_float64_beyond_float32_range_is_non_finite() -> None:
    with pytest.raises(EncodingError, match="non-finite"):
        codecs.quantize_int8_channel(np.full((2, 8), 1e300))


@pytest.mark.parametrize(
    ("w", "sym", "match"),
    [
        (np.full((1, 8), 1e6, np.float32), True, "scale overflows in row 0, group 0"),
        (np.array([[0] * 8 + [-6e5] + [0] * 7], np.float32), True, "scale overflows .* group 1"),
        (np.array([[-1e6] * 4 + [1e6] * 4], np.float32), False, "scale overflows"),
        (np.full((1, 8), -7e4, np.float32), False, "min overflows in row 0, group 0"),
    ],
)
def test_float16_overflow_raises(w: np.ndarray, sym: bool, match: str) -> None:
    with pytest.raises(EncodingError, match=match):
        codecs.quantize_int4_group(w, 8, symmetric=sym)


def test_largest_finite_f16_scale_is_accepted() -> None:
    # 65504 * 8 = 524032 gives d = -65504 exactly: the largest finite float16.
    w = np.full((1, 8), 524032.0, np.float32)
    _, scales, _ = codecs.quantize_int4_group(w, 8, symmetric=True)
    assert float(scales[0, 0]) == -65504.0


def test_error_precedence_first_row_then_non_finite() -> None:
    w = np.zeros((3, 16), np.float32)
    w[0, 9] = 1e6  # overflow in row 0, group 1
    w[2, 0] = np.nan
    with pytest.raises(EncodingError, match="scale overflows in row 0, group 1"):
        codecs.quantize_int4_group(w, 8, symmetric=True)
    w[0, 12] = np.inf  # now row 0 also holds a non-finite value, which wins
    with pytest.raises(EncodingError, match=r"non-finite value \(inf\) at index \(0, 12\)"):
        codecs.quantize_int4_group(w, 8, symmetric=True)


@pytest.mark.parametrize(
    ("shape", "g", "match"),
    [
        ((2, 7), 8, "not a multiple"),  # odd C
        ((2, 40), 32, "not a multiple"),
        ((2, 64), 12, "group size 12 invalid"),
        ((2, 64), 4, "group size 4 invalid"),
        ((2, 8192), 8192, "group size 8192 invalid"),
    ],
)
def test_bad_group_shapes(shape: tuple[int, int], g: int, match: str) -> None:
    with pytest.raises(EncodingError, match=match):
        codecs.quantize_int4_group(np.ones(shape, np.float32), g, symmetric=True)


@pytest.mark.parametrize(
    "w",
    [
        np.ones(16, np.float32),  # 1-D
        np.ones((0, 16), np.float32),  # empty
        np.ones((2, 16), np.int32),  # not a float dtype
        np.ones((2, 16), np.complex64),
    ],
)
def test_bad_inputs_raise(w: np.ndarray) -> None:
    with pytest.raises(EncodingError):
        codecs.quantize_int8_channel(w)
    with pytest.raises(EncodingError):
        codecs.quantize_int4_group(w, 8, symmetric=True)


def test_dequant_argument_errors() -> None:
    codes, scales, mins = codecs.quantize_int4_group(np.ones((2, 64), np.float32), 32, False)
    with pytest.raises(EncodingError, match="scales must be float16"):
        codecs.dequantize_int4_group(codes, scales.astype(np.float32), mins, 32)
    with pytest.raises(EncodingError, match="mins must be float16"):
        codecs.dequantize_int4_group(codes, scales, scales[:1], 32)
    with pytest.raises(EncodingError, match="not a multiple"):
        codecs.dequantize_int4_group(codes, scales, mins, 48)
    c8, s8 = codecs.quantize_int8_channel(np.ones((2, 8), np.float32))
    with pytest.raises(EncodingError, match="int8 scales"):
        codecs.dequantize_int8_channel(c8, s8[:1])
    with pytest.raises(EncodingError, match="int8 codes"):
        codecs.dequantize_int8_channel(c8.astype(np.uint8), s8)

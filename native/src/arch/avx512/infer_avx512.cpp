// AVX-512 (F/BW/VL/VNNI) + F16C inference kernels.
//
// Generic kernels: infer/generic.h with the 16-lane wrapper V16 (bit-identical to the
// reference).  Integer GEMM: VNNI vpdpbusd, which multiplies an UNSIGNED byte by a SIGNED
// byte.  Weights are the unsigned operand:
//   int4:  nibbles 0..15 as stored; sym subtracts 8 * sum(x) via a per-lane correction
//          that initialises the int32 accumulator (asym adds m * sum(x) in float instead);
//   int8:  w ^ 0x80 = w + 128 in 0..255; the correction -128 * sum(x) does the rest.
// The activations are re-laid out once per call ("prep", O(T K) bytes): for int4, each
// 128-element chunk stores the even elements of its four 32-blocks, then the odd ones, so
// that the low/high nibbles of 64 consecutive code bytes line up with them without any
// shuffle of the weights; the per-lane correction and scale vectors are stored alongside.
// Weights are consumed exactly as stored in the package (no repacking).
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "../../fp16.h"
#include "../../infer/infer.h"
#include "transpose16.h"

namespace edgepack {
namespace infer {
namespace {

struct V16 {
    static constexpr int W = 16;
    using T = __m512;
    static T load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
    static T set1(float v) { return _mm512_set1_ps(v); }
    static T zero() { return _mm512_setzero_ps(); }
    static T add(T a, T b) { return _mm512_add_ps(a, b); }
    static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
    static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
    static T div(T a, T b) { return _mm512_div_ps(a, b); }
    // maxps/minps return the second operand when either is NaN or both are equal: exactly
    // `a > b ? a : b` / `a < b ? a : b`.
    static T max(T a, T b) { return _mm512_max_ps(a, b); }
    static T min(T a, T b) { return _mm512_min_ps(a, b); }
    static T round(T v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static T load_i8(const int8_t* p) {
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    }
    static void store_i8(int8_t* p, T v) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
    }
    static T pow2i(T n) {
        const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
        return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
    }
    static float fold16(const T* acc) {
        const __m512 a = acc[0];
        const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(a),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
        const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
        const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
        return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
    }
    // float(code) of 16 int6 V elements (v_code_bytes_at's layout): low nibbles from nb[0, 8),
    // 2 high bits each from hb[0, 4).  The same integers, so the same floats.
    static T v6_codes16(const uint8_t* nb, const uint8_t* hb) {
        uint32_t h;
        std::memcpy(&h, hb, 4);
        const __m128i pair = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        const __m128i quad = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        const __m512i lo = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(nb)), pair));
        const __m512i hi = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(h)), quad));
        const __m512i lsh = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
        const __m512i hsh = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
        const __m512i c = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi32(lo, lsh), _mm512_set1_epi32(15)),
                                          _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(hi, hsh), _mm512_set1_epi32(3)), 4));
        return _mm512_cvtepi32_ps(c);
    }
    // Hadamard stage h (1, 2, 4, 8) on lanes: lane i gets x[i] + x[i + h] (bit h of i clear)
    // or x[i - h] - x[i] (set): hadamard_row's a + c and a - c.
    static T butterfly16(T x, int h) {
        const T c = _mm512_permutexvar_ps(_mm512_xor_si512(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                           _mm512_set1_epi32(h)), x);
        const __mmask16 high = h == 1 ? 0xAAAA : h == 2 ? 0xCCCC : h == 4 ? 0xF0F0 : 0xFF00;
        return _mm512_mask_sub_ps(_mm512_add_ps(x, c), high, c, x);
    }
    // fold16 of 16 vectors at once: lane p of the result = fold16(&a[p]).  The same adds
    // (lane i + lane i + h for h = 8, 4, 2, 1, in that operand order) with two vectors'
    // halves paired per shuffle, so the same bits; positions end up in lane 4 (p % 4) + p / 4.
    static T fold16x16(const T (&a)[16]) {
        T s1[8], s2[4], s3[2];
        for (int j = 0; j < 8; ++j) {  // lanes i + (i + 8): blocks 0-1 of a[2j], 2-3 of a[2j + 1]
            s1[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
        }
        for (int k = 0; k < 4; ++k) {  // + 4: block b = vector 4k + b
            s2[k] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * k], s1[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(s1[2 * k], s1[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
        }
        for (int m = 0; m < 2; ++m) {  // + 2: block b = [8m + b, 8m + b, 8m + 4 + b, 8m + 4 + b]
            s3[m] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * m], s2[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_ps(s2[2 * m], s2[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
        }
        const T r = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
        const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        return _mm512_permutexvar_ps(order, r);  // lane p = position p
    }
    static uint32_t max_abs_bits(const float* x, int64_t n) {
        const __m512i mask = _mm512_set1_epi32(0x7fffffff);
        __m512i m = _mm512_setzero_si512();
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
            m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_loadu_si512(x + i), mask));
        }
        if (i < n) {
            const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1u);
            m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_maskz_loadu_epi32(k, x + i), mask));
        }
        return _mm512_reduce_max_epu32(m);
    }
    static float h2f(uint16_t h) { return _cvtsh_ss(h); }
    static void nib32(const uint8_t* p, float* o) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        const __m128i m = _mm_set1_epi8(0x0f);
        const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
        const __m512 eight = _mm512_set1_ps(8.0f);
        _mm512_storeu_ps(o, _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi))), eight));
        _mm512_storeu_ps(o + 16, _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi))), eight));
    }
};

}  // namespace
}  // namespace infer
}  // namespace edgepack

#include "../../infer/generic.h"

namespace edgepack {
namespace infer {
namespace {

// ---- shared helpers -----------------------------------------------------------------------

inline float finish(float acc, const GemmOut& o, int64_t t, int64_t n) {
    if (o.bias != nullptr) acc = acc + o.bias[n];
    if (o.residual != nullptr) acc = acc + o.residual[t * o.ldr + n];
    return acc;
}

// Calls f(integral_constant<TR>, integral_constant<NR>, t0, n) over rows [n0, n1) and all
// T tokens: tiles of TR <= 4 tokens x NR rows (NR independent accumulator chains per
// token keep the FMA/VNNI pipes busy even at T = 1).  Rows are visited in blocks of 16
// so a block's weights stay in L1 while the token tiles stream past.  Per output element
// the arithmetic does not depend on the tile shape.
template <int NR4, int NR1, class F>
inline void tile_loop(int64_t T, int64_t n0, int64_t n1, F&& f) {
    using std::integral_constant;
    auto rows = [&](auto tr, auto nr, int64_t t, int64_t nb, int64_t ne) {
        int64_t n = nb;
        for (; n + decltype(nr)::value <= ne; n += decltype(nr)::value) f(tr, nr, t, n);
        for (; n < ne; ++n) f(tr, integral_constant<int, 1>(), t, n);
    };
    for (int64_t nb = n0; nb < n1; nb += 16) {
        const int64_t ne = nb + 16 < n1 ? nb + 16 : n1;
        int64_t t = 0;
        for (; t + 4 <= T; t += 4) rows(integral_constant<int, 4>(), integral_constant<int, NR4>(), t, nb, ne);
        switch (T - t) {
            case 3: rows(integral_constant<int, 3>(), integral_constant<int, NR1>(), t, nb, ne); break;
            case 2: rows(integral_constant<int, 2>(), integral_constant<int, NR1>(), t, nb, ne); break;
            case 1: rows(integral_constant<int, 1>(), integral_constant<int, NR1>(), t, nb, ne); break;
            default: break;
        }
    }
}

// Tiles of the int8-activation GEMMs: f(integral_constant<TR>, integral_constant<NR>, t0,
// n, rows) for TR tokens x NR rows of which the first `rows` exist (a row block's last
// tile may be short; the kernels read its last row again in place of the missing ones and
// store only the real rows).  Rows are visited in blocks of 16 so a block's weights stay
// in L1 while the token tiles stream past.  Below 5 and above 16 tokens: tiles of 4 tokens
// x NR4 rows, a 1-3 token tail with NR1 rows.  At 5 to 16 tokens (prompt lookup's verify
// passes): one or two tiles of 4 to 8 tokens x NRS rows, each weight vector loaded once
// per tile, never a 1-3 token tail that loads the weights again (the 1-token tail of a
// 5- or 9-token pass cost almost as much as a whole decode step's GEMMs).  Per output
// element the arithmetic does not depend on the tile shape.
template <int NRS, int NR4, int NR1, class F>
inline void q8_tile_loop(int64_t T, int64_t n0, int64_t n1, F&& f) {
    using std::integral_constant;
    auto rows = [&](auto tr, auto nr, int64_t t0, int64_t nb, int64_t ne) {
        constexpr int64_t NR = decltype(nr)::value;
        for (int64_t n = nb; n < ne; n += NR) f(tr, nr, t0, n, ne - n < NR ? ne - n : NR);
    };
    auto tile = [&](int64_t t0, int64_t nt, int64_t nb, int64_t ne) {
        switch (nt) {
            case 1: rows(integral_constant<int, 1>(), integral_constant<int, NR1>(), t0, nb, ne); break;
            case 2: rows(integral_constant<int, 2>(), integral_constant<int, NR1>(), t0, nb, ne); break;
            case 3: rows(integral_constant<int, 3>(), integral_constant<int, NR1>(), t0, nb, ne); break;
            case 4:
                if (T < 5 || T > 16) {
                    rows(integral_constant<int, 4>(), integral_constant<int, NR4>(), t0, nb, ne);
                } else {
                    rows(integral_constant<int, 4>(), integral_constant<int, NRS>(), t0, nb, ne);
                }
                break;
            case 5: rows(integral_constant<int, 5>(), integral_constant<int, NRS>(), t0, nb, ne); break;
            case 6: rows(integral_constant<int, 6>(), integral_constant<int, NRS>(), t0, nb, ne); break;
            case 7: rows(integral_constant<int, 7>(), integral_constant<int, NRS>(), t0, nb, ne); break;
            default: rows(integral_constant<int, 8>(), integral_constant<int, NRS>(), t0, nb, ne); break;
        }
    };
    for (int64_t nb = n0; nb < n1; nb += 16) {
        const int64_t ne = nb + 16 < n1 ? nb + 16 : n1;
        if (T >= 5 && T <= 16) {
            const int64_t first = T <= 8 ? T : (T + 1) / 2;
            tile(0, first, nb, ne);
            if (first < T) tile(first, T - first, nb, ne);
            continue;
        }
        int64_t t = 0;
        for (; t + 4 <= T; t += 4) tile(t, 4, nb, ne);
        if (t < T) tile(t, T - t, nb, ne);
    }
}

inline __m512i ld512(const void* p) { return _mm512_loadu_si512(p); }

// The reference's block sums, exact, from the VNNI lane sums of 4 (row, token) pairs:
// lane 4j+i of the result = the sum of the 4 int32 lanes of 128-bit lane j of argument i
// (a 4x4 transposition per 128-bit lane with the adds folded in; integer sums are exact in
// any order).
inline __m512i hsum4_epi32(__m512i a, __m512i b, __m512i c, __m512i d) {
    const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}

// The same placement for per-block values replicated in each 128-bit lane (chunk_scales'
// layout): lane 4j+i = lane 4j of argument i.
inline __m512 rows4_ps(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512d ab = _mm512_castps_pd(_mm512_unpacklo_ps(a, b)), cd = _mm512_castps_pd(_mm512_unpacklo_ps(c, d));
    return _mm512_castpd_ps(_mm512_unpacklo_pd(ab, cd));
}

// 128-bit lane j of v (j < 4).
inline __m128 lane4(__m512 v, int j) {
    switch (j) {
        case 0: return _mm512_castps512_ps128(v);
        case 1: return _mm512_extractf32x4_ps(v, 1);
        case 2: return _mm512_extractf32x4_ps(v, 2);
        default: return _mm512_extractf32x4_ps(v, 3);
    }
}
inline __m128i lane4(__m512i v, int j) {
    switch (j) {
        case 0: return _mm512_castsi512_si128(v);
        case 1: return _mm512_extracti32x4_epi32(v, 1);
        case 2: return _mm512_extracti32x4_epi32(v, 2);
        default: return _mm512_extracti32x4_epi32(v, 3);
    }
}

// The reference's accumulation over the first nb (1..4) blocks of a chunk, one block per
// 128-bit lane, 4 outputs per lane: acc = acc + p_j, then (asym) acc = acc + q_j, block by
// block in order.  Separate adds: the same roundings as ref::q8_row.
template <bool TWO>
inline __m128 add_blocks(__m128 acc, __m512 p, __m512 q, int64_t nb) {
    for (int j = 0; j < 4; ++j) {
        if (j >= nb) break;
        acc = _mm_add_ps(acc, lane4(p, j));
        if (TWO) acc = _mm_add_ps(acc, lane4(q, j));
    }
    return acc;
}

// Blocks longer than 32 elements (B = min(activation group, weight group) = 32 * bpb): the
// 32-block sums of a chunk's lanes (as hsum4_epi32 gives them) are added into `isum` until
// a block ends, then acc = acc + sd_j * float(isum) (and the asym term, from `xsum` and
// sm).  32-block i of the row is lane j of chunk i / 4; sd and sm are the same for every
// 32-block of a block (the groups divide one another).
template <bool ASYM>
inline void add_long_blocks(__m128& acc, __m128i& isum, __m128i& xsum, __m512i s, __m512i xs, __m512 sd,
                            __m512 sm, int64_t i0, int64_t nb, int64_t bpb) {
    for (int j = 0; j < 4; ++j) {
        if (j >= nb) break;
        isum = _mm_add_epi32(isum, lane4(s, j));
        if (ASYM) xsum = _mm_add_epi32(xsum, lane4(xs, j));
        if ((i0 + j + 1) % bpb != 0) continue;
        acc = _mm_add_ps(acc, _mm_mul_ps(lane4(sd, j), _mm_cvtepi32_ps(isum)));
        if (ASYM) acc = _mm_add_ps(acc, _mm_mul_ps(lane4(sm, j), _mm_cvtepi32_ps(xsum)));
        isum = _mm_setzero_si128();
        xsum = _mm_setzero_si128();
    }
}

// How a kernel meets the reference's blocks of B = min(activation group, weight group)
// elements: one per 32-block (B = 32), pairs of 32-blocks summed in int32 first (B = 64),
// whole chunks summed in int32 and carried to the block's end (B a multiple of 128), or
// one 32-block at a time (any other B: add_long_blocks).
enum class Blocks { b32, b64, b128k, other };

inline Blocks blocks_of(int64_t ga, int64_t gw) {
    const int64_t B = ga < gw ? ga : gw;
    return B == 32 ? Blocks::b32 : B == 64 ? Blocks::b64 : B % 128 == 0 ? Blocks::b128k : Blocks::other;
}

// The reference's steps for one chunk of 4 rows: s = the exact 32-block sums (hsum4_epi32),
// xs = asym's per-32-block sum(x), sd / sm = s * d and s * m per 32-block lane; the chunk
// holds nb 32-blocks starting at 32-block 4c.
template <Blocks BL, bool ASYM>
inline void add_chunk(__m128& acc, __m128i& isum, __m128i& xsum, __m512i s, __m512i xs, __m512 sd, __m512 sm,
                      int64_t c, int64_t nb, int64_t bpb) {
    if (BL == Blocks::other) return add_long_blocks<ASYM>(acc, isum, xsum, s, xs, sd, sm, 4 * c, nb, bpb);
    if (BL != Blocks::b32) {  // lanes 2k and 2k+1 summed into both
        s = _mm512_add_epi32(s, _mm512_shuffle_i32x4(s, s, _MM_SHUFFLE(2, 3, 0, 1)));
        if (ASYM) xs = _mm512_add_epi32(xs, _mm512_shuffle_i32x4(xs, xs, _MM_SHUFFLE(2, 3, 0, 1)));
    }
    if (BL == Blocks::b128k) {  // all four lanes: the chunk's sum, carried to the block's end
        s = _mm512_add_epi32(s, _mm512_shuffle_i32x4(s, s, _MM_SHUFFLE(1, 0, 3, 2)));
        isum = _mm_add_epi32(isum, _mm512_castsi512_si128(s));
        if (ASYM) {
            xs = _mm512_add_epi32(xs, _mm512_shuffle_i32x4(xs, xs, _MM_SHUFFLE(1, 0, 3, 2)));
            xsum = _mm_add_epi32(xsum, _mm512_castsi512_si128(xs));
        }
        if (4 * (c + 1) % bpb != 0) return;
        acc = _mm_add_ps(acc, _mm_mul_ps(_mm512_castps512_ps128(sd), _mm_cvtepi32_ps(isum)));
        if (ASYM) acc = _mm_add_ps(acc, _mm_mul_ps(_mm512_castps512_ps128(sm), _mm_cvtepi32_ps(xsum)));
        isum = _mm_setzero_si128();
        xsum = _mm_setzero_si128();
        return;
    }
    const __m512 p = _mm512_mul_ps(sd, _mm512_cvtepi32_ps(s));
    const __m512 q = ASYM ? _mm512_mul_ps(sm, _mm512_cvtepi32_ps(xs)) : p;
    if (BL == Blocks::b32) {
        acc = add_blocks<ASYM>(acc, p, q, nb);
        return;
    }
    // b64: the blocks are lanes 0 and 2 (sd is the same in both lanes of a block)
    acc = _mm_add_ps(acc, lane4(p, 0));
    if (ASYM) acc = _mm_add_ps(acc, lane4(q, 0));
    if (nb > 2) {
        acc = _mm_add_ps(acc, lane4(p, 2));
        if (ASYM) acc = _mm_add_ps(acc, lane4(q, 2));
    }
}

// A finished tile: lane i of acc[t][g] is row 4g + i of token t (times row_scale[n] for
// int8 weights, as the reference's last step).
template <int TR, int NG>
inline void store_rows(const __m128 (&acc)[TR][NG], const float* row_scale, int64_t t0, int64_t n0, int64_t rows,
                       const GemmOut& out) {
    for (int t = 0; t < TR; ++t) {
        for (int g = 0; g < NG; ++g) {
            alignas(16) float v[4];
            _mm_store_ps(v, acc[t][g]);
            for (int i = 0; i < 4 && 4 * g + i < rows; ++i) {
                const int64_t n = n0 + 4 * g + i;
                const float y = row_scale != nullptr ? v[i] * row_scale[n] : v[i];
                out.y[(t0 + t) * out.ldy + n] = finish(y, out, t0 + t, n);
            }
        }
    }
}

// Software prefetch distance of the GEMV/GEMM weight streams, in row tiles. A decode step
// reads each weight once, in rows of a few hundred bytes: the hardware prefetcher alone
// leaves the loads waiting on memory (~10 GB/s of the ~25 GB/s two cores can stream).
// Prefetching past the end of a weight is harmless (a hint, never a fault).
constexpr int64_t PF_TILES = 4;

// Lanes 4j..4j+3 = s[j], j < 4.
inline __m512 spread4(__m128 s) {
    return _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                 _mm512_zextps128_ps512(s));
}

// Scales of the four 32-blocks of 128-element chunk c of one weight row (zero past K).
inline __m512 chunk_scales(const uint16_t* row, int64_t c, int64_t gw, int64_t K) {
    const int64_t nv = (K - 128 * c) / 32;  // valid 32-blocks in this chunk (>= 1)
    if (gw == 32) {
        const __mmask8 m = nv >= 4 ? __mmask8{0x0f} : static_cast<__mmask8>((1u << nv) - 1u);
        return spread4(_mm_cvtph_ps(_mm_maskz_loadu_epi16(m, row + 4 * c)));
    }
    if (gw % 128 == 0 && nv >= 4) return _mm512_set1_ps(_cvtsh_ss(row[128 * c / gw]));
    const float s0 = _cvtsh_ss(row[128 * c / gw]);
    const float s1 = nv > 1 ? _cvtsh_ss(row[(128 * c + 32) / gw]) : 0.0f;
    const float s2 = nv > 2 ? _cvtsh_ss(row[(128 * c + 64) / gw]) : 0.0f;
    const float s3 = nv > 3 ? _cvtsh_ss(row[(128 * c + 96) / gw]) : 0.0f;
    return spread4(_mm_setr_ps(s0, s1, s2, s3));
}

// ---- int8-activation GEMM: int4 weights -------------------------------------------------
// Prep per token, per 128-element chunk (CB bytes):
//   [0, 64)    x even elements: 16 per 32-block, 4 blocks
//   [64, 128)  x odd elements
//   [128, 192) sym: int32 -8 * sum(x) of 32-block j in the first lane of 128-bit lane j, zero
//              in the others (the kernels' int32 sums add all four); asym: its sum(x) in each
//              lane of 128-bit lane j
//   [192, 256) grouped activations only: float scale xs of 32-block j in 128-bit lane j
// A lane is 4 bytes of the even and 4 of the odd part, the same elements vpdpbusd sums, so
// 128-bit lane j of a chunk's vectors is 32-block j.

inline bool i4_ok(const WeightView& w, int64_t ga) {
    return w.K % 32 == 0 && w.group % 32 == 0 && ga % 32 == 0;
}

inline int64_t i4_chunk_bytes(int64_t K, int64_t ga) { return ga < K ? 256 : 192; }

void i4_prep(const WeightView& w, const ActQ8& x, int64_t t0, int64_t t1) {
    const int64_t K = x.K, ga = x.group, NC = (K + 127) / 128, CB = i4_chunk_bytes(K, ga);
    const bool asym = w.enc == WEnc::i4asym, grouped = ga < K;
    const __m256i deint = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                           0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m128i ones = _mm_set1_epi8(1);
    for (int64_t t = t0; t < t1; ++t) {
        const int8_t* q = x.q + t * K;
        const float* s = x.s + t * (K / ga);
        uint8_t* base = x.prep + t * x.prep_stride;
        for (int64_t c = 0; c < NC; ++c) {
            uint8_t* pc = base + c * CB;
            for (int j = 0; j < 4; ++j) {
                const int64_t e = 128 * c + 32 * j;
                __m128i ev = _mm_setzero_si128(), od = _mm_setzero_si128();
                if (e < K) {
                    __m256i v = _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + e)), deint);
                    v = _mm256_permute4x64_epi64(v, _MM_SHUFFLE(3, 1, 2, 0));
                    ev = _mm256_castsi256_si128(v);
                    od = _mm256_extracti128_si256(v, 1);
                }
                _mm_storeu_si128(reinterpret_cast<__m128i*>(pc + 16 * j), ev);
                _mm_storeu_si128(reinterpret_cast<__m128i*>(pc + 64 + 16 * j), od);
                __m128i sum = _mm_dpbusd_epi32(_mm_setzero_si128(), ones, ev);
                sum = _mm_dpbusd_epi32(sum, ones, od);
                if (asym) {
                    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, _MM_SHUFFLE(1, 0, 3, 2)));
                    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, _MM_SHUFFLE(2, 3, 0, 1)));
                } else {  // the block's whole -8 * sum(x) in its first lane (i4_turned_kernel broadcasts it)
                    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, _MM_SHUFFLE(1, 0, 3, 2)));
                    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, _MM_SHUFFLE(2, 3, 0, 1)));
                    sum = _mm_maskz_mov_epi32(1, _mm_sub_epi32(_mm_setzero_si128(), _mm_slli_epi32(sum, 3)));
                }
                _mm_storeu_si128(reinterpret_cast<__m128i*>(pc + 128 + 16 * j), sum);
                if (grouped) _mm_storeu_ps(reinterpret_cast<float*>(pc + 192 + 16 * j), _mm_set1_ps(e < K ? s[e / ga] : 0.0f));
            }
        }
    }
}

// The scales (or zero points) of the 32-blocks of chunk c of 4 rows p[0..3], weight group
// gw > 32, in block-major, row-minor lanes (lane 4j+i: row i, block j; zero past K).
inline __m512 rows_scales(const uint16_t* const* p, int64_t c, int64_t gw, int64_t K) {
    if (gw % 128 == 0) {  // one group per chunk (and K % 128 == 0)
        const int64_t g = 128 * c / gw;
        const __m128i h = _mm_setr_epi16(static_cast<short>(p[0][g]), static_cast<short>(p[1][g]),
                                         static_cast<short>(p[2][g]), static_cast<short>(p[3][g]), 0, 0, 0, 0);
        return _mm512_broadcast_f32x4(_mm_cvtph_ps(h));
    }
    if (gw == 64) {  // groups 2c and 2c + 1 (none past K)
        const bool second = K - 128 * c > 64;
        auto pair = [&](int r) {
            uint32_t v = p[r][2 * c];
            if (second) v |= uint32_t{p[r][2 * c + 1]} << 16;
            return static_cast<int>(v);
        };
        const __m256 v = _mm256_cvtph_ps(_mm_setr_epi32(pair(0), pair(1), pair(2), pair(3)));
        return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 1, 3, 5, 7, 1, 3, 5, 7),
                                     _mm512_castps256_ps512(v));
    }
    return rows4_ps(chunk_scales(p[0], c, gw, K), chunk_scales(p[1], c, gw, K), chunk_scales(p[2], c, gw, K),
                    chunk_scales(p[3], c, gw, K));
}

// The scales of 4 rows in block-major, row-minor lanes (lane 4j+i: row i, block j) from the
// rows' 16-block registers: idx picks within (s[0], s[1]) for rows 0 and 1, within
// (s[2], s[3]) for rows 2 and 3.
inline __m512 pick_rows4(const __m512* s, __m512i idx) {
    return _mm512_mask_blend_ps(0xCCCC, _mm512_permutex2var_ps(s[0], idx, s[1]), _mm512_permutex2var_ps(s[2], idx, s[3]));
}

// One tile: TR tokens x NR rows (NR a multiple of 4; rows past `rows` repeat the last real
// one).  Per chunk and (row, token), vpdpbusd leaves a 32-block's sum spread over the 4
// int32 lanes of its 128-bit lane; hsum4_epi32 makes them exact block sums of 4 rows, one
// row per lane, and the reference's float steps follow block by block:
// acc = acc + (s * d) * float(isum), asym then acc = acc + (s * m) * float(xsum).
template <int TR, int NR, bool ASYM, bool GROUPED, Blocks BL>
inline void i4_kernel(const WeightView& w, const ActQ8& x, int64_t t0, int64_t n0, int64_t rows,
                      const GemmOut& out) {
    constexpr int NG = NR / 4;
    const int64_t K = w.K, NC = (K + 127) / 128, full = K / 128, G = K / w.group;
    const int64_t CB = i4_chunk_bytes(K, x.group), bpb = (x.group < w.group ? x.group : w.group) / 32;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const uint8_t* codes[NR];
    const uint16_t* srow[NR];
    const uint16_t* zrow[NR];
    for (int r = 0; r < NR; ++r) {
        const int64_t n = n0 + (r < rows ? r : rows - 1);
        codes[r] = static_cast<const uint8_t*>(w.codes) + n * (K / 2);
        srow[r] = w.scales_f16 + n * G;
        zrow[r] = ASYM ? w.zeros_f16 + n * G : nullptr;
        _mm_prefetch(reinterpret_cast<const char*>(srow[r] + PF_TILES * NR * G), _MM_HINT_T0);
        if (ASYM) _mm_prefetch(reinterpret_cast<const char*>(zrow[r] + PF_TILES * NR * G), _MM_HINT_T0);
    }
    __m128 acc[TR][NG];
    __m128i isum[TR][NG], xsum[TR][NG];  // blocks longer than 32: the open block's sums
    __m512 xs1[TR];                       // ungrouped activations: the token's one scale
    const uint8_t* pt[TR];
    for (int t = 0; t < TR; ++t) {
        pt[t] = x.prep + (t0 + t) * x.prep_stride;
        xs1[t] = _mm512_set1_ps(x.s[t0 + t]);
        for (int g = 0; g < NG; ++g) {
            acc[t][g] = _mm_setzero_ps();
            isum[t][g] = xsum[t][g] = _mm_setzero_si128();
        }
    }
    // Group 32: the scales of 4 chunks (16 blocks) converted at once per row, each chunk's
    // 4 x 4 then picked into lanes (the same values chunk_scales gives, zero past K).
    const bool g32 = w.group == 32;
    const __m512i pick0 = _mm512_set_epi32(19, 3, 19, 3, 18, 2, 18, 2, 17, 1, 17, 1, 16, 0, 16, 0);
    __m512 s16[NR], z16[NR];
    for (int64_t c = 0; c < NC; ++c) {
        if (g32 && c % 4 == 0) {
            const int64_t left = G - 4 * c;
            const __mmask16 sm = left >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << left) - 1u);
            for (int r = 0; r < NR; ++r) {
                s16[r] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(sm, srow[r] + 4 * c));
                if (ASYM) z16[r] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(sm, zrow[r] + 4 * c));
            }
        }
        __m512 dv[NG], mv[NG];  // lane 4j+i: scale (zero point) of 32-block j of row 4g+i
        if (g32) {
            const __m512i pick = _mm512_add_epi32(pick0, _mm512_set1_epi32(static_cast<int>(4 * (c % 4))));
            for (int g = 0; g < NG; ++g) {
                dv[g] = pick_rows4(s16 + 4 * g, pick);
                if (ASYM) mv[g] = pick_rows4(z16 + 4 * g, pick);
            }
        } else {
            for (int g = 0; g < NG; ++g) {
                dv[g] = rows_scales(srow + 4 * g, c, w.group, K);
                if (ASYM) mv[g] = rows_scales(zrow + 4 * g, c, w.group, K);
            }
        }
        const __mmask64 km = c < full ? ~__mmask64{0} : (uint64_t{1} << ((K - 128 * c) / 2)) - 1;
        __m512i lo[NR], hi[NR];
        for (int r = 0; r < NR; ++r) {
            // rows are contiguous: the same line PF_TILES tiles further down the matrix
            _mm_prefetch(reinterpret_cast<const char*>(codes[r] + 64 * c + PF_TILES * NR * (K / 2)), _MM_HINT_T0);
            const __m512i v = c < full ? ld512(codes[r] + 64 * c) : _mm512_maskz_loadu_epi8(km, codes[r] + 64 * c);
            lo[r] = _mm512_and_si512(v, m4);
            hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        }
        const int64_t nb = c < full ? 4 : (K - 128 * c) / 32;
        for (int t = 0; t < TR; ++t) {
            const uint8_t* pc = pt[t] + c * CB;
            const __m512i xa = ld512(pc), xb = ld512(pc + 64);
            const __m512i corr = ASYM ? _mm512_setzero_si512() : ld512(pc + 128);
            const __m512i xsi = ASYM ? ld512(pc + 128) : _mm512_setzero_si512();
            const __m512 s = GROUPED ? _mm512_loadu_ps(reinterpret_cast<const float*>(pc + 192)) : xs1[t];
            for (int g = 0; g < NG; ++g) {
                __m512i ci[4];
                for (int i = 0; i < 4; ++i) {
                    ci[i] = _mm512_dpbusd_epi32(corr, lo[4 * g + i], xa);
                    ci[i] = _mm512_dpbusd_epi32(ci[i], hi[4 * g + i], xb);
                }
                const __m512i bs = hsum4_epi32(ci[0], ci[1], ci[2], ci[3]);
                const __m512 sd = _mm512_mul_ps(s, dv[g]);
                const __m512 sm = ASYM ? _mm512_mul_ps(s, mv[g]) : sd;
                add_chunk<BL, ASYM>(acc[t][g], isum[t][g], xsum[t][g], bs, xsi, sd, sm, c, nb, bpb);
            }
        }
    }
    store_rows(acc, nullptr, t0, n0, rows, out);
}

// ---- int4 weights, 32-blocks, passes of a few tokens (prompt lookup's verify passes) ----
// i4_kernel's work per (row, token) is a decode step's: per 32-block a horizontal sum of
// four int32 lanes and a float step on a quarter of a vector.  A pass of T = 4..16 tokens
// pays that T times while it unpacks each weight chunk only once, so here the weights are
// turned instead: 16 rows' code dwords are transposed once per chunk (lane = row), and
// each vpdpbusd then takes 4 bytes of one block of one token broadcast to all 16 rows.
// Eight of them leave a block's exact sum in every lane (no horizontal sum), and the
// reference's acc = acc + (s * d) * float(isum) runs on whole vectors of 16 rows, block by
// block in order: the same operations as ref::q8_row, so the same bits.  Sym weights,
// B = 32 (min(activation group, weight group)); the activations in i4_prep's layout.
// From 4 tokens on (measured on SmolLM2 int4 g32, 2 threads: at 4 and 5 tokens a pass is
// ~5% cheaper, from 6 on 10-20%; at 3 or fewer the weight stream sets the pace and
// i4_kernel keeps up with it as well).
constexpr int64_t kTurnedMinT = 4, kTurnedMaxT = 16, kTurnedTile = 12;
// int8 weights (i8_turned_kernel): from 4 tokens (below, i8g_kernel keeps up), rows
// longer than 1024 from 6 (their 16 row streams at once lost to i8g_kernel's 4 at 4 and 5
// tokens: SmolLM2's down projection, 576 x 1536, 1 thread, 49 -> 54 and 57 -> 62 us).
constexpr int64_t kI8TurnedMinT = 4, kI8TurnedLongK = 1024, kI8TurnedLongMinT = 6;

inline bool turned_ok(const ActQ8& x) { return x.T >= kTurnedMinT && x.T <= kTurnedMaxT; }

// The whole tiles of 16 rows of a turned kernel, kernel(integral_constant<TR>, t0, n): all
// T tokens in one tile (two above kTurnedTile tokens: the accumulators of more would not
// stay in registers).  Returns the first row of a last partial tile (n1: none).
template <class F>
int64_t turned_tiles(int64_t T, int64_t n0, int64_t n1, F&& kernel) {
    using std::integral_constant;
    auto tile = [&](int64_t t0, int64_t nt, int64_t n) {
        switch (nt) {
            case 1: return kernel(integral_constant<int, 1>(), t0, n);
            case 2: return kernel(integral_constant<int, 2>(), t0, n);
            case 3: return kernel(integral_constant<int, 3>(), t0, n);
            case 4: return kernel(integral_constant<int, 4>(), t0, n);
            case 5: return kernel(integral_constant<int, 5>(), t0, n);
            case 6: return kernel(integral_constant<int, 6>(), t0, n);
            case 7: return kernel(integral_constant<int, 7>(), t0, n);
            case 8: return kernel(integral_constant<int, 8>(), t0, n);
            case 9: return kernel(integral_constant<int, 9>(), t0, n);
            case 10: return kernel(integral_constant<int, 10>(), t0, n);
            case 11: return kernel(integral_constant<int, 11>(), t0, n);
            default: return kernel(integral_constant<int, 12>(), t0, n);
        }
    };
    const int64_t first = T <= kTurnedTile ? T : (T + 1) / 2;
    int64_t n = n0;
    for (; n + 16 <= n1; n += 16) {
        tile(0, first, n);
        if (first < T) tile(first, T - first, n);
    }
    return n;
}

// The weight stream is prefetched one tile (16 rows) ahead, a block's 4 rows at a time
// between the blocks' arithmetic: 16 prefetches at once stall on the line fill buffers.
constexpr int64_t kTurnedPrefetchRows = 16;

inline __m512i bcast32(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

// TR tokens x 16 rows.
template <int TR, bool GROUPED>
inline void i4_turned_kernel(const WeightView& w, const ActQ8& x, int64_t t0, int64_t n0, const GemmOut& out) {
    const int64_t K = w.K, NC = (K + 127) / 128, full = K / 128, G = K / w.group, CB = i4_chunk_bytes(K, x.group);
    const int64_t rb = K / 2, per_group = w.group / 32;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const uint8_t* codes = static_cast<const uint8_t*>(w.codes) + n0 * rb;
    const uint16_t* scales = w.scales_f16 + n0 * G;
    // Scales: gathered per chunk (group 32), else from the rows' scales as float, row-major.
    const bool fast = w.group == 32 && n0 + 16 < w.N;
    thread_local std::vector<float> sbuf;
    if (!fast) {
        if (sbuf.size() < static_cast<size_t>(16 * G)) sbuf.resize(static_cast<size_t>(16 * G));
        for (int r = 0; r < 16; ++r) {
            for (int64_t g = 0; g < G; g += 16) {
                const __mmask16 m = G - g >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (G - g)) - 1u);
                _mm512_mask_storeu_ps(sbuf.data() + r * G + g, m,
                                      _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, scales + r * G + g)));
            }
        }
    }
    const __m512i srow = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(static_cast<int>(G)));
    const int64_t sb = 2 * G;  // bytes from one row's scales to the next
    const __m512i qlo = _mm512_setr_epi64(0, sb, 2 * sb, 3 * sb, 4 * sb, 5 * sb, 6 * sb, 7 * sb);
    __m512 acc[TR];
    for (int t = 0; t < TR; ++t) acc[t] = _mm512_setzero_ps();
    alignas(64) __m512i wb[4][8];  // per 32-block of the chunk: lo nibbles of its 4 dwords, then hi
    for (int64_t c = 0; c < NC; ++c) {
        const __mmask64 km = c < full ? ~__mmask64{0} : (uint64_t{1} << ((K - 128 * c) / 2)) - 1;
        __m512i v[16];
        const uint8_t* p = codes + 64 * c;
        for (int r = 0; r < 16; ++r, p += rb) {
            v[r] = c < full ? ld512(p) : _mm512_maskz_loadu_epi8(km, p);
        }
        transpose16(v);
        const int64_t nb = c < full ? 4 : (K - 128 * c) / 32;
        for (int j = 0; j < nb; ++j) {
            for (int m = 0; m < 4; ++m) {
                wb[j][m] = _mm512_and_si512(v[4 * j + m], m4);
                wb[j][4 + m] = _mm512_and_si512(_mm512_srli_epi16(v[4 * j + m], 4), m4);
            }
        }
        __m512 d[4];
        if (fast) {
            const __m512i lo = _mm512_i64gather_epi64(qlo, scales + 4 * c, 1);
            const __m512i hi = _mm512_i64gather_epi64(qlo, scales + 8 * G + 4 * c, 1);
            static const uint16_t pick[2][32] = {
                {0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61},
                {2, 6, 10, 14, 18, 22, 26, 30, 34, 38, 42, 46, 50, 54, 58, 62, 3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 59, 63}};
            for (int h = 0; h < 2; ++h) {  // row r, block j: word 4r + j of (lo, hi)
                const __m512i wd = _mm512_permutex2var_epi16(lo, ld512(pick[h]), hi);
                d[2 * h] = _mm512_cvtph_ps(_mm512_castsi512_si256(wd));
                d[2 * h + 1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(wd, 1));
            }
        } else {
            for (int j = 0; j < nb; ++j) d[j] = _mm512_i32gather_ps(srow, sbuf.data() + (4 * c + j) / per_group, 4);
        }
        for (int j = 0; j < nb; ++j) {
            {  // this chunk of the next tile's rows: 4 per block, the rest at the chunk's last block
                const uint8_t* q = codes + 64 * c + (kTurnedPrefetchRows + 4 * j) * rb;
                const int last = j + 1 == nb ? 16 : 4 * j + 4;
                for (int r = 4 * j; r < last; ++r, q += rb) _mm_prefetch(reinterpret_cast<const char*>(q), _MM_HINT_T0);
            }
            __m512i wv[8];
            for (int i = 0; i < 8; ++i) wv[i] = wb[j][i];
            for (int t = 0; t < TR; ++t) {
                const uint8_t* pc = x.prep + (t0 + t) * x.prep_stride + c * CB + 16 * j;
                __m512i e = bcast32(pc + 128);  // -8 * sum(x) of the block
                for (int m = 0; m < 4; ++m) {  // one chain: the tokens' chains overlap
                    e = _mm512_dpbusd_epi32(e, wv[m], bcast32(pc + 4 * m));
                    e = _mm512_dpbusd_epi32(e, wv[4 + m], bcast32(pc + 64 + 4 * m));
                }
                const __m512 xs = GROUPED ? _mm512_set1_ps(*reinterpret_cast<const float*>(pc + 192)) : _mm512_set1_ps(x.s[t0 + t]);
                const __m512 sd = _mm512_mul_ps(xs, d[j]);
                acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(sd, _mm512_cvtepi32_ps(e)));
            }
        }
    }
    for (int t = 0; t < TR; ++t) {
        __m512 y = acc[t];
        if (out.bias != nullptr) y = _mm512_add_ps(y, _mm512_loadu_ps(out.bias + n0));
        if (out.residual != nullptr) y = _mm512_add_ps(y, _mm512_loadu_ps(out.residual + (t0 + t) * out.ldr + n0));
        _mm512_storeu_ps(out.y + (t0 + t) * out.ldy + n0, y);
    }
}

// Whole tiles of 16 rows (turned_tiles), the rows of a last partial tile in i4_kernel's tiles.
template <bool ASYM, bool GROUPED, Blocks BL>
void i4_turned_gemm(const WeightView& w, const ActQ8& x, int64_t n0, int64_t n1, const GemmOut& out) {
    const int64_t n = turned_tiles(x.T, n0, n1, [&](auto tr, int64_t t0, int64_t nn) {
        i4_turned_kernel<decltype(tr)::value, GROUPED>(w, x, t0, nn, out);
    });
    if (n == n1) return;
    q8_tile_loop<4, 4, 4>(x.T, n, n1, [&](auto tr, auto nr, int64_t t0, int64_t nn, int64_t rows) {
        i4_kernel<decltype(tr)::value, decltype(nr)::value, ASYM, GROUPED, BL>(w, x, t0, nn, rows, out);
    });
}

template <bool ASYM, bool GROUPED, Blocks BL>
void i4_gemm(const WeightView& w, const ActQ8& x, int64_t n0, int64_t n1, const GemmOut& out) {
    if (!ASYM && BL == Blocks::b32 && turned_ok(x)) return i4_turned_gemm<ASYM, GROUPED, BL>(w, x, n0, n1, out);
    q8_tile_loop<4, 4, 4>(x.T, n0, n1, [&](auto tr, auto nr, int64_t t0, int64_t n, int64_t rows) {
        i4_kernel<decltype(tr)::value, decltype(nr)::value, ASYM, GROUPED, BL>(w, x, t0, n, rows, out);
    });
}

template <bool ASYM, bool GROUPED>
void i4_gemm(const WeightView& w, const ActQ8& x, int64_t n0, int64_t n1, const GemmOut& out) {
    switch (blocks_of(x.group, w.group)) {
        case Blocks::b32: return i4_gemm<ASYM, GROUPED, Blocks::b32>(w, x, n0, n1, out);
        case Blocks::b64: return i4_gemm<ASYM, GROUPED, Blocks::b64>(w, x, n0, n1, out);
        case Blocks::b128k: return i4_gemm<ASYM, GROUPED, Blocks::b128k>(w, x, n0, n1, out);
        default: return i4_gemm<ASYM, GROUPED, Blocks::other>(w, x, n0, n1, out);
    }
}

// ---- int8-activation GEMM: int8 weights --------------------------------------------------
// Prep per token: per-token activations: one int32 vector holding -128 * sum(x) (64 B);
// grouped: per 128-element chunk (256 B), 128-bit lane j holding 32-block j:
//   [0, 64) its first 16 elements, [64, 128) its last 16, [128, 192) int32 -128 * sum(x)
//   of the 32-block in the first lane, zero in the others, [192, 256) the float scale xs.

inline bool i8_ok(const WeightView& w, int64_t ga) { return w.K % 32 == 0 && ga % 32 == 0; }

void i8_prep(const WeightView&, const ActQ8& x, int64_t t0, int64_t t1) {
    const int64_t K = x.K, ga = x.group, NC = (K + 127) / 128;
    const __m128i ones = _mm_set1_epi8(1);
    for (int64_t t = t0; t < t1; ++t) {
        const int8_t* q = x.q + t * K;
        const float* s = x.s + t * (K / ga);
        uint8_t* base = x.prep + t * x.prep_stride;
        if (ga == K) {
            __m512i sum = _mm512_setzero_si512();
            int64_t k = 0;
            for (; k + 64 <= K; k += 64) sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(1), ld512(q + k));
            int32_t total = _mm512_reduce_add_epi32(sum);
            for (; k < K; ++k) total += q[k];
            alignas(64) int32_t corr[16] = {};
            corr[0] = -128 * total;
            std::memcpy(base, corr, sizeof corr);
            continue;
        }
        for (int64_t c = 0; c < NC; ++c) {
            uint8_t* pc = base + c * 256;
            for (int j = 0; j < 4; ++j) {
                const int64_t e = 128 * c + 32 * j;
                __m128i lo = _mm_setzero_si128(), hi = _mm_setzero_si128();
                if (e < K) {
                    lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + e));
                    hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + e + 16));
                }
                __m128i sum = _mm_dpbusd_epi32(_mm_dpbusd_epi32(_mm_setzero_si128(), ones, lo), ones, hi);
                _mm_storeu_si128(reinterpret_cast<__m128i*>(pc + 16 * j), lo);
                _mm_storeu_si128(reinterpret_cast<__m128i*>(pc + 64 + 16 * j), hi);
                // the block's whole -128 * sum(x) in its first lane, zero in the others (the
                // kernels add all four; i8_turned_kernel broadcasts the first)
                sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, _MM_SHUFFLE(1, 0, 3, 2)));
                sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, _MM_SHUFFLE(2, 3, 0, 1)));
                _mm_storeu_si128(reinterpret_cast<__m128i*>(pc + 128 + 16 * j),
                                 _mm_maskz_mov_epi32(1, _mm_sub_epi32(_mm_setzero_si128(), _mm_slli_epi32(sum, 7))));
                _mm_storeu_ps(reinterpret_cast<float*>(pc + 192 + 16 * j), _mm_set1_ps(e < K ? s[e / ga] : 0.0f));
            }
        }
    }
}

// Grouped activations, one tile of TR tokens x NR rows (as i4_kernel).  Per 128-element
// chunk and row, two 128-bit lane shuffles put the first 16 weights of each 32-block in
// one vector and the last 16 in another (the prep laid the activations out alike), so two
// vpdpbusd leave 32-block j in 128-bit lane j as for int4; hsum4_epi32 gives the exact sums
// of 4 rows, then acc = acc + xs * float(isum) block by block and finally acc * w_scale, as
// the reference.
template <int TR, int NR, Blocks BL>
inline void i8g_kernel(const WeightView& w, const ActQ8& x, int64_t t0, int64_t n0, int64_t rows,
                       const GemmOut& out) {
    constexpr int NG = NR / 4;
    const int64_t K = w.K, bpb = x.group / 32;
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const int8_t* codes[NR];
    for (int r = 0; r < NR; ++r) codes[r] = static_cast<const int8_t*>(w.codes) + (n0 + (r < rows ? r : rows - 1)) * K;
    __m128 acc[TR][NG];
    __m128i isum[TR][NG], unused = _mm_setzero_si128();  // blocks longer than 32: the open block's sums
    for (int t = 0; t < TR; ++t) {
        for (int g = 0; g < NG; ++g) {
            acc[t][g] = _mm_setzero_ps();
            isum[t][g] = _mm_setzero_si128();
        }
    }
    const uint8_t* pt[TR];
    for (int t = 0; t < TR; ++t) pt[t] = x.prep + (t0 + t) * x.prep_stride;
    auto add = [&](int t, int g, __m512i bs, __m512 s, int64_t c, int64_t nb) {
        add_chunk<BL, false>(acc[t][g], isum[t][g], unused, bs, bs, s, s, c, nb, bpb);
    };
    // Masked-out bytes: u = 0 ^ 0x80 = 128 times x = 0 contributes nothing.
    auto chunk = [&](int64_t c, __mmask64 ka, __mmask64 kb, int64_t nb) __attribute__((always_inline)) {
        __m512i ua[NR], ub[NR];
        for (int r = 0; r < NR; ++r) {
            const int8_t* p = codes[r] + 128 * c;
            _mm_prefetch(reinterpret_cast<const char*>(p + PF_TILES * NR * K), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(p + 64 + PF_TILES * NR * K), _MM_HINT_T0);
            const __m512i a = _mm512_xor_si512(_mm512_maskz_loadu_epi8(ka, p), flip);
            const __m512i b = _mm512_xor_si512(_mm512_maskz_loadu_epi8(kb, p + 64), flip);
            ua[r] = _mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0));
            ub[r] = _mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1));
        }
        for (int t = 0; t < TR; ++t) {
            const uint8_t* pc = pt[t] + c * 256;
            const __m512i xa = ld512(pc), xb = ld512(pc + 64), corr = ld512(pc + 128);
            const __m512 s = _mm512_loadu_ps(reinterpret_cast<const float*>(pc + 192));
            for (int g = 0; g < NG; ++g) {
                __m512i ci[4];
                for (int i = 0; i < 4; ++i) {
                    ci[i] = _mm512_dpbusd_epi32(corr, ua[4 * g + i], xa);
                    ci[i] = _mm512_dpbusd_epi32(ci[i], ub[4 * g + i], xb);
                }
                add(t, g, hsum4_epi32(ci[0], ci[1], ci[2], ci[3]), s, c, nb);
            }
        }
    };
    // A last chunk of 32 or 64 elements (K = 576): one vector per row, its halves of the
    // 2 blocks in 128-bit lanes (0, 2) and (1, 3), the activations picked alike.
    auto half = [&](int64_t c, __mmask64 ka, int64_t nb) {
        __m512i u[NR];
        for (int r = 0; r < NR; ++r) {
            _mm_prefetch(reinterpret_cast<const char*>(codes[r] + 128 * c + PF_TILES * NR * K), _MM_HINT_T0);
            const __m512i a = _mm512_xor_si512(_mm512_maskz_loadu_epi8(ka, codes[r] + 128 * c), flip);
            u[r] = _mm512_shuffle_i32x4(a, a, _MM_SHUFFLE(3, 1, 2, 0));
        }
        for (int t = 0; t < TR; ++t) {
            const uint8_t* pc = pt[t] + c * 256;
            const __m512i xv = _mm512_shuffle_i32x4(ld512(pc), ld512(pc + 64), _MM_SHUFFLE(1, 0, 1, 0));
            const __m512i corr = ld512(pc + 128);
            const __m512 s = _mm512_loadu_ps(reinterpret_cast<const float*>(pc + 192));
            for (int g = 0; g < NG; ++g) {
                __m512i ci[4];
                for (int i = 0; i < 4; ++i) ci[i] = _mm512_dpbusd_epi32(corr, u[4 * g + i], xv);
                const __m512i h = hsum4_epi32(ci[0], ci[1], ci[2], ci[3]);
                add(t, g, _mm512_add_epi32(h, _mm512_shuffle_i32x4(h, h, _MM_SHUFFLE(1, 0, 3, 2))), s, c, nb);
            }
        }
    };
    const int64_t full = K / 128, left = K - 128 * full;
    for (int64_t c = 0; c < full; ++c) chunk(c, ~__mmask64{0}, ~__mmask64{0}, 4);
    if (left > 64) {
        chunk(full, ~__mmask64{0}, (uint64_t{1} << (left - 64)) - 1, left / 32);
    } else if (left > 0) {
        half(full, left == 64 ? ~__mmask64{0} : (uint64_t{1} << left) - 1, left / 32);
    }
    store_rows(acc, w.scales_f32, t0, n0, rows, out);
}

// Per-token activations: one exact int32 sum per row, (xs * float(isum)) * w_scale.
template <int TR, int NR>
inline void i8_kernel(const WeightView& w, const ActQ8& x, int64_t t0, int64_t n0, int64_t rows,
                      const GemmOut& out) {
    const int64_t K = w.K, NC = (K + 63) / 64, full = K / 64;
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const int8_t* codes[NR];
    for (int r = 0; r < NR; ++r) codes[r] = static_cast<const int8_t*>(w.codes) + (n0 + (r < rows ? r : rows - 1)) * K;
    __m512i ai[NR][TR];
    for (int r = 0; r < NR; ++r) {
        for (int t = 0; t < TR; ++t) ai[r][t] = ld512(x.prep + (t0 + t) * x.prep_stride);
    }
    for (int64_t c = 0; c < NC; ++c) {
        const __mmask64 k = c < full ? ~__mmask64{0} : (uint64_t{1} << (K - 64 * c)) - 1;
        __m512i u[NR];
        for (int r = 0; r < NR; ++r) {
            _mm_prefetch(reinterpret_cast<const char*>(codes[r] + 64 * c + PF_TILES * NR * K), _MM_HINT_T0);
            u[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(k, codes[r] + 64 * c), flip);
        }
        for (int t = 0; t < TR; ++t) {
            const __m512i xv = _mm512_maskz_loadu_epi8(k, x.q + (t0 + t) * K + 64 * c);
            for (int r = 0; r < NR; ++r) ai[r][t] = _mm512_dpbusd_epi32(ai[r][t], u[r], xv);
        }
    }
    // Masked-out bytes: u = 0 ^ 0x80 = 128 times x = 0 contributes nothing.
    for (int r = 0; r < rows; ++r) {
        const float ws = w.scales_f32[n0 + r];
        for (int t = 0; t < TR; ++t) {
            const float v = (x.s[t0 + t] * static_cast<float>(_mm512_reduce_add_epi32(ai[r][t]))) * ws;
            out.y[(t0 + t) * out.ldy + n0 + r] = finish(v, out, t0 + t, n0 + r);
        }
    }
}

// ---- int8 weights, grouped activations, passes of a few tokens: the weights turned ----
// As i4_turned_kernel: 16 rows' code dwords transposed once per 64 bytes (lane = row), each
// vpdpbusd takes 4 bytes of one token's 32-block broadcast to all 16 rows, so a block's
// exact sum lands in every lane without a horizontal sum, and the reference's
// acc = acc + xs * float(isum) (per activation group), then acc * w_scale, run on vectors
// of 16 rows: the same operations as ref::q8_row, so the same bits.  i8g_kernel pays a
// 4-row horizontal sum and a quarter-vector float step per (row, token) and block, which
// made the int8 head of a 4..8-token verify pass compute-bound.
inline bool i8_turned_ok(const WeightView& w, const ActQ8& x) {
    return x.T >= (w.K > kI8TurnedLongK ? kI8TurnedLongMinT : kI8TurnedMinT) && x.T <= kTurnedMaxT;
}

// TR tokens x 16 rows; activation groups of ga = 32 * bpb elements (B32: bpb == 1).
template <int TR, bool B32>
inline void i8_turned_kernel(const WeightView& w, const ActQ8& x, int64_t t0, int64_t n0, const GemmOut& out) {
    const int64_t K = w.K, ga = x.group, NP = (K + 63) / 64, full = K / 64, G = K / ga;
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const int8_t* codes = static_cast<const int8_t*>(w.codes) + n0 * K;
    __m512 acc[TR];
    __m512i isum[TR];  // !B32: the open activation group's sums
    for (int t = 0; t < TR; ++t) {
        acc[t] = _mm512_setzero_ps();
        isum[t] = _mm512_setzero_si512();
    }
    for (int64_t p = 0; p < NP; ++p) {
        const __mmask64 km = p < full ? ~__mmask64{0} : (uint64_t{1} << (K - 64 * p)) - 1;
        __m512i v[16];
        const int8_t* q = codes + 64 * p;
        for (int r = 0; r < 16; ++r, q += K) {
            v[r] = _mm512_xor_si512(p < full ? ld512(q) : _mm512_maskz_loadu_epi8(km, q), flip);
        }
        transpose16(v);  // v[l]: elements 64 p + 4 l .. + 3 of the 16 rows (bytes past K never used)
        const int64_t nb = p < full ? 2 : (K - 64 * p) / 32;
        for (int j = 0; j < nb; ++j) {
            {  // this piece of the next tile's rows, 8 per block
                const int8_t* f = codes + 64 * p + (kTurnedPrefetchRows + 8 * j) * K;
                const int last = j + 1 == nb ? 16 : 8 * j + 8;
                for (int r = 8 * j; r < last; ++r, f += K) _mm_prefetch(reinterpret_cast<const char*>(f), _MM_HINT_T0);
            }
            const int64_t e0 = 64 * p + 32 * j;
            const bool ends = B32 || (e0 + 32) % ga == 0;
            for (int t = 0; t < TR; ++t) {
                const int8_t* xq = x.q + (t0 + t) * K + e0;
                // -128 * sum(x) of the 32-block (i8_prep)
                __m512i e = bcast32(x.prep + (t0 + t) * x.prep_stride + (e0 / 128) * 256 + 128 + 16 * ((e0 % 128) / 32));
                for (int l = 0; l < 8; ++l) {  // one chain: the tokens' chains overlap
                    e = _mm512_dpbusd_epi32(e, v[8 * j + l], bcast32(reinterpret_cast<const uint8_t*>(xq + 4 * l)));
                }
                const __m512i s = B32 ? e : _mm512_add_epi32(isum[t], e);
                if (ends) {
                    const __m512 xs = _mm512_set1_ps(x.s[(t0 + t) * G + e0 / ga]);
                    acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(xs, _mm512_cvtepi32_ps(s)));
                    if (!B32) isum[t] = _mm512_setzero_si512();
                } else {
                    isum[t] = s;
                }
            }
        }
    }
    const __m512 ws = _mm512_loadu_ps(w.scales_f32 + n0);
    for (int t = 0; t < TR; ++t) {
        __m512 y = _mm512_mul_ps(acc[t], ws);
        if (out.bias != nullptr) y = _mm512_add_ps(y, _mm512_loadu_ps(out.bias + n0));
        if (out.residual != nullptr) y = _mm512_add_ps(y, _mm512_loadu_ps(out.residual + (t0 + t) * out.ldr + n0));
        _mm512_storeu_ps(out.y + (t0 + t) * out.ldy + n0, y);
    }
}

// Whole tiles of 16 rows (turned_tiles), the rows of a last partial tile by `rest`
// (i8g_kernel's tiles).
template <bool B32, class Rest>
void i8_turned_gemm(const WeightView& w, const ActQ8& x, int64_t n0, int64_t n1, const GemmOut& out, Rest&& rest) {
    const int64_t n = turned_tiles(x.T, n0, n1, [&](auto tr, int64_t t0, int64_t nn) {
        i8_turned_kernel<decltype(tr)::value, B32>(w, x, t0, nn, out);
    });
    if (n < n1) rest(n, n1);
}

template <bool GROUPED>
void i8_gemm(const WeightView& w, const ActQ8& x, int64_t n0, int64_t n1, const GemmOut& out) {
    if (!GROUPED) {
        return q8_tile_loop<2, 2, 4>(x.T, n0, n1, [&](auto tr, auto nr, int64_t t0, int64_t n, int64_t rows) {
            i8_kernel<decltype(tr)::value, decltype(nr)::value>(w, x, t0, n, rows, out);
        });
    }
    auto run = [&](auto bl) {
        auto rows = [&](int64_t r0, int64_t r1) {
            q8_tile_loop<4, 4, 4>(x.T, r0, r1, [&](auto tr, auto nr, int64_t t0, int64_t n, int64_t rows) {
                i8g_kernel<decltype(tr)::value, decltype(nr)::value, decltype(bl)::value>(w, x, t0, n, rows, out);
            });
        };
        if (!i8_turned_ok(w, x)) return rows(n0, n1);
        if (x.group == 32) return i8_turned_gemm<true>(w, x, n0, n1, out, rows);
        i8_turned_gemm<false>(w, x, n0, n1, out, rows);
    };
    switch (blocks_of(x.group, w.K)) {
        case Blocks::b32: return run(std::integral_constant<Blocks, Blocks::b32>());
        case Blocks::b64: return run(std::integral_constant<Blocks, Blocks::b64>());
        case Blocks::b128k: return run(std::integral_constant<Blocks, Blocks::b128k>());
        default: return run(std::integral_constant<Blocks, Blocks::other>());
    }
}

int64_t q8_prep_bytes(const WeightView& w, int64_t ga) {
    if (w.enc == WEnc::i8) {
        if (!i8_ok(w, ga)) return 0;
        return ga == w.K ? 64 : (w.K + 127) / 128 * 256;
    }
    if (!i4_ok(w, ga)) return 0;
    return (w.K + 127) / 128 * i4_chunk_bytes(w.K, ga);
}

void q8_prep(const WeightView& w, const ActQ8& x, int64_t t0, int64_t t1) {
    if (w.enc == WEnc::i8) {
        if (i8_ok(w, x.group)) i8_prep(w, x, t0, t1);
    } else if (i4_ok(w, x.group)) {
        i4_prep(w, x, t0, t1);
    }
}

void q8_gemm(const WeightView& w, const ActQ8& x, int64_t n0, int64_t n1, const GemmOut& out) {
    const bool grouped = x.group < x.K;
    if (w.enc == WEnc::i8) {
        if (!i8_ok(w, x.group)) return ref::q8_gemm(w, x, n0, n1, out);
        return grouped ? i8_gemm<true>(w, x, n0, n1, out) : i8_gemm<false>(w, x, n0, n1, out);
    }
    if (!i4_ok(w, x.group)) return ref::q8_gemm(w, x, n0, n1, out);
    if (w.enc == WEnc::i4asym) {
        return grouped ? i4_gemm<true, true>(w, x, n0, n1, out) : i4_gemm<true, false>(w, x, n0, n1, out);
    }
    return grouped ? i4_gemm<false, true>(w, x, n0, n1, out) : i4_gemm<false, false>(w, x, n0, n1, out);
}

// ---- float-activation GEMM -----------------------------------------------------------------
// Weights are dequantized in registers exactly as edgepack.format.codecs does (int4:
// (nib - 8) * d, or nib * d + m with two roundings; int8 scale applied once per row) and
// multiplied into float32 accumulators with FMA.

// 16 weights starting at element k of row `row` as float (k multiple of 16; masked tail).
template <WEnc E>
inline __m512 load_w16(const void* row, int64_t k, __mmask16 m) {
    if (E == WEnc::f32) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(row) + k);
    if (E == WEnc::f16) {
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(row) + k));
    }
    if (E == WEnc::bf16) {
        const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(row) + k);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    const __m128i b = _mm_maskz_loadu_epi8(m, static_cast<const int8_t*>(row) + k);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

template <int TR, int NR, WEnc E>
inline void fw_kernel(const WeightView& w, const ActF32& x, int64_t t0, int64_t n0, const GemmOut& out) {
    const int64_t K = w.K;
    const int64_t esz = E == WEnc::f32 ? 4 : (E == WEnc::i8 ? 1 : 2);
    const uint8_t* base = static_cast<const uint8_t*>(w.codes) + n0 * K * esz;
    __m512 acc[NR][TR];
    for (int r = 0; r < NR; ++r) {
        for (int t = 0; t < TR; ++t) acc[r][t] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 m = k + 16 <= K ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (K - k)) - 1u);
        __m512 wv[NR];
        for (int r = 0; r < NR; ++r) wv[r] = load_w16<E>(base + r * K * esz, k, m);
        for (int t = 0; t < TR; ++t) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, x.x + (t0 + t) * K + k);
            for (int r = 0; r < NR; ++r) acc[r][t] = _mm512_fmadd_ps(xv, wv[r], acc[r][t]);
        }
    }
    for (int r = 0; r < NR; ++r) {
        for (int t = 0; t < TR; ++t) {
            float v = _mm512_reduce_add_ps(acc[r][t]);
            if (E == WEnc::i8) v = v * w.scales_f32[n0 + r];
            out.y[(t0 + t) * out.ldy + n0 + r] = finish(v, out, t0 + t, n0 + r);
        }
    }
}

// int4 weights, float activations: per 32 elements (16 code bytes) of NR rows, nibbles are
// interleaved back to element order and dequantized exactly as codecs does, then FMA'd
// into TR x NR float accumulators.
template <int TR, int NR, bool ASYM>
inline void f4_kernel(const WeightView& w, const ActF32& x, int64_t t0, int64_t n0, const GemmOut& out) {
    const int64_t K = w.K, gw = w.group, G = K / gw;
    const __m128i m4 = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
    __m512 acc[NR][TR];
    for (int r = 0; r < NR; ++r) {
        for (int t = 0; t < TR; ++t) acc[r][t] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < K; k += 32) {
        __m512 w0[NR], w1[NR];
        for (int r = 0; r < NR; ++r) {
            const int64_t n = n0 + r;
            const uint8_t* codes = static_cast<const uint8_t*>(w.codes) + n * (K / 2);
            const __m512 d = _mm512_set1_ps(_cvtsh_ss(w.scales_f16[n * G + k / gw]));
            const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k / 2));
            const __m128i lo = _mm_and_si128(b, m4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
            __m128i e0 = _mm_unpacklo_epi8(lo, hi), e1 = _mm_unpackhi_epi8(lo, hi);
            if (ASYM) {
                const __m512 m = _mm512_set1_ps(_cvtsh_ss(w.zeros_f16[n * G + k / gw]));
                w0[r] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(e0)), d), m);
                w1[r] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(e1)), d), m);
            } else {
                e0 = _mm_sub_epi8(e0, eight);
                e1 = _mm_sub_epi8(e1, eight);
                w0[r] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(e0)), d);
                w1[r] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(e1)), d);
            }
        }
        for (int t = 0; t < TR; ++t) {
            const float* xr = x.x + (t0 + t) * K + k;
            const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);
            for (int r = 0; r < NR; ++r) {
                acc[r][t] = _mm512_fmadd_ps(x0, w0[r], acc[r][t]);
                acc[r][t] = _mm512_fmadd_ps(x1, w1[r], acc[r][t]);
            }
        }
    }
    for (int r = 0; r < NR; ++r) {
        for (int t = 0; t < TR; ++t) {
            out.y[(t0 + t) * out.ldy + n0 + r] = finish(_mm512_reduce_add_ps(acc[r][t]), out, t0 + t, n0 + r);
        }
    }
}

int64_t f32_prep_bytes(const WeightView&) { return 0; }
void f32_prep(const WeightView&, const ActF32&, int64_t, int64_t) {}

void f32_gemm(const WeightView& w, const ActF32& x, int64_t n0, int64_t n1, const GemmOut& out) {
#define EDGEPACK_FW(E)                                                                     \
    return tile_loop<2, 4>(x.T, n0, n1, [&](auto tr, auto nr, int64_t t0, int64_t n) {    \
        fw_kernel<decltype(tr)::value, decltype(nr)::value, E>(w, x, t0, n, out);          \
    })
#define EDGEPACK_F4(A)                                                                     \
    return tile_loop<2, 4>(x.T, n0, n1, [&](auto tr, auto nr, int64_t t0, int64_t n) {    \
        f4_kernel<decltype(tr)::value, decltype(nr)::value, A>(w, x, t0, n, out);          \
    })
    switch (w.enc) {
        case WEnc::f32: EDGEPACK_FW(WEnc::f32);
        case WEnc::f16: EDGEPACK_FW(WEnc::f16);
        case WEnc::bf16: EDGEPACK_FW(WEnc::bf16);
        case WEnc::i8: EDGEPACK_FW(WEnc::i8);
        case WEnc::i4sym:
        case WEnc::i4asym:
            if (w.K % 32 != 0 || w.group % 32 != 0) return ref::f32_gemm(w, x, n0, n1, out);
            if (w.enc == WEnc::i4asym) EDGEPACK_F4(true);
            EDGEPACK_F4(false);
    }
#undef EDGEPACK_FW
#undef EDGEPACK_F4
}

}  // namespace

const InferTable& avx512_infer_table() {
    static const InferTable t = EDGEPACK_INFER_TABLE("avx512", V16, q8_prep_bytes, q8_prep, q8_gemm,
                                                      f32_prep_bytes, f32_prep, f32_gemm);
    return t;
}

}  // namespace infer
}  // namespace edgepack

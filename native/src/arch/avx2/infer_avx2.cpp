// AVX2 + FMA + F16C inference kernels.
//
// Generic kernels: infer/generic.h with the 8-lane wrapper V8 (two vectors make the 16
// canonical lanes; bit-identical to the reference).  Integer GEMM without VNNI:
//   int4: vpmaddubsw(nibbles 0..15 unsigned, x signed): each int16 is a sum of two
//         products <= 2 * 15 * 127, and the even/odd halves are added as int16 (4 products,
//         <= 7620, no saturation) before vpmaddwd widens pairs to int32; sym subtracts
//         8 * sum(x) through a per-lane int32 correction from the activation prep;
//   int8: the sign trick, vpmaddubsw(|w|, sign(x, w)): |w| <= 128 is exact as unsigned even
//         for w = -128, |x| <= 127, so a pair sums to at most 2 * 128 * 127 = 32512.
// Activation prep for int4 (per token, per 64-element chunk, CB bytes):
//   [0, 32) even elements of the two 32-blocks, [32, 64) odd elements, [64, 96) int32
//   lanes: sym -8 * lane_sum(x) / asym float lane_sum(x) * lane scale, [96, 128) float
//   lane scales (grouped activations only).  int8 needs no prep.
#include <immintrin.h>

#include <cstring>

#include "../../fp16.h"
#include "../../infer/infer.h"

namespace edgepack {
namespace infer {
namespace {

struct V8 {
    static constexpr int W = 8;
    using T = __m256;
    static T load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
    static T set1(float v) { return _mm256_set1_ps(v); }
    static T zero() { return _mm256_setzero_ps(); }
    static T add(T a, T b) { return _mm256_add_ps(a, b); }
    static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
    static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
    static T div(T a, T b) { return _mm256_div_ps(a, b); }
    static T max(T a, T b) { return _mm256_max_ps(a, b); }  // == a > b ? a : b
    static T min(T a, T b) { return _mm256_min_ps(a, b); }  // == a < b ? a : b
    static T round(T v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static T load_i8(const int8_t* p) {
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    }
    static void store_i8(int8_t* p, T v) {
        const __m256i i = _mm256_cvtps_epi32(v);
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
    }
    static T pow2i(T n) {
        const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
        return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
    }
    static float fold16(const T* acc) {
        const __m256 t8 = _mm256_add_ps(acc[0], acc[1]);
        const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
        const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
        return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
    }
    static uint32_t max_abs_bits(const float* x, int64_t n) {
        const __m256i mask = _mm256_set1_epi32(0x7fffffff);
        __m256i m = _mm256_setzero_si256();
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), mask));
        }
        __m128i r = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
        r = _mm_max_epu32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(1, 0, 3, 2)));
        r = _mm_max_epu32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(2, 3, 0, 1)));
        uint32_t best = static_cast<uint32_t>(_mm_cvtsi128_si32(r));
        for (; i < n; ++i) {
            const uint32_t b = f32_bits(x[i]) & 0x7fffffffu;
            best = b > best ? b : best;
        }
        return best;
    }
    static float h2f(uint16_t h) { return _cvtsh_ss(h); }
    static void nib32(const uint8_t* p, float* o) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        const __m128i m = _mm_set1_epi8(0x0f);
        const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
        const __m128i e[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};
        const __m256 eight = _mm256_set1_ps(8.0f);
        for (int h = 0; h < 2; ++h) {
            _mm256_storeu_ps(o + 16 * h, _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(e[h])), eight));
            _mm256_storeu_ps(o + 16 * h + 8,
                             _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(e[h], 8))), eight));
        }
    }
};

}  // namespace
}  // namespace infer
}  // namespace edgepack

#include "../../infer/generic.h"

namespace edgepack {
namespace infer {
namespace {

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

inline __m256i ld256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// Software prefetch distance of the weight streams, in row tiles (see infer_avx512.cpp).
constexpr int64_t PF_TILES = 4;

inline float hsum(__m256 v) {
    const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
    return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}

inline int32_t hsum_i32(__m256i v) {
    __m128i r = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(1, 0, 3, 2)));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(r);
}

// Scales of the two 32-blocks of 64-element chunk c (lanes 0-3, 4-7; zero past K).
inline __m256 chunk_scales(const uint16_t* row, int64_t c, int64_t gw, int64_t K) {
    if (gw == 32 && 64 * c + 64 <= K) {
        int32_t two;
        std::memcpy(&two, row + 2 * c, 4);
        const __m128 s = _mm_cvtph_ps(_mm_cvtsi32_si128(two));
        return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    }
    if (gw % 64 == 0 && 64 * c + 64 <= K) return _mm256_set1_ps(_cvtsh_ss(row[64 * c / gw]));
    const float s0 = _cvtsh_ss(row[64 * c / gw]);
    const float s1 = 64 * c + 32 < K ? _cvtsh_ss(row[(64 * c + 32) / gw]) : 0.0f;
    return _mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1);
}

// ---- int4 ------------------------------------------------------------------------------

inline bool i4_ok(const WeightView& w, int64_t ga) {
    return w.K % 32 == 0 && w.group % 32 == 0 && ga % 32 == 0;
}

inline int64_t i4_chunk_bytes(int64_t K, int64_t ga) { return ga < K ? 128 : 96; }

void i4_prep(const WeightView& w, const ActQ8& x, int64_t t0, int64_t t1) {
    const int64_t K = x.K, ga = x.group, NC = (K + 63) / 64, CB = i4_chunk_bytes(K, ga);
    const bool asym = w.enc == WEnc::i4asym, grouped = ga < K;
    const __m256i deint = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                           0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m128i ones8 = _mm_set1_epi8(1);
    const __m128i ones16 = _mm_set1_epi16(1);
    for (int64_t t = t0; t < t1; ++t) {
        const int8_t* q = x.q + t * K;
        const float* s = x.s + t * (K / ga);
        uint8_t* base = x.prep + t * x.prep_stride;
        for (int64_t c = 0; c < NC; ++c) {
            uint8_t* pc = base + c * CB;
            for (int j = 0; j < 2; ++j) {
                const int64_t e = 64 * c + 32 * j;
                __m128i ev = _mm_setzero_si128(), od = _mm_setzero_si128();
                float ls = 0.0f;
                if (e < K) {
                    __m256i v = _mm256_shuffle_epi8(ld256(q + e), deint);
                    v = _mm256_permute4x64_epi64(v, _MM_SHUFFLE(3, 1, 2, 0));
                    ev = _mm256_castsi256_si128(v);
                    od = _mm256_extracti128_si256(v, 1);
                    ls = grouped ? s[e / ga] : 1.0f;
                }
                _mm_storeu_si128(reinterpret_cast<__m128i*>(pc + 16 * j), ev);
                _mm_storeu_si128(reinterpret_cast<__m128i*>(pc + 32 + 16 * j), od);
                // Lane sums over the same 4+4 bytes the kernel's madd lanes cover.
                const __m128i p = _mm_add_epi16(_mm_maddubs_epi16(ones8, ev), _mm_maddubs_epi16(ones8, od));
                const __m128i sum = _mm_madd_epi16(p, ones16);
                if (asym) {
                    _mm_storeu_ps(reinterpret_cast<float*>(pc + 64 + 16 * j), _mm_mul_ps(_mm_cvtepi32_ps(sum), _mm_set1_ps(ls)));
                } else {
                    _mm_storeu_si128(reinterpret_cast<__m128i*>(pc + 64 + 16 * j),
                                     _mm_sub_epi32(_mm_setzero_si128(), _mm_slli_epi32(sum, 3)));
                }
                if (grouped) _mm_storeu_ps(reinterpret_cast<float*>(pc + 96 + 16 * j), _mm_set1_ps(ls));
            }
        }
    }
}

template <int TR, int NR, bool ASYM, bool GROUPED>
inline void i4_kernel(const WeightView& w, const ActQ8& x, int64_t t0, int64_t n0, const GemmOut& out) {
    const int64_t K = w.K, NC = (K + 63) / 64, full = K / 64, G = K / w.group;
    const int64_t CB = i4_chunk_bytes(K, x.group);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1);
    const uint8_t* codes[NR];
    const uint16_t* srow[NR];
    const uint16_t* zrow[NR];
    for (int r = 0; r < NR; ++r) {
        codes[r] = static_cast<const uint8_t*>(w.codes) + (n0 + r) * (K / 2);
        srow[r] = w.scales_f16 + (n0 + r) * G;
        zrow[r] = ASYM ? w.zeros_f16 + (n0 + r) * G : nullptr;
    }
    __m256 acc[NR][TR];
    for (int r = 0; r < NR; ++r) {
        for (int t = 0; t < TR; ++t) acc[r][t] = _mm256_setzero_ps();
        _mm_prefetch(reinterpret_cast<const char*>(srow[r] + PF_TILES * NR * G), _MM_HINT_T0);
        if (ASYM) _mm_prefetch(reinterpret_cast<const char*>(zrow[r] + PF_TILES * NR * G), _MM_HINT_T0);
    }
    const uint8_t* pt[TR];
    for (int t = 0; t < TR; ++t) pt[t] = x.prep + (t0 + t) * x.prep_stride;
    for (int64_t c = 0; c < NC; ++c) {
        __m256i lo[NR], hi[NR];
        __m256 dv[NR], mv[NR];
        for (int r = 0; r < NR; ++r) {
            if ((c & 1) == 0) {  // one line per row: the same line PF_TILES tiles further down
                _mm_prefetch(reinterpret_cast<const char*>(codes[r] + 32 * c + PF_TILES * NR * (K / 2)), _MM_HINT_T0);
            }
            const __m256i v = c < full ? ld256(codes[r] + 32 * c)
                                       : _mm256_inserti128_si256(_mm256_setzero_si256(),
                                                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes[r] + 32 * c)), 0);
            lo[r] = _mm256_and_si256(v, m4);
            hi[r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            dv[r] = chunk_scales(srow[r], c, w.group, K);
            if (ASYM) mv[r] = chunk_scales(zrow[r], c, w.group, K);
        }
        for (int t = 0; t < TR; ++t) {
            const uint8_t* pc = pt[t] + c * CB;
            const __m256i xa = ld256(pc), xb = ld256(pc + 32);
            for (int r = 0; r < NR; ++r) {
                const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[r], xa), _mm256_maddubs_epi16(hi[r], xb));
                __m256i ci = _mm256_madd_epi16(p, ones);
                if (!ASYM) ci = _mm256_add_epi32(ci, ld256(pc + 64));
                const __m256 f = _mm256_cvtepi32_ps(ci);
                if (GROUPED) {
                    acc[r][t] = _mm256_fmadd_ps(f, _mm256_mul_ps(dv[r], _mm256_loadu_ps(reinterpret_cast<const float*>(pc + 96))), acc[r][t]);
                } else {
                    acc[r][t] = _mm256_fmadd_ps(f, dv[r], acc[r][t]);
                }
                if (ASYM) acc[r][t] = _mm256_fmadd_ps(mv[r], _mm256_loadu_ps(reinterpret_cast<const float*>(pc + 64)), acc[r][t]);
            }
        }
    }
    for (int r = 0; r < NR; ++r) {
        for (int t = 0; t < TR; ++t) {
            float v = hsum(acc[r][t]);
            if (!GROUPED) v = v * x.s[t0 + t];
            out.y[(t0 + t) * out.ldy + n0 + r] = finish(v, out, t0 + t, n0 + r);
        }
    }
}

template <bool ASYM, bool GROUPED>
void i4_gemm(const WeightView& w, const ActQ8& x, int64_t n0, int64_t n1, const GemmOut& out) {
    tile_loop<1, 2>(x.T, n0, n1, [&](auto tr, auto nr, int64_t t0, int64_t n) {
        i4_kernel<decltype(tr)::value, decltype(nr)::value, ASYM, GROUPED>(w, x, t0, n, out);
    });
}

// ---- int8 ------------------------------------------------------------------------------

inline bool i8_ok(const WeightView& w, int64_t ga) { return w.K % 32 == 0 && ga % 32 == 0; }

template <int TR, int NR, bool GROUPED>
inline void i8_kernel(const WeightView& w, const ActQ8& x, int64_t t0, int64_t n0, const GemmOut& out) {
    const int64_t K = w.K, ga = x.group, NG = K / ga;
    const int8_t* codes = static_cast<const int8_t*>(w.codes) + n0 * K;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i ai[NR][TR];
    __m256 af[NR][TR];
    for (int r = 0; r < NR; ++r) {
        for (int t = 0; t < TR; ++t) {
            ai[r][t] = _mm256_setzero_si256();
            af[r][t] = _mm256_setzero_ps();
        }
    }
    for (int64_t k = 0; k < K; k += 32) {
        __m256i wv[NR], aw[NR];
        for (int r = 0; r < NR; ++r) {
            if ((k & 63) == 0) {
                _mm_prefetch(reinterpret_cast<const char*>(codes + r * K + k + PF_TILES * NR * K), _MM_HINT_T0);
            }
            wv[r] = ld256(codes + r * K + k);
            aw[r] = _mm256_abs_epi8(wv[r]);
        }
        for (int t = 0; t < TR; ++t) {
            const __m256i xv = ld256(x.q + (t0 + t) * K + k);
            __m256 xs;
            if (GROUPED) xs = _mm256_set1_ps(x.s[(t0 + t) * NG + k / ga]);
            for (int r = 0; r < NR; ++r) {
                const __m256i ci = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[r], _mm256_sign_epi8(xv, wv[r])), ones);
                if (GROUPED) {
                    af[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ci), xs, af[r][t]);
                } else {
                    ai[r][t] = _mm256_add_epi32(ai[r][t], ci);
                }
            }
        }
    }
    for (int r = 0; r < NR; ++r) {
        const float ws = w.scales_f32[n0 + r];
        for (int t = 0; t < TR; ++t) {
            const float v = GROUPED ? hsum(af[r][t]) * ws
                                    : (x.s[t0 + t] * static_cast<float>(hsum_i32(ai[r][t]))) * ws;
            out.y[(t0 + t) * out.ldy + n0 + r] = finish(v, out, t0 + t, n0 + r);
        }
    }
}

template <bool GROUPED>
void i8_gemm(const WeightView& w, const ActQ8& x, int64_t n0, int64_t n1, const GemmOut& out) {
    tile_loop<1, 2>(x.T, n0, n1, [&](auto tr, auto nr, int64_t t0, int64_t n) {
        i8_kernel<decltype(tr)::value, decltype(nr)::value, GROUPED>(w, x, t0, n, out);
    });
}

int64_t q8_prep_bytes(const WeightView& w, int64_t ga) {
    if (w.enc == WEnc::i8 || !i4_ok(w, ga)) return 0;
    return (w.K + 63) / 64 * i4_chunk_bytes(w.K, ga);
}

void q8_prep(const WeightView& w, const ActQ8& x, int64_t t0, int64_t t1) {
    if (w.enc != WEnc::i8 && i4_ok(w, x.group)) i4_prep(w, x, t0, t1);
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

// ---- float activations -----------------------------------------------------------------

template <WEnc E>
inline __m256 load_w8(const void* row, int64_t k) {
    if (E == WEnc::f32) return _mm256_loadu_ps(static_cast<const float*>(row) + k);
    if (E == WEnc::f16) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + k)));
    if (E == WEnc::bf16) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + k));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(row) + k))));
}

template <WEnc E>
inline float load_w1(const void* row, int64_t k) {
    if (E == WEnc::f32) return static_cast<const float*>(row)[k];
    if (E == WEnc::f16) return f16_to_f32(static_cast<const uint16_t*>(row)[k]);
    if (E == WEnc::bf16) return bits_f32(uint32_t{static_cast<const uint16_t*>(row)[k]} << 16);
    return static_cast<float>(static_cast<const int8_t*>(row)[k]);
}

template <int TR, int NR, WEnc E>
inline void fw_kernel(const WeightView& w, const ActF32& x, int64_t t0, int64_t n0, const GemmOut& out) {
    const int64_t K = w.K;
    const int64_t esz = E == WEnc::f32 ? 4 : (E == WEnc::i8 ? 1 : 2);
    const uint8_t* base = static_cast<const uint8_t*>(w.codes) + n0 * K * esz;
    __m256 acc[NR][TR];
    for (int r = 0; r < NR; ++r) {
        for (int t = 0; t < TR; ++t) acc[r][t] = _mm256_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[NR];
        for (int r = 0; r < NR; ++r) wv[r] = load_w8<E>(base + r * K * esz, k);
        for (int t = 0; t < TR; ++t) {
            const __m256 xv = _mm256_loadu_ps(x.x + (t0 + t) * K + k);
            for (int r = 0; r < NR; ++r) acc[r][t] = _mm256_fmadd_ps(xv, wv[r], acc[r][t]);
        }
    }
    for (int r = 0; r < NR; ++r) {
        for (int t = 0; t < TR; ++t) {
            float v = hsum(acc[r][t]);
            for (int64_t j = k; j < K; ++j) v = v + x.x[(t0 + t) * K + j] * load_w1<E>(base + r * K * esz, j);
            if (E == WEnc::i8) v = v * w.scales_f32[n0 + r];
            out.y[(t0 + t) * out.ldy + n0 + r] = finish(v, out, t0 + t, n0 + r);
        }
    }
}

// int4 weights, float activations (see the AVX-512 version): NR rows x TR tokens.
template <int TR, int NR, bool ASYM>
inline void f4_kernel(const WeightView& w, const ActF32& x, int64_t t0, int64_t n0, const GemmOut& out) {
    const int64_t K = w.K, gw = w.group, G = K / gw;
    const __m128i m4 = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
    __m256 acc[NR][TR];
    for (int r = 0; r < NR; ++r) {
        for (int t = 0; t < TR; ++t) acc[r][t] = _mm256_setzero_ps();
    }
    for (int64_t k = 0; k < K; k += 32) {
        __m256 wv[NR][4];
        for (int r = 0; r < NR; ++r) {
            const int64_t n = n0 + r;
            const uint8_t* codes = static_cast<const uint8_t*>(w.codes) + n * (K / 2);
            const __m256 d = _mm256_set1_ps(_cvtsh_ss(w.scales_f16[n * G + k / gw]));
            const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k / 2));
            const __m128i lo = _mm_and_si128(b, m4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
            __m128i e[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};
            if (ASYM) {
                const __m256 m = _mm256_set1_ps(_cvtsh_ss(w.zeros_f16[n * G + k / gw]));
                for (int h = 0; h < 2; ++h) {
                    wv[r][2 * h] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(e[h])), d), m);
                    wv[r][2 * h + 1] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(e[h], 8))), d), m);
                }
            } else {
                for (int h = 0; h < 2; ++h) {
                    e[h] = _mm_sub_epi8(e[h], eight);
                    wv[r][2 * h] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e[h])), d);
                    wv[r][2 * h + 1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(e[h], 8))), d);
                }
            }
        }
        for (int t = 0; t < TR; ++t) {
            const float* xr = x.x + (t0 + t) * K + k;
            for (int h = 0; h < 4; ++h) {
                const __m256 xv = _mm256_loadu_ps(xr + 8 * h);
                for (int r = 0; r < NR; ++r) acc[r][t] = _mm256_fmadd_ps(xv, wv[r][h], acc[r][t]);
            }
        }
    }
    for (int r = 0; r < NR; ++r) {
        for (int t = 0; t < TR; ++t) out.y[(t0 + t) * out.ldy + n0 + r] = finish(hsum(acc[r][t]), out, t0 + t, n0 + r);
    }
}

int64_t f32_prep_bytes(const WeightView&) { return 0; }
void f32_prep(const WeightView&, const ActF32&, int64_t, int64_t) {}

void f32_gemm(const WeightView& w, const ActF32& x, int64_t n0, int64_t n1, const GemmOut& out) {
#define EDGEPACK_FW(E)                                                                     \
    return tile_loop<1, 2>(x.T, n0, n1, [&](auto tr, auto nr, int64_t t0, int64_t n) {    \
        fw_kernel<decltype(tr)::value, decltype(nr)::value, E>(w, x, t0, n, out);          \
    })
#define EDGEPACK_F4(A)                                                                     \
    return tile_loop<1, 2>(x.T, n0, n1, [&](auto tr, auto nr, int64_t t0, int64_t n) {    \
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

const InferTable& avx2_infer_table() {
    static const InferTable t = EDGEPACK_INFER_TABLE("avx2", V8, q8_prep_bytes, q8_prep, q8_gemm,
                                                      f32_prep_bytes, f32_prep, f32_gemm);
    return t;
}

}  // namespace infer
}  // namespace edgepack

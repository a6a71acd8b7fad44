// AVX2 + F16C overrides.  Same arithmetic as ref/quant_ref.cpp, eight lanes at a time:
// float mul, clamp, round-to-nearest-even, then integer packing.  Compiled with
// -mavx2 -mf16c -mfma -ffp-contract=off (no fused multiply-add ever).
#include "../x86_common.h"

namespace edgepack {
namespace {

using namespace x86;

inline __m256i abs_bits(__m256 v) {
    return _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(kAbsMask));
}

inline int32_t hmax_epi32(__m256i v) {
    __m128i m = _mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(m);
}

inline float hmin_ps(__m256 v) {
    __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_min_ps(m, _mm_movehl_ps(m, m));
    m = _mm_min_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

inline float hmax_ps(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

// clip(rint(x * inv), lo, hi) + bias as int32; clamping first is equivalent because the
// bounds are integers and rint is monotonic, and it keeps huge products in int range.
inline __m256i quant8(__m256 x, __m256 inv, __m256 lo, __m256 hi, __m256i bias) {
    __m256 y = _mm256_mul_ps(x, inv);
    y = _mm256_min_ps(_mm256_max_ps(y, lo), hi);
    y = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_add_epi32(_mm256_cvtps_epi32(y), bias);
}

// 32 int32 nibbles (4 vectors, in order) -> 16 packed bytes, even element in the low nibble.
inline __m128i pack_nibbles32(__m256i q0, __m256i q1, __m256i q2, __m256i q3) {
    __m256i b = _mm256_packus_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    const __m256i s = _mm256_maddubs_epi16(b, _mm256_set1_epi16(0x1001));
    return _mm_packus_epi16(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

// 8 int32 nibbles -> 4 packed bytes in the low dword.
inline __m128i pack_nibbles8(__m256i q) {
    const __m128i p = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    const __m128i s = _mm_maddubs_epi16(_mm_packus_epi16(p, p), _mm_set1_epi16(0x1001));
    return _mm_packus_epi16(s, s);
}

// Quantize one group of g (multiple of 8) floats to g/2 bytes: clip(rint((x - m) * inv)).
inline void quant_group4(const float* x, int64_t g, __m256 m, __m256 inv, __m256 lo, __m256 hi,
                         __m256i bias, uint8_t* out) {
    int64_t i = 0;
    for (; i + 32 <= g; i += 32) {
        const __m256i q0 = quant8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m), inv, lo, hi, bias);
        const __m256i q1 = quant8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), m), inv, lo, hi, bias);
        const __m256i q2 = quant8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 16), m), inv, lo, hi, bias);
        const __m256i q3 = quant8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 24), m), inv, lo, hi, bias);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i / 2), pack_nibbles32(q0, q1, q2, q3));
    }
    for (; i < g; i += 8) {
        const __m256i q = quant8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m), inv, lo, hi, bias);
        store4(out + i / 2, pack_nibbles8(q));
    }
}

Result quantize_i8(const QuantI8Args& a) {
    const int64_t C = a.cols;
    const __m256 lo = _mm256_set1_ps(-127.0f);
    const __m256 hi = _mm256_set1_ps(127.0f);
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t r = 0; r < a.rows; ++r) {
        const float* w = a.w + r * C;
        int8_t* codes = a.codes + r * C;
        __m256i vmax = _mm256_setzero_si256();
        int64_t c = 0;
        for (; c + 8 <= C; c += 8) vmax = _mm256_max_epi32(vmax, abs_bits(_mm256_loadu_ps(w + c)));
        int32_t amax_bits = hmax_epi32(vmax);
        for (; c < C; ++c) {
            const int32_t b = static_cast<int32_t>(f32_bits(w[c]) & 0x7fffffffu);
            amax_bits = b > amax_bits ? b : amax_bits;
        }
        if (amax_bits >= kExpAll) return {Status::non_finite, r, first_non_finite(w, C)};
        const float d = bits_f32(static_cast<uint32_t>(amax_bits)) / 127.0f;
        a.scales[r] = d;
        const float inv_s = reciprocal(d);
        if (is_inf_f(inv_s)) {  // 0 * inf case: the reference handles it
            ref::quantize_i8_row(w, C, inv_s, codes);
            continue;
        }
        const __m256 inv = _mm256_set1_ps(inv_s);
        c = 0;
        for (; c + 32 <= C; c += 32) {
            const __m256i q0 = quant8(_mm256_loadu_ps(w + c), inv, lo, hi, zero);
            const __m256i q1 = quant8(_mm256_loadu_ps(w + c + 8), inv, lo, hi, zero);
            const __m256i q2 = quant8(_mm256_loadu_ps(w + c + 16), inv, lo, hi, zero);
            const __m256i q3 = quant8(_mm256_loadu_ps(w + c + 24), inv, lo, hi, zero);
            __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
            b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + c), b);
        }
        for (; c + 8 <= C; c += 8) {
            const __m256i q = quant8(_mm256_loadu_ps(w + c), inv, lo, hi, zero);
            const __m128i p =
                _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
            _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + c), _mm_packs_epi16(p, p));
        }
        for (; c < C; ++c) {
            codes[c] = static_cast<int8_t>(clamp_ss(rint_ss(w[c] * inv_s), -127.0f, 127.0f));
        }
    }
    return {};
}

void dequantize_i8(const DequantI8Args& a) {
    const int64_t C = a.cols;
    for (int64_t r = 0; r < a.rows; ++r) {
        const int8_t* q = a.codes + r * C;
        float* out = a.out + r * C;
        const float ds = a.scales[r];
        const __m256 d = _mm256_set1_ps(ds);
        int64_t c = 0;
        for (; c + 16 <= C; c += 16) {
            const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c));
            const __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
            const __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
            _mm256_storeu_ps(out + c, _mm256_mul_ps(f0, d));
            _mm256_storeu_ps(out + c + 8, _mm256_mul_ps(f1, d));
        }
        for (; c < C; ++c) out[c] = static_cast<float>(q[c]) * ds;
    }
}

// Per-group reference-order path, used for the groups left over after 8-group blocks.
template <bool kSym>
Result quant_group_single(const float* w, int64_t C, int64_t g, int64_t r, int64_t j,
                          uint8_t* codes, uint16_t* scale, uint16_t* min) {
    const float* x = w + j * g;
    __m256 v = _mm256_loadu_ps(x);
    __m256 vmin = v, vmax = v;
    __m256i vabs = abs_bits(v);
    for (int64_t i = 8; i < g; i += 8) {
        v = _mm256_loadu_ps(x + i);
        vmin = _mm256_min_ps(vmin, v);
        vmax = _mm256_max_ps(vmax, v);
        vabs = _mm256_max_epi32(vabs, abs_bits(v));
    }
    const int32_t amax = hmax_epi32(vabs);
    if (amax >= kExpAll) return {Status::non_finite, r, first_non_finite(w, C)};
    float m = 0.0f, d;
    if (kSym) {
        int64_t peak = 0;  // first element with the largest |x| (numpy argmax)
        while (static_cast<int32_t>(f32_bits(x[peak]) & 0x7fffffffu) != amax) ++peak;
        d = x[peak] / -8.0f;
    } else {
        m = hmin_ps(vmin) + 0.0f;  // canonical +0, as in codecs.py
        d = ((hmax_ps(vmax) + 0.0f) - m) / 15.0f;
    }
    const uint16_t d16 = to_f16(d);
    if (f16_is_inf(d16)) return overflow_or_non_finite(Status::scale_overflow, w, C, r, j);
    *scale = d16;
    __m256 mv = _mm256_setzero_ps();
    if (!kSym) {
        const uint16_t m16 = to_f16(m);
        if (f16_is_inf(m16)) return overflow_or_non_finite(Status::min_overflow, w, C, r, j);
        *min = m16;
        mv = _mm256_set1_ps(from_f16(m16));
    }
    const __m256 inv = _mm256_set1_ps(reciprocal(from_f16(d16)));
    if (kSym) {
        quant_group4(x, g, mv, inv, _mm256_set1_ps(-8.0f), _mm256_set1_ps(7.0f),
                     _mm256_set1_epi32(8), codes);
    } else {
        quant_group4(x, g, mv, inv, _mm256_setzero_ps(), _mm256_set1_ps(15.0f),
                     _mm256_setzero_si256(), codes);
    }
    return {};
}

// Transpose-reduce: lane t of the result is the reduction of all lanes of v[t].
template <class Op>
inline __m256 reduce8x8(const __m256* v, Op op) {
    __m256 t[4], u[2];
    for (int i = 0; i < 4; ++i) {
        t[i] = op(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    }
    for (int i = 0; i < 2; ++i) {
        u[i] = op(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                  _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    }
    return op(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}

// Quantize rows in blocks of 8 groups: group statistics are transposed into one vector so
// the scale arithmetic (divide, float16 round trip, reciprocal) runs 8 groups at a time.
template <bool kSym>
Result quantize_i4(const QuantI4Args& a) {
    const int64_t C = a.cols, g = a.group, ngroups = C / g;
    const auto fmax = [](__m256 x, __m256 y) { return _mm256_max_ps(x, y); };
    const auto fmin = [](__m256 x, __m256 y) { return _mm256_min_ps(x, y); };
    const auto imax = [](__m256 x, __m256 y) {
        return _mm256_castsi256_ps(_mm256_max_epi32(_mm256_castps_si256(x), _mm256_castps_si256(y)));
    };
    const __m256 lo = _mm256_set1_ps(kSym ? -8.0f : 0.0f);
    const __m256 hi = _mm256_set1_ps(kSym ? 7.0f : 15.0f);
    const __m256i bias = _mm256_set1_epi32(kSym ? 8 : 0);
    const __m128i f16_abs = _mm_set1_epi16(0x7fff), f16_inf = _mm_set1_epi16(0x7c00);
    for (int64_t r = 0; r < a.rows; ++r) {
        const float* w = a.w + r * C;
        uint8_t* codes = a.codes + r * (C / 2);
        uint16_t* scales = a.scales + r * ngroups;
        uint16_t* mins = kSym ? nullptr : a.mins + r * ngroups;
        int64_t j = 0;
        for (; j + 8 <= ngroups; j += 8) {
            __m256 smax[8], smin[8], amax[8];
            for (int t = 0; t < 8; ++t) {
                const float* x = w + (j + t) * g;
                __m256 v = _mm256_loadu_ps(x);
                __m256 mx = v, mn = v;
                __m256i ab = abs_bits(v);
                for (int64_t i = 8; i < g; i += 8) {
                    v = _mm256_loadu_ps(x + i);
                    mx = _mm256_max_ps(mx, v);
                    mn = _mm256_min_ps(mn, v);
                    ab = _mm256_max_epi32(ab, abs_bits(v));
                }
                smax[t] = mx;
                smin[t] = mn;
                amax[t] = _mm256_castsi256_ps(ab);
            }
            const __m256 ab = reduce8x8(amax, imax);
            const __m256i ab_i = _mm256_castps_si256(ab);
            if (_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(ab_i, _mm256_set1_epi32(kExpAll - 1))))) {
                return {Status::non_finite, r, first_non_finite(w, C)};
            }
            __m256 mx = reduce8x8(smax, fmax);
            __m256 mn = reduce8x8(smin, fmin);
            __m256 d;
            if (kSym) {
                // The peak's sign: the largest |x| equals max(x), or -min(x), or both (a tie
                // between +p and -p, or an all-zero group): then find the first one.
                const __m256 neg_mn = _mm256_xor_ps(mn, _mm256_set1_ps(-0.0f));
                const __m256 pos = _mm256_cmp_ps(mx, ab, _CMP_EQ_OQ);
                const __m256 neg = _mm256_cmp_ps(neg_mn, ab, _CMP_EQ_OQ);
                __m256 peak = _mm256_blendv_ps(mn, mx, pos);
                const int ties = _mm256_movemask_ps(_mm256_and_ps(pos, neg));
                if (ties) {
                    alignas(32) float pk[8];
                    alignas(32) int32_t am[8];
                    _mm256_store_ps(pk, peak);
                    _mm256_store_si256(reinterpret_cast<__m256i*>(am), ab_i);
                    for (int t = 0; t < 8; ++t) {
                        if (!(ties >> t & 1)) continue;
                        const float* x = w + (j + t) * g;
                        int64_t i = 0;
                        while (static_cast<int32_t>(f32_bits(x[i]) & 0x7fffffffu) != am[t]) ++i;
                        pk[t] = x[i];
                    }
                    peak = _mm256_load_ps(pk);
                }
                d = _mm256_div_ps(peak, _mm256_set1_ps(-8.0f));
            } else {
                mn = _mm256_add_ps(mn, _mm256_setzero_ps());  // canonical +0, as in codecs.py
                mx = _mm256_add_ps(mx, _mm256_setzero_ps());
                d = _mm256_div_ps(_mm256_sub_ps(mx, mn), _mm256_set1_ps(15.0f));
            }
            const __m128i d16 = _mm256_cvtps_ph(d, _MM_FROUND_TO_NEAREST_INT);
            const __m128i m16 = kSym ? _mm_setzero_si128() : _mm256_cvtps_ph(mn, _MM_FROUND_TO_NEAREST_INT);
            const int d_inf = _mm_movemask_epi8(_mm_cmpeq_epi16(_mm_and_si128(d16, f16_abs), f16_inf));
            const int m_inf = _mm_movemask_epi8(_mm_cmpeq_epi16(_mm_and_si128(m16, f16_abs), f16_inf));
            if (d_inf | m_inf) {
                const int lane = __builtin_ctz(static_cast<unsigned>(d_inf | m_inf)) / 2;
                const Status s = (d_inf >> (2 * lane)) & 1 ? Status::scale_overflow : Status::min_overflow;
                return overflow_or_non_finite(s, w, C, r, j + lane);
            }
            _mm_storeu_si128(reinterpret_cast<__m128i*>(scales + j), d16);
            if (!kSym) _mm_storeu_si128(reinterpret_cast<__m128i*>(mins + j), m16);
            const __m256 df = _mm256_cvtph_ps(d16);
            const __m256 inv = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), df),
                                             _mm256_cmp_ps(df, _mm256_setzero_ps(), _CMP_NEQ_OQ));
            alignas(32) float inv_a[8], m_a[8];
            _mm256_store_ps(inv_a, inv);
            _mm256_store_ps(m_a, _mm256_cvtph_ps(m16));
            for (int t = 0; t < 8; ++t) {
                quant_group4(w + (j + t) * g, g, _mm256_set1_ps(m_a[t]), _mm256_set1_ps(inv_a[t]), lo,
                             hi, bias, codes + (j + t) * (g / 2));
            }
        }
        for (; j < ngroups; ++j) {
            const Result res = quant_group_single<kSym>(w, C, g, r, j, codes + j * (g / 2), scales + j,
                                                        kSym ? nullptr : mins + j);
            if (res.status != Status::ok) return res;
        }
    }
    return {};
}

Result quantize_i4_sym(const QuantI4Args& a) { return quantize_i4<true>(a); }
Result quantize_i4_asym(const QuantI4Args& a) { return quantize_i4<false>(a); }

// Expand 16 packed bytes to 32 nibbles as bytes, in element order.
inline void unpack16(const uint8_t* src, __m128i& n_lo, __m128i& n_hi) {
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i l = _mm_and_si128(c, mask);
    const __m128i h = _mm_and_si128(_mm_srli_epi16(c, 4), mask);
    n_lo = _mm_unpacklo_epi8(l, h);
    n_hi = _mm_unpackhi_epi8(l, h);
}

template <bool kSym>
inline __m256 dq8(__m128i n8, __m256 d, __m256 m) {
    // n8: 8 nibble bytes in the low half; symmetric codes are already n - 8 (signed).
    const __m256 f = _mm256_cvtepi32_ps(kSym ? _mm256_cvtepi8_epi32(n8) : _mm256_cvtepu8_epi32(n8));
    return kSym ? _mm256_mul_ps(f, d) : _mm256_add_ps(_mm256_mul_ps(f, d), m);
}

template <bool kSym>
void dequant_i4_rows(const DequantI4Args& a) {
    const int64_t C = a.cols, g = a.group, ngroups = C / g;
    const __m128i eight = _mm_set1_epi8(8);
    for (int64_t r = 0; r < a.rows; ++r) {
        for (int64_t j = 0; j < ngroups; ++j) {
            const uint8_t* q = a.codes + r * (C / 2) + j * (g / 2);
            float* o = a.out + r * C + j * g;
            const __m256 d = _mm256_set1_ps(from_f16(a.scales[r * ngroups + j]));
            const __m256 m = kSym ? _mm256_setzero_ps() : _mm256_set1_ps(from_f16(a.mins[r * ngroups + j]));
            int64_t i = 0;
            for (; i + 32 <= g; i += 32) {
                __m128i n0, n1;
                unpack16(q + i / 2, n0, n1);
                if (kSym) {
                    n0 = _mm_sub_epi8(n0, eight);
                    n1 = _mm_sub_epi8(n1, eight);
                }
                _mm256_storeu_ps(o + i, dq8<kSym>(n0, d, m));
                _mm256_storeu_ps(o + i + 8, dq8<kSym>(_mm_srli_si128(n0, 8), d, m));
                _mm256_storeu_ps(o + i + 16, dq8<kSym>(n1, d, m));
                _mm256_storeu_ps(o + i + 24, dq8<kSym>(_mm_srli_si128(n1, 8), d, m));
            }
            for (; i < g; i += 8) {
                int32_t raw;
                std::memcpy(&raw, q + i / 2, 4);
                const __m128i c = _mm_cvtsi32_si128(raw);
                const __m128i mask = _mm_set1_epi8(0x0f);
                __m128i n = _mm_unpacklo_epi8(_mm_and_si128(c, mask),
                                              _mm_and_si128(_mm_srli_epi16(c, 4), mask));
                if (kSym) n = _mm_sub_epi8(n, eight);
                _mm256_storeu_ps(o + i, dq8<kSym>(n, d, m));
            }
        }
    }
}

void dequantize_i4(const DequantI4Args& a) {
    if (a.mins == nullptr) {
        dequant_i4_rows<true>(a);
    } else {
        dequant_i4_rows<false>(a);
    }
}

}  // namespace

const KernelTable& avx2_table() {
    static const KernelTable t = {
        "avx2", 20, quantize_i8, dequantize_i8, quantize_i4_sym, quantize_i4_asym, dequantize_i4,
    };
    return t;
}

}  // namespace edgepack

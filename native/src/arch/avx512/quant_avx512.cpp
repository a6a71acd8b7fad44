// AVX-512 (F/BW/VL) overrides: sixteen lanes, masked tails instead of scalar loops,
// embedded round-to-nearest-even conversions.  Same arithmetic as ref/quant_ref.cpp.
#include "../x86_common.h"

namespace edgepack {
namespace {

using namespace x86;

constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

inline __mmask16 tail_mask(int64_t n) {
    return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}

inline __m512i abs_bits(__m512 v) {
    return _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(kAbsMask));
}

// clip(rint(x * inv), lo, hi) + bias as int32.  Products stay far inside int32 range for
// every finite inv (int4: |x * inv| < 2^30; int8: |x * inv| <= 128).
inline __m512i quant16(__m512 x, __m512 inv, __m512i lo, __m512i hi, __m512i bias) {
    const __m512i q = _mm512_cvt_roundps_epi32(_mm512_mul_ps(x, inv), kRne);
    return _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), bias);
}

// 16 int32 nibbles -> 8 packed bytes (element 2k low nibble, 2k+1 high nibble).
inline __m128i pack_nibbles16(__m512i q) {
    return _mm512_cvtepi64_epi8(_mm512_or_si512(q, _mm512_srli_epi64(q, 28)));
}

inline void quant_group4(const float* x, int64_t g, __m512 m, __m512 inv, __m512i lo,
                         __m512i hi, __m512i bias, uint8_t* out) {
    int64_t i = 0;
    for (; i + 32 <= g; i += 32) {
        const __m512i q0 = quant16(_mm512_sub_ps(_mm512_loadu_ps(x + i), m), inv, lo, hi, bias);
        const __m512i q1 = quant16(_mm512_sub_ps(_mm512_loadu_ps(x + i + 16), m), inv, lo, hi, bias);
        const __m128i p = _mm_unpacklo_epi64(pack_nibbles16(q0), pack_nibbles16(q1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i / 2), p);
    }
    for (; i < g; i += 16) {
        const __mmask16 k = tail_mask(g - i);
        const __m512i q = quant16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), m), inv, lo, hi, bias);
        _mm_mask_storeu_epi8(out + i / 2, static_cast<__mmask16>(g - i >= 16 ? 0xff : 0x0f),
                             pack_nibbles16(q));
    }
}

Result quantize_i8(const QuantI8Args& a) {
    const int64_t C = a.cols;
    const __m512i lo = _mm512_set1_epi32(-127);
    const __m512i hi = _mm512_set1_epi32(127);
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t r = 0; r < a.rows; ++r) {
        const float* w = a.w + r * C;
        int8_t* codes = a.codes + r * C;
        __m512i vmax = _mm512_setzero_si512();
        for (int64_t c = 0; c < C; c += 16) {
            const __m512 v = _mm512_maskz_loadu_ps(tail_mask(C - c), w + c);
            vmax = _mm512_max_epi32(vmax, abs_bits(v));
        }
        const int32_t amax = _mm512_reduce_max_epi32(vmax);
        if (amax >= kExpAll) return {Status::non_finite, r, first_non_finite(w, C)};
        const float d = bits_f32(static_cast<uint32_t>(amax)) / 127.0f;
        a.scales[r] = d;
        const float inv_s = reciprocal(d);
        if (is_inf_f(inv_s)) {  // 0 * inf case: the reference handles it
            ref::quantize_i8_row(w, C, inv_s, codes);
            continue;
        }
        const __m512 inv = _mm512_set1_ps(inv_s);
        int64_t c = 0;
        for (; c + 64 <= C; c += 64) {
            const __m128i b0 = _mm512_cvtsepi32_epi8(quant16(_mm512_loadu_ps(w + c), inv, lo, hi, zero));
            const __m128i b1 = _mm512_cvtsepi32_epi8(quant16(_mm512_loadu_ps(w + c + 16), inv, lo, hi, zero));
            const __m128i b2 = _mm512_cvtsepi32_epi8(quant16(_mm512_loadu_ps(w + c + 32), inv, lo, hi, zero));
            const __m128i b3 = _mm512_cvtsepi32_epi8(quant16(_mm512_loadu_ps(w + c + 48), inv, lo, hi, zero));
            const __m256i lo2 = _mm256_inserti128_si256(_mm256_castsi128_si256(b0), b1, 1);
            const __m256i hi2 = _mm256_inserti128_si256(_mm256_castsi128_si256(b2), b3, 1);
            _mm512_storeu_si512(codes + c, _mm512_inserti64x4(_mm512_castsi256_si512(lo2), hi2, 1));
        }
        for (; c < C; c += 16) {
            const __mmask16 k = tail_mask(C - c);
            const __m512i q = quant16(_mm512_maskz_loadu_ps(k, w + c), inv, lo, hi, zero);
            _mm_mask_storeu_epi8(codes + c, k, _mm512_cvtsepi32_epi8(q));
        }
    }
    return {};
}

void dequantize_i8(const DequantI8Args& a) {
    const int64_t C = a.cols;
    for (int64_t r = 0; r < a.rows; ++r) {
        const int8_t* q = a.codes + r * C;
        float* out = a.out + r * C;
        const __m512 d = _mm512_set1_ps(a.scales[r]);
        for (int64_t c = 0; c < C; c += 16) {
            const __mmask16 k = tail_mask(C - c);
            const __m128i b = _mm_maskz_loadu_epi8(k, q + c);
            const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
            _mm512_mask_storeu_ps(out + c, k, _mm512_mul_ps(f, d));
        }
    }
}

// Per-group statistics over g floats (multiple of 8): signed max/min and max of |x| bits.
// Masked-off tail lanes are filled with x[0], which is neutral for all three.
inline void group_stats(const float* x, int64_t g, __m512& mx, __m512& mn, __m512i& ab) {
    if (g % 16 == 0) {  // common case: no tail, plain loads
        __m512 v = _mm512_loadu_ps(x);
        mx = v;
        mn = v;
        ab = abs_bits(v);
        for (int64_t i = 16; i < g; i += 16) {
            v = _mm512_loadu_ps(x + i);
            mx = _mm512_max_ps(mx, v);
            mn = _mm512_min_ps(mn, v);
            ab = _mm512_max_epi32(ab, abs_bits(v));
        }
        return;
    }
    const __m512 first = _mm512_set1_ps(x[0]);
    __m512 v = _mm512_mask_loadu_ps(first, tail_mask(g), x);
    mx = v;
    mn = v;
    ab = abs_bits(v);
    for (int64_t i = 16; i < g; i += 16) {
        v = _mm512_mask_loadu_ps(first, tail_mask(g - i), x + i);
        mx = _mm512_max_ps(mx, v);
        mn = _mm512_min_ps(mn, v);
        ab = _mm512_max_epi32(ab, abs_bits(v));
    }
}

// Per-group reference-order path, used for the groups left over after 16-group blocks.
template <bool kSym>
Result quant_group_single(const float* w, int64_t C, int64_t g, int64_t r, int64_t j,
                          uint8_t* codes, uint16_t* scale, uint16_t* min) {
    const float* x = w + j * g;
    __m512 vmax, vmin;
    __m512i vabs;
    group_stats(x, g, vmax, vmin, vabs);
    const int32_t amax = _mm512_reduce_max_epi32(vabs);
    if (amax >= kExpAll) return {Status::non_finite, r, first_non_finite(w, C)};
    float m = 0.0f, d;
    if (kSym) {
        int64_t peak = 0;  // first element with the largest |x| (numpy argmax)
        while (static_cast<int32_t>(f32_bits(x[peak]) & 0x7fffffffu) != amax) ++peak;
        d = x[peak] / -8.0f;
    } else {
        m = _mm512_reduce_min_ps(vmin) + 0.0f;  // canonical +0, as in codecs.py
        d = ((_mm512_reduce_max_ps(vmax) + 0.0f) - m) / 15.0f;
    }
    const uint16_t d16 = to_f16(d);
    if (f16_is_inf(d16)) return overflow_or_non_finite(Status::scale_overflow, w, C, r, j);
    *scale = d16;
    __m512 mv = _mm512_setzero_ps();
    if (!kSym) {
        const uint16_t m16 = to_f16(m);
        if (f16_is_inf(m16)) return overflow_or_non_finite(Status::min_overflow, w, C, r, j);
        *min = m16;
        mv = _mm512_set1_ps(from_f16(m16));
    }
    const __m512 inv = _mm512_set1_ps(reciprocal(from_f16(d16)));
    quant_group4(x, g, mv, inv, _mm512_set1_epi32(kSym ? -8 : 0), _mm512_set1_epi32(kSym ? 7 : 15),
                 _mm512_set1_epi32(kSym ? 8 : 0), codes);
    return {};
}

// Transpose-reduce: lane t of the result is the reduction of all lanes of v[t].
template <class Op>
inline __m512 reduce16x16(const __m512* v, Op op) {
    __m512 t[8], u[4], q[2];
    for (int i = 0; i < 8; ++i) {
        t[i] = op(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    }
    for (int i = 0; i < 4; ++i) {
        u[i] = op(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                  _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    }
    for (int i = 0; i < 2; ++i) {
        q[i] = op(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                  _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    }
    return op(_mm512_shuffle_f32x4(q[0], q[1], _MM_SHUFFLE(2, 0, 2, 0)),
              _mm512_shuffle_f32x4(q[0], q[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Quantize rows in blocks of 16 groups: group statistics are transposed into one vector so
// the scale arithmetic (divide, float16 round trip, reciprocal) runs 16 groups at a time.
template <bool kSym>
Result quantize_i4(const QuantI4Args& a) {
    const int64_t C = a.cols, g = a.group, ngroups = C / g;
    const auto fmax = [](__m512 x, __m512 y) { return _mm512_max_ps(x, y); };
    const auto fmin = [](__m512 x, __m512 y) { return _mm512_min_ps(x, y); };
    const auto imax = [](__m512 x, __m512 y) {
        return _mm512_castsi512_ps(_mm512_max_epi32(_mm512_castps_si512(x), _mm512_castps_si512(y)));
    };
    const __m512i lo = _mm512_set1_epi32(kSym ? -8 : 0);
    const __m512i hi = _mm512_set1_epi32(kSym ? 7 : 15);
    const __m512i bias = _mm512_set1_epi32(kSym ? 8 : 0);
    const __m256i f16_abs = _mm256_set1_epi16(0x7fff), f16_inf = _mm256_set1_epi16(0x7c00);
    for (int64_t r = 0; r < a.rows; ++r) {
        const float* w = a.w + r * C;
        uint8_t* codes = a.codes + r * (C / 2);
        uint16_t* scales = a.scales + r * ngroups;
        uint16_t* mins = kSym ? nullptr : a.mins + r * ngroups;
        int64_t j = 0;
        for (; j + 16 <= ngroups; j += 16) {
            __m512 smax[16], smin[16], amax[16];
            for (int t = 0; t < 16; ++t) {
                __m512i ab;
                group_stats(w + (j + t) * g, g, smax[t], smin[t], ab);
                amax[t] = _mm512_castsi512_ps(ab);
            }
            const __m512i ab = _mm512_castps_si512(reduce16x16(amax, imax));
            if (_mm512_cmpge_epi32_mask(ab, _mm512_set1_epi32(kExpAll))) {
                return {Status::non_finite, r, first_non_finite(w, C)};
            }
            __m512 mx = reduce16x16(smax, fmax);
            __m512 mn = reduce16x16(smin, fmin);
            __m512 d;
            if (kSym) {
                // The peak's sign: the largest |x| equals max(x), or -min(x), or both (a tie
                // between +p and -p, or an all-zero group): then find the first one.
                const __m512 abf = _mm512_castsi512_ps(ab);
                const __mmask16 pos = _mm512_cmp_ps_mask(mx, abf, _CMP_EQ_OQ);
                const __mmask16 neg = _mm512_cmp_ps_mask(
                    _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(mn), _mm512_set1_epi32(INT32_MIN))),
                    abf, _CMP_EQ_OQ);
                __m512 peak = _mm512_mask_blend_ps(pos, mn, mx);
                const unsigned ties = pos & neg;
                if (ties) {
                    alignas(64) float pk[16];
                    alignas(64) int32_t am[16];
                    _mm512_store_ps(pk, peak);
                    _mm512_store_si512(am, ab);
                    for (int t = 0; t < 16; ++t) {
                        if (!(ties >> t & 1)) continue;
                        const float* x = w + (j + t) * g;
                        int64_t i = 0;
                        while (static_cast<int32_t>(f32_bits(x[i]) & 0x7fffffffu) != am[t]) ++i;
                        pk[t] = x[i];
                    }
                    peak = _mm512_load_ps(pk);
                }
                d = _mm512_div_ps(peak, _mm512_set1_ps(-8.0f));
            } else {
                mn = _mm512_add_ps(mn, _mm512_setzero_ps());  // canonical +0, as in codecs.py
                mx = _mm512_add_ps(mx, _mm512_setzero_ps());
                d = _mm512_div_ps(_mm512_sub_ps(mx, mn), _mm512_set1_ps(15.0f));
            }
            const __m256i d16 = _mm512_cvtps_ph(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m256i m16 = kSym ? _mm256_setzero_si256()
                                     : _mm512_cvtps_ph(mn, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const unsigned d_inf = _mm256_cmpeq_epi16_mask(_mm256_and_si256(d16, f16_abs), f16_inf);
            const unsigned m_inf = _mm256_cmpeq_epi16_mask(_mm256_and_si256(m16, f16_abs), f16_inf);
            if (d_inf | m_inf) {
                const int lane = __builtin_ctz(d_inf | m_inf);
                const Status s = (d_inf >> lane) & 1 ? Status::scale_overflow : Status::min_overflow;
                return overflow_or_non_finite(s, w, C, r, j + lane);
            }
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(scales + j), d16);
            if (!kSym) _mm256_storeu_si256(reinterpret_cast<__m256i*>(mins + j), m16);
            const __m512 df = _mm512_cvtph_ps(d16);
            const __mmask16 nz = _mm512_cmp_ps_mask(df, _mm512_setzero_ps(), _CMP_NEQ_OQ);
            const __m512 inv = _mm512_maskz_div_ps(nz, _mm512_set1_ps(1.0f), df);
            alignas(64) float inv_a[16], m_a[16];
            _mm512_store_ps(inv_a, inv);
            _mm512_store_ps(m_a, _mm512_cvtph_ps(m16));
            for (int t = 0; t < 16; ++t) {
                quant_group4(w + (j + t) * g, g, _mm512_set1_ps(m_a[t]), _mm512_set1_ps(inv_a[t]), lo,
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

template <bool kSym>
inline __m512 dq16(__m128i n16, __m512 d, __m512 m) {
    // n16: 16 nibble bytes; symmetric codes are already n - 8 (signed).
    const __m512 f = _mm512_cvtepi32_ps(kSym ? _mm512_cvtepi8_epi32(n16) : _mm512_cvtepu8_epi32(n16));
    return kSym ? _mm512_mul_ps(f, d) : _mm512_add_ps(_mm512_mul_ps(f, d), m);
}

template <bool kSym>
void dequant_i4_rows(const DequantI4Args& a) {
    const int64_t C = a.cols, g = a.group, ngroups = C / g;
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i eight = _mm_set1_epi8(8);
    for (int64_t r = 0; r < a.rows; ++r) {
        for (int64_t j = 0; j < ngroups; ++j) {
            const uint8_t* q = a.codes + r * (C / 2) + j * (g / 2);
            float* o = a.out + r * C + j * g;
            const __m512 d = _mm512_set1_ps(from_f16(a.scales[r * ngroups + j]));
            const __m512 m = kSym ? _mm512_setzero_ps() : _mm512_set1_ps(from_f16(a.mins[r * ngroups + j]));
            int64_t i = 0;
            for (; i + 32 <= g; i += 32) {
                const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i / 2));
                const __m128i l = _mm_and_si128(c, mask);
                const __m128i h = _mm_and_si128(_mm_srli_epi16(c, 4), mask);
                __m128i n0 = _mm_unpacklo_epi8(l, h);
                __m128i n1 = _mm_unpackhi_epi8(l, h);
                if (kSym) {
                    n0 = _mm_sub_epi8(n0, eight);
                    n1 = _mm_sub_epi8(n1, eight);
                }
                _mm512_storeu_ps(o + i, dq16<kSym>(n0, d, m));
                _mm512_storeu_ps(o + i + 16, dq16<kSym>(n1, d, m));
            }
            for (; i < g; i += 16) {
                const __mmask16 k = tail_mask(g - i);
                const __mmask16 kb = static_cast<__mmask16>(g - i >= 16 ? 0xff : 0x0f);
                const __m128i c = _mm_maskz_loadu_epi8(kb, q + i / 2);
                __m128i n = _mm_unpacklo_epi8(_mm_and_si128(c, mask),
                                              _mm_and_si128(_mm_srli_epi16(c, 4), mask));
                if (kSym) n = _mm_sub_epi8(n, eight);
                _mm512_mask_storeu_ps(o + i, k, dq16<kSym>(n, d, m));
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

const KernelTable& avx512_table() {
    static const KernelTable t = {
        "avx512", 30, quantize_i8, dequantize_i8, quantize_i4_sym, quantize_i4_asym, dequantize_i4,
    };
    return t;
}

}  // namespace edgepack

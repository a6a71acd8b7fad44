// AArch64 NEON (baseline ARMv8.0, no dotprod) inference kernels.
//
// Generic kernels: infer/generic.h with the 4-lane wrapper V4 (four vectors make the 16
// canonical lanes; bit-identical to the reference).  Integer GEMM with widening
// multiplies: smull/smlal2 produce int16 sums of at most 4 nibble*int8 products (<= 7620)
// or 2 int8*int8 products (<= 2 * 128 * 127), sadalp widens to int32.  Block sums are
// reduced to one int32 per block and combined with the scales in the same scalar order
// as the reference, so NEON matmul_q8 results are bit-identical to the reference too.
// int4 activations are re-laid out per 32-block (16 even, then 16 odd elements) so the
// low/high nibbles of 16 code bytes line up without shuffling the weights.
#include <arm_neon.h>

#include <cstring>

#include "../../fp16.h"
#include "../../infer/infer.h"

namespace edgepack {
namespace infer {
namespace {

struct V4 {
    static constexpr int W = 4;
    using T = float32x4_t;
    static T load(const float* p) { return vld1q_f32(p); }
    static void store(float* p, T v) { vst1q_f32(p, v); }
    static T set1(float v) { return vdupq_n_f32(v); }
    static T zero() { return vdupq_n_f32(0.0f); }
    static T add(T a, T b) { return vaddq_f32(a, b); }
    static T sub(T a, T b) { return vsubq_f32(a, b); }
    static T mul(T a, T b) { return vmulq_f32(a, b); }
    static T div(T a, T b) { return vdivq_f32(a, b); }
    // fmax/fmin propagate NaN; the contract is `a > b ? a : b` / `a < b ? a : b`.
    static T max(T a, T b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
    static T min(T a, T b) { return vbslq_f32(vcltq_f32(a, b), a, b); }
    static T round(T v) { return vrndnq_f32(v); }
    static T load_i8(const int8_t* p) {
        int32_t raw;
        std::memcpy(&raw, p, 4);
        const int16x8_t w = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(raw)));
        return vcvtq_f32_s32(vmovl_s16(vget_low_s16(w)));
    }
    static void store_i8(int8_t* p, T v) {
        const int16x4_t h = vmovn_s32(vcvtq_s32_f32(v));
        const int8x8_t b = vmovn_s16(vcombine_s16(h, h));
        const int32_t raw = vget_lane_s32(vreinterpret_s32_s8(b), 0);
        std::memcpy(p, &raw, 4);
    }
    static T pow2i(T n) {
        return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23));
    }
    static float fold16(const T* acc) {
        const float32x4_t t4 = vaddq_f32(vaddq_f32(acc[0], acc[2]), vaddq_f32(acc[1], acc[3]));
        const float32x2_t t2 = vadd_f32(vget_low_f32(t4), vget_high_f32(t4));
        return vget_lane_f32(t2, 0) + vget_lane_f32(t2, 1);
    }
    static uint32_t max_abs_bits(const float* x, int64_t n) {
        const uint32x4_t mask = vdupq_n_u32(0x7fffffffu);
        uint32x4_t m = vdupq_n_u32(0);
        int64_t i = 0;
        for (; i + 4 <= n; i += 4) m = vmaxq_u32(m, vandq_u32(vreinterpretq_u32_f32(vld1q_f32(x + i)), mask));
        uint32_t best = vmaxvq_u32(m);
        for (; i < n; ++i) {
            const uint32_t b = f32_bits(x[i]) & 0x7fffffffu;
            best = b > best ? b : best;
        }
        return best;
    }
    static float h2f(uint16_t h) { return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0); }
    static void nib32(const uint8_t* p, float* o) {
        const uint8x16_t b = vld1q_u8(p);
        const uint8x16_t lo = vandq_u8(b, vdupq_n_u8(0x0f)), hi = vshrq_n_u8(b, 4);
        const uint8x16_t e[2] = {vzip1q_u8(lo, hi), vzip2q_u8(lo, hi)};
        const float32x4_t eight = vdupq_n_f32(8.0f);
        for (int h = 0; h < 2; ++h) {
            const uint16x8_t w[2] = {vmovl_u8(vget_low_u8(e[h])), vmovl_u8(vget_high_u8(e[h]))};
            for (int j = 0; j < 4; ++j) {
                const uint16x4_t part = (j & 1) ? vget_high_u16(w[j >> 1]) : vget_low_u16(w[j >> 1]);
                vst1q_f32(o + 16 * h + 4 * j, vsubq_f32(vcvtq_f32_u32(vmovl_u16(part)), eight));
            }
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

template <class F>
inline void tile_loop(int64_t T, int64_t n0, int64_t n1, F&& f) {
    for (int64_t nb = n0; nb < n1; nb += 16) {
        const int64_t ne = nb + 16 < n1 ? nb + 16 : n1;
        int64_t t = 0;
        for (; t + 4 <= T; t += 4) {
            for (int64_t n = nb; n < ne; ++n) f(std::integral_constant<int, 4>(), t, n);
        }
        switch (T - t) {
            case 3:
                for (int64_t n = nb; n < ne; ++n) f(std::integral_constant<int, 3>(), t, n);
                break;
            case 2:
                for (int64_t n = nb; n < ne; ++n) f(std::integral_constant<int, 2>(), t, n);
                break;
            case 1:
                for (int64_t n = nb; n < ne; ++n) f(std::integral_constant<int, 1>(), t, n);
                break;
            default:
                break;
        }
    }
}

// ---- int4: prep = [K bytes: per 32-block 16 even then 16 odd x][K/32 int32 block sums]

inline bool i4_ok(const WeightView& w, int64_t ga) {
    return w.K % 32 == 0 && w.group % 32 == 0 && ga % 32 == 0;
}

void i4_prep(const WeightView&, const ActQ8& x, int64_t t0, int64_t t1) {
    const int64_t K = x.K;
    for (int64_t t = t0; t < t1; ++t) {
        const int8_t* q = x.q + t * K;
        uint8_t* base = x.prep + t * x.prep_stride;
        int32_t sums[1];
        for (int64_t b = 0; b < K / 32; ++b) {
            const int8x16x2_t v = vld2q_s8(q + 32 * b);  // val[0] = even, val[1] = odd elements
            vst1q_s8(reinterpret_cast<int8_t*>(base + 32 * b), v.val[0]);
            vst1q_s8(reinterpret_cast<int8_t*>(base + 32 * b + 16), v.val[1]);
            sums[0] = vaddlvq_s16(vaddq_s16(vpaddlq_s8(v.val[0]), vpaddlq_s8(v.val[1])));
            std::memcpy(base + K + 4 * b, sums, 4);
        }
    }
}

// Software prefetch distance of the weight streams, in rows (rows are contiguous and a
// decode step reads each once; see infer_avx512.cpp).
constexpr int64_t PF_ROWS = 8;

template <int TR, bool ASYM>
inline void i4_kernel(const WeightView& w, const ActQ8& x, int64_t t0, int64_t n, const GemmOut& out) {
    const int64_t K = w.K, gw = w.group, ga = x.group, G = K / gw, B = ga < gw ? ga : gw;
    const uint8_t* codes = static_cast<const uint8_t*>(w.codes) + n * (K / 2);
    const uint16_t* srow = w.scales_f16 + n * G;
    const uint16_t* zrow = ASYM ? w.zeros_f16 + n * G : nullptr;
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    float acc[TR];
    const uint8_t* pt[TR];
    for (int t = 0; t < TR; ++t) {
        acc[t] = 0.0f;
        pt[t] = x.prep + (t0 + t) * x.prep_stride;
    }
    for (int64_t b0 = 0; b0 < K; b0 += B) {
        int32x4_t vi[TR];
        int32_t xsum[TR];
        for (int t = 0; t < TR; ++t) {
            vi[t] = vdupq_n_s32(0);
            xsum[t] = 0;
        }
        for (int64_t e = b0; e < b0 + B; e += 32) {
            if (e % 128 == 0) __builtin_prefetch(codes + e / 2 + PF_ROWS * (K / 2));
            const uint8x16_t c = vld1q_u8(codes + e / 2);
            const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(c, m4));
            const int8x16_t hi = vreinterpretq_s8_u8(vshrq_n_u8(c, 4));
            for (int t = 0; t < TR; ++t) {
                const int8x16_t ev = vld1q_s8(reinterpret_cast<const int8_t*>(pt[t] + e));
                const int8x16_t od = vld1q_s8(reinterpret_cast<const int8_t*>(pt[t] + e + 16));
                int16x8_t p = vmull_s8(vget_low_s8(lo), vget_low_s8(ev));
                p = vmlal_high_s8(p, lo, ev);
                p = vmlal_s8(p, vget_low_s8(hi), vget_low_s8(od));
                p = vmlal_high_s8(p, hi, od);
                vi[t] = vpadalq_s16(vi[t], p);
                int32_t s;
                std::memcpy(&s, pt[t] + K + 4 * (e / 32), 4);
                xsum[t] += s;
            }
        }
        const float d = f16_to_f32(srow[b0 / gw]);
        const float m = ASYM ? f16_to_f32(zrow[b0 / gw]) : 0.0f;
        for (int t = 0; t < TR; ++t) {
            const float s = x.s[(t0 + t) * (K / ga) + b0 / ga];
            const int32_t nib_sum = vaddvq_s32(vi[t]);
            if (ASYM) {
                acc[t] = acc[t] + (s * d) * static_cast<float>(nib_sum);
                acc[t] = acc[t] + (s * m) * static_cast<float>(xsum[t]);
            } else {
                acc[t] = acc[t] + (s * d) * static_cast<float>(nib_sum - 8 * xsum[t]);
            }
        }
    }
    for (int t = 0; t < TR; ++t) out.y[(t0 + t) * out.ldy + n] = finish(acc[t], out, t0 + t, n);
}

// ---- int8: no prep --------------------------------------------------------------------

inline bool i8_ok(const WeightView& w, int64_t ga) { return w.K % 16 == 0 && ga % 16 == 0; }

template <int TR>
inline void i8_kernel(const WeightView& w, const ActQ8& x, int64_t t0, int64_t n, const GemmOut& out) {
    const int64_t K = w.K, ga = x.group, NG = K / ga;
    const int8_t* codes = static_cast<const int8_t*>(w.codes) + n * K;
    float acc[TR];
    for (int t = 0; t < TR; ++t) acc[t] = 0.0f;
    for (int64_t j = 0; j < NG; ++j) {
        int32x4_t vi[TR];
        for (int t = 0; t < TR; ++t) vi[t] = vdupq_n_s32(0);
        for (int64_t k = j * ga; k < (j + 1) * ga; k += 16) {
            if (k % 64 == 0) __builtin_prefetch(codes + k + PF_ROWS * K);
            const int8x16_t wv = vld1q_s8(codes + k);
            for (int t = 0; t < TR; ++t) {
                const int8x16_t xv = vld1q_s8(x.q + (t0 + t) * K + k);
                int16x8_t p = vmull_s8(vget_low_s8(wv), vget_low_s8(xv));
                p = vmlal_high_s8(p, wv, xv);
                vi[t] = vpadalq_s16(vi[t], p);
            }
        }
        for (int t = 0; t < TR; ++t) {
            acc[t] = acc[t] + x.s[(t0 + t) * NG + j] * static_cast<float>(vaddvq_s32(vi[t]));
        }
    }
    for (int t = 0; t < TR; ++t) {
        out.y[(t0 + t) * out.ldy + n] = finish(acc[t] * w.scales_f32[n], out, t0 + t, n);
    }
}

int64_t q8_prep_bytes(const WeightView& w, int64_t ga) {
    if (w.enc == WEnc::i8 || !i4_ok(w, ga)) return 0;
    return w.K + 4 * (w.K / 32);
}

void q8_prep(const WeightView& w, const ActQ8& x, int64_t t0, int64_t t1) {
    if (w.enc != WEnc::i8 && i4_ok(w, x.group)) i4_prep(w, x, t0, t1);
}

void q8_gemm(const WeightView& w, const ActQ8& x, int64_t n0, int64_t n1, const GemmOut& out) {
    if (w.enc == WEnc::i8) {
        if (!i8_ok(w, x.group)) return ref::q8_gemm(w, x, n0, n1, out);
        return tile_loop(x.T, n0, n1, [&](auto tr, int64_t t0, int64_t n) { i8_kernel<decltype(tr)::value>(w, x, t0, n, out); });
    }
    if (!i4_ok(w, x.group)) return ref::q8_gemm(w, x, n0, n1, out);
    if (w.enc == WEnc::i4asym) {
        return tile_loop(x.T, n0, n1, [&](auto tr, int64_t t0, int64_t n) { i4_kernel<decltype(tr)::value, true>(w, x, t0, n, out); });
    }
    return tile_loop(x.T, n0, n1, [&](auto tr, int64_t t0, int64_t n) { i4_kernel<decltype(tr)::value, false>(w, x, t0, n, out); });
}

// ---- float activations: float and int8 weights with fmla; int4 via the reference ------

template <WEnc E>
inline float32x4_t load_w4(const void* row, int64_t k) {
    if (E == WEnc::f32) return vld1q_f32(static_cast<const float*>(row) + k);
    if (E == WEnc::f16) {
        return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(static_cast<const uint16_t*>(row) + k)));
    }
    if (E == WEnc::bf16) {
        return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(static_cast<const uint16_t*>(row) + k), 16));
    }
    int32_t raw;
    std::memcpy(&raw, static_cast<const int8_t*>(row) + k, 4);
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(raw))))));
}

template <WEnc E>
inline float load_w1(const void* row, int64_t k) {
    if (E == WEnc::f32) return static_cast<const float*>(row)[k];
    if (E == WEnc::f16) return f16_to_f32(static_cast<const uint16_t*>(row)[k]);
    if (E == WEnc::bf16) return bits_f32(uint32_t{static_cast<const uint16_t*>(row)[k]} << 16);
    return static_cast<float>(static_cast<const int8_t*>(row)[k]);
}

template <int TR, WEnc E>
inline void fw_kernel(const WeightView& w, const ActF32& x, int64_t t0, int64_t n, const GemmOut& out) {
    const int64_t K = w.K;
    const int64_t esz = E == WEnc::f32 ? 4 : (E == WEnc::i8 ? 1 : 2);
    const void* row = static_cast<const uint8_t*>(w.codes) + n * K * esz;
    float32x4_t acc[TR];
    for (int t = 0; t < TR; ++t) acc[t] = vdupq_n_f32(0.0f);
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
        const float32x4_t wv = load_w4<E>(row, k);
        for (int t = 0; t < TR; ++t) acc[t] = vfmaq_f32(acc[t], vld1q_f32(x.x + (t0 + t) * K + k), wv);
    }
    for (int t = 0; t < TR; ++t) {
        float r = vaddvq_f32(acc[t]);
        for (int64_t j = k; j < K; ++j) r = r + x.x[(t0 + t) * K + j] * load_w1<E>(row, j);
        if (E == WEnc::i8) r = r * w.scales_f32[n];
        out.y[(t0 + t) * out.ldy + n] = finish(r, out, t0 + t, n);
    }
}

int64_t f32_prep_bytes(const WeightView&) { return 0; }
void f32_prep(const WeightView&, const ActF32&, int64_t, int64_t) {}

void f32_gemm(const WeightView& w, const ActF32& x, int64_t n0, int64_t n1, const GemmOut& out) {
    switch (w.enc) {
        case WEnc::f32:
            return tile_loop(x.T, n0, n1, [&](auto tr, int64_t t0, int64_t n) { fw_kernel<decltype(tr)::value, WEnc::f32>(w, x, t0, n, out); });
        case WEnc::f16:
            return tile_loop(x.T, n0, n1, [&](auto tr, int64_t t0, int64_t n) { fw_kernel<decltype(tr)::value, WEnc::f16>(w, x, t0, n, out); });
        case WEnc::bf16:
            return tile_loop(x.T, n0, n1, [&](auto tr, int64_t t0, int64_t n) { fw_kernel<decltype(tr)::value, WEnc::bf16>(w, x, t0, n, out); });
        case WEnc::i8:
            return tile_loop(x.T, n0, n1, [&](auto tr, int64_t t0, int64_t n) { fw_kernel<decltype(tr)::value, WEnc::i8>(w, x, t0, n, out); });
        case WEnc::i4sym:
        case WEnc::i4asym:
            return ref::f32_gemm(w, x, n0, n1, out);
    }
}

}  // namespace

const InferTable& neon_infer_table() {
    static const InferTable t = EDGEPACK_INFER_TABLE("neon", V4, q8_prep_bytes, q8_prep, q8_gemm,
                                                      f32_prep_bytes, f32_prep, f32_gemm);
    return t;
}

}  // namespace infer
}  // namespace edgepack

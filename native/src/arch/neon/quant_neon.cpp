// AArch64 NEON overrides.  Four lanes, round-to-nearest-even via vcvtnq, float16 through
// the portable converter (one call per group).  Same arithmetic as ref/quant_ref.cpp.
#include <arm_neon.h>

#include "../../fp16.h"
#include "../../kernels.h"

namespace edgepack {
namespace {

constexpr uint32_t kExpAll = 0x7f800000u;

inline uint32x4_t abs_bits(float32x4_t v) {
    return vandq_u32(vreinterpretq_u32_f32(v), vdupq_n_u32(0x7fffffffu));
}

inline float reciprocal(float d) { return d != 0.0f ? 1.0f / d : 0.0f; }

inline int64_t first_non_finite(const float* w, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        if ((f32_bits(w[i]) & kExpAll) == kExpAll) return i;
    }
    return -1;
}

inline Result overflow_or_non_finite(Status s, const float* row, int64_t cols, int64_t r,
                                     int64_t group) {
    const int64_t bad = first_non_finite(row, cols);
    if (bad >= 0) return {Status::non_finite, r, bad};
    return {s, r, group};
}

// clip(rint((x - m) * inv), lo, hi) as int32 (clamping first is equivalent: integer bounds).
inline int32x4_t quant4(float32x4_t x, float32x4_t m, float32x4_t inv, float32x4_t lo,
                        float32x4_t hi) {
    float32x4_t y = vmulq_f32(vsubq_f32(x, m), inv);
    y = vminq_f32(vmaxq_f32(y, lo), hi);
    return vcvtnq_s32_f32(y);
}

// Eight nibble values (two int32x4, in order) -> four packed bytes.
inline void store_nibbles8(int32x4_t a, int32x4_t b, uint8_t* out) {
    const uint16x8_t n16 = vcombine_u16(vmovn_u32(vreinterpretq_u32_s32(a)),
                                        vmovn_u32(vreinterpretq_u32_s32(b)));
    const uint16x4_t pairs = vreinterpret_u16_u8(vmovn_u16(n16));  // n_even | n_odd << 8
    const uint8x8_t packed = vmovn_u16(vcombine_u16(vorr_u16(pairs, vshr_n_u16(pairs, 4)),
                                                    vdup_n_u16(0)));
    vst1_lane_u32(reinterpret_cast<uint32_t*>(out), vreinterpret_u32_u8(packed), 0);
}

Result quantize_i8(const QuantI8Args& a) {
    const int64_t C = a.cols;
    const float32x4_t lo = vdupq_n_f32(-127.0f), hi = vdupq_n_f32(127.0f), zero = vdupq_n_f32(0.0f);
    for (int64_t r = 0; r < a.rows; ++r) {
        const float* w = a.w + r * C;
        int8_t* codes = a.codes + r * C;
        uint32x4_t vmax = vdupq_n_u32(0);
        int64_t c = 0;
        for (; c + 4 <= C; c += 4) vmax = vmaxq_u32(vmax, abs_bits(vld1q_f32(w + c)));
        uint32_t amax = vmaxvq_u32(vmax);
        for (; c < C; ++c) {
            const uint32_t b = f32_bits(w[c]) & 0x7fffffffu;
            amax = b > amax ? b : amax;
        }
        if (amax >= kExpAll) return {Status::non_finite, r, first_non_finite(w, C)};
        const float d = bits_f32(amax) / 127.0f;
        a.scales[r] = d;
        const float inv_s = reciprocal(d);
        if ((f32_bits(inv_s) & 0x7fffffffu) == kExpAll) {  // 0 * inf case: use the reference
            ref::quantize_i8_row(w, C, inv_s, codes);
            continue;
        }
        const float32x4_t inv = vdupq_n_f32(inv_s);
        c = 0;
        for (; c + 8 <= C; c += 8) {
            const int32x4_t q0 = quant4(vld1q_f32(w + c), zero, inv, lo, hi);
            const int32x4_t q1 = quant4(vld1q_f32(w + c + 4), zero, inv, lo, hi);
            const int16x8_t q16 = vcombine_s16(vmovn_s32(q0), vmovn_s32(q1));
            vst1_s8(codes + c, vmovn_s16(q16));
        }
        for (; c < C; ++c) {
            const float32x4_t q = vminq_f32(vmaxq_f32(vmulq_f32(vdupq_n_f32(w[c]), inv), lo), hi);
            codes[c] = static_cast<int8_t>(vgetq_lane_s32(vcvtnq_s32_f32(q), 0));
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
        const float32x4_t d = vdupq_n_f32(ds);
        int64_t c = 0;
        for (; c + 8 <= C; c += 8) {
            const int16x8_t s = vmovl_s8(vld1_s8(q + c));
            vst1q_f32(out + c, vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(s))), d));
            vst1q_f32(out + c + 4, vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(s))), d));
        }
        for (; c < C; ++c) out[c] = static_cast<float>(q[c]) * ds;
    }
}

inline void quant_group4(const float* x, int64_t g, float m_s, float inv_s, float lo_s, float hi_s,
                         int32_t bias, uint8_t* out) {
    const float32x4_t m = vdupq_n_f32(m_s), inv = vdupq_n_f32(inv_s);
    const float32x4_t lo = vdupq_n_f32(lo_s), hi = vdupq_n_f32(hi_s);
    const int32x4_t b = vdupq_n_s32(bias);
    for (int64_t i = 0; i < g; i += 8) {
        const int32x4_t q0 = vaddq_s32(quant4(vld1q_f32(x + i), m, inv, lo, hi), b);
        const int32x4_t q1 = vaddq_s32(quant4(vld1q_f32(x + i + 4), m, inv, lo, hi), b);
        store_nibbles8(q0, q1, out + i / 2);
    }
}

Result quantize_i4_sym(const QuantI4Args& a) {
    const int64_t C = a.cols, g = a.group, ngroups = C / g;
    for (int64_t r = 0; r < a.rows; ++r) {
        const float* w = a.w + r * C;
        for (int64_t j = 0; j < ngroups; ++j) {
            const float* x = w + j * g;
            uint32x4_t vmax = vdupq_n_u32(0);
            for (int64_t i = 0; i < g; i += 4) vmax = vmaxq_u32(vmax, abs_bits(vld1q_f32(x + i)));
            const uint32_t amax = vmaxvq_u32(vmax);
            if (amax >= kExpAll) return {Status::non_finite, r, first_non_finite(w, C)};
            int64_t peak = 0;  // first index of the largest |x| (numpy argmax)
            while ((f32_bits(x[peak]) & 0x7fffffffu) != amax) ++peak;
            const uint16_t d16 = f32_to_f16(x[peak] / -8.0f);
            if (f16_is_inf(d16)) return overflow_or_non_finite(Status::scale_overflow, w, C, r, j);
            a.scales[r * ngroups + j] = d16;
            quant_group4(x, g, 0.0f, reciprocal(f16_to_f32(d16)), -8.0f, 7.0f, 8,
                         a.codes + r * (C / 2) + j * (g / 2));
        }
    }
    return {};
}

Result quantize_i4_asym(const QuantI4Args& a) {
    const int64_t C = a.cols, g = a.group, ngroups = C / g;
    for (int64_t r = 0; r < a.rows; ++r) {
        const float* w = a.w + r * C;
        for (int64_t j = 0; j < ngroups; ++j) {
            const float* x = w + j * g;
            float32x4_t vmin = vld1q_f32(x), vmax = vmin;
            uint32x4_t vabs = abs_bits(vmin);
            for (int64_t i = 4; i < g; i += 4) {
                const float32x4_t v = vld1q_f32(x + i);
                vmin = vminq_f32(vmin, v);
                vmax = vmaxq_f32(vmax, v);
                vabs = vmaxq_u32(vabs, abs_bits(v));
            }
            if (vmaxvq_u32(vabs) >= kExpAll) return {Status::non_finite, r, first_non_finite(w, C)};
            const float mn = vminvq_f32(vmin) + 0.0f;  // canonical +0, as in codecs.py
            const float mx = vmaxvq_f32(vmax) + 0.0f;
            const uint16_t d16 = f32_to_f16((mx - mn) / 15.0f);
            const uint16_t m16 = f32_to_f16(mn);
            if (f16_is_inf(d16)) return overflow_or_non_finite(Status::scale_overflow, w, C, r, j);
            if (f16_is_inf(m16)) return overflow_or_non_finite(Status::min_overflow, w, C, r, j);
            a.scales[r * ngroups + j] = d16;
            a.mins[r * ngroups + j] = m16;
            quant_group4(x, g, f16_to_f32(m16), reciprocal(f16_to_f32(d16)), 0.0f, 15.0f, 0,
                         a.codes + r * (C / 2) + j * (g / 2));
        }
    }
    return {};
}

void dequantize_i4(const DequantI4Args& a) {
    const int64_t C = a.cols, g = a.group, ngroups = C / g;
    const bool sym = a.mins == nullptr;
    for (int64_t r = 0; r < a.rows; ++r) {
        for (int64_t j = 0; j < ngroups; ++j) {
            const uint8_t* q = a.codes + r * (C / 2) + j * (g / 2);
            float* o = a.out + r * C + j * g;
            const float32x4_t d = vdupq_n_f32(f16_to_f32(a.scales[r * ngroups + j]));
            const float32x4_t m = vdupq_n_f32(sym ? 0.0f : f16_to_f32(a.mins[r * ngroups + j]));
            for (int64_t i = 0; i < g; i += 8) {
                uint32_t raw;
                std::memcpy(&raw, q + i / 2, 4);
                const uint8x8_t c = vreinterpret_u8_u32(vdup_n_u32(raw));
                const uint8x8_t n = vzip1_u8(vand_u8(c, vdup_n_u8(0x0f)), vshr_n_u8(c, 4));
                int16x8_t s = vreinterpretq_s16_u16(vmovl_u8(n));
                if (sym) s = vsubq_s16(s, vdupq_n_s16(8));
                const float32x4_t f0 = vcvtq_f32_s32(vmovl_s16(vget_low_s16(s)));
                const float32x4_t f1 = vcvtq_f32_s32(vmovl_s16(vget_high_s16(s)));
                if (sym) {
                    vst1q_f32(o + i, vmulq_f32(f0, d));
                    vst1q_f32(o + i + 4, vmulq_f32(f1, d));
                } else {
                    vst1q_f32(o + i, vaddq_f32(vmulq_f32(f0, d), m));
                    vst1q_f32(o + i + 4, vaddq_f32(vmulq_f32(f1, d), m));
                }
            }
        }
    }
}

}  // namespace

const KernelTable& neon_table() {
    static const KernelTable t = {
        "neon", 20, quantize_i8, dequantize_i8, quantize_i4_sym, quantize_i4_asym, dequantize_i4,
    };
    return t;
}

}  // namespace edgepack

// Portable reference kernels: a line-by-line transcription of edgepack/format/codecs.py.
// Compiled without any ISA flags and with -ffp-contract=off, so it is the ground truth
// that every arch/<isa>/ override is tested against.
#include "../fp16.h"
#include "../kernels.h"

namespace edgepack {
namespace {

constexpr uint32_t kExpMask = 0x7f800000u;

inline bool finite_f(float v) { return (f32_bits(v) & kExpMask) != kExpMask; }

inline float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

inline float reciprocal(float d) { return d != 0.0f ? 1.0f / d : 0.0f; }

// clip(rint(x), lo, hi) with round-half-to-even.  Clamping first is equivalent (integer
// bounds, rint is monotonic) and bounds |x| < 2^22, where adding and subtracting 1.5 * 2^23
// rounds exactly to nearest even (the ggml nearest_int trick) without a libm call.
// x must not be NaN.
inline float round_clip(float x, float lo, float hi) {
    const float magic = 12582912.0f;  // 1.5 * 2^23
    return (clampf(x, lo, hi) + magic) - magic;
}

// Largest |x| as float bits over x[0, n); >= kExpMask means a NaN or Inf is present.
// Integer max on the bits of |x| orders like the floats and vectorizes (no fast-math).
inline uint32_t max_abs_bits(const float* x, int64_t n) {
    uint32_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
        const uint32_t b = f32_bits(x[i]) & 0x7fffffffu;
        m = b > m ? b : m;
    }
    return m;
}

// Index of the first non-finite value in w[0, n), or -1.
inline int64_t first_non_finite(const float* w, int64_t n) {
    if (max_abs_bits(w, n) < kExpMask) return -1;
    for (int64_t i = 0; i < n; ++i) {
        if (!finite_f(w[i])) return i;
    }
    return -1;
}

// min and max of x[0, g), g a multiple of 8.  Four independent accumulators only change
// which of -0/+0 is returned, and callers canonicalise zeros anyway.
inline void min_max(const float* x, int64_t g, float& lo_out, float& hi_out) {
    float lo[4] = {x[0], x[1], x[2], x[3]};
    float hi[4] = {x[0], x[1], x[2], x[3]};
    for (int64_t i = 4; i < g; i += 4) {
        for (int k = 0; k < 4; ++k) {
            lo[k] = x[i + k] < lo[k] ? x[i + k] : lo[k];
            hi[k] = x[i + k] > hi[k] ? x[i + k] : hi[k];
        }
    }
    const float l01 = lo[0] < lo[1] ? lo[0] : lo[1], l23 = lo[2] < lo[3] ? lo[2] : lo[3];
    const float h01 = hi[0] > hi[1] ? hi[0] : hi[1], h23 = hi[2] > hi[3] ? hi[2] : hi[3];
    lo_out = l01 < l23 ? l01 : l23;
    hi_out = h01 > h23 ? h01 : h23;
}

}  // namespace

namespace ref {

void quantize_i8_row(const float* w, int64_t cols, float inv, int8_t* codes) {
    if (inv - inv != 0.0f) {  // inv is inf: 0 * inf is NaN, and a zero weight encodes as 0
        for (int64_t c = 0; c < cols; ++c) {
            const float x = w[c] * inv;
            codes[c] = static_cast<int8_t>(x != x ? 0.0f : round_clip(x, -127.0f, 127.0f));
        }
        return;
    }
    for (int64_t c = 0; c < cols; ++c) {
        codes[c] = static_cast<int8_t>(static_cast<int32_t>(round_clip(w[c] * inv, -127.0f, 127.0f)));
    }
}

Result quantize_i8(const QuantI8Args& a) {
    for (int64_t r = 0; r < a.rows; ++r) {
        const float* w = a.w + r * a.cols;
        const int64_t bad = first_non_finite(w, a.cols);
        if (bad >= 0) return {Status::non_finite, r, bad};
        const float amax = bits_f32(max_abs_bits(w, a.cols));  // max |w|, exact
        const float d = amax / 127.0f;
        a.scales[r] = d;
        quantize_i8_row(w, a.cols, reciprocal(d), a.codes + r * a.cols);
    }
    return {};
}

void dequantize_i8(const DequantI8Args& a) {
    for (int64_t r = 0; r < a.rows; ++r) {
        const float d = a.scales[r];
        const int8_t* q = a.codes + r * a.cols;
        float* out = a.out + r * a.cols;
        for (int64_t c = 0; c < a.cols; ++c) out[c] = static_cast<float>(q[c]) * d;
    }
}

Result quantize_i4_sym(const QuantI4Args& a) {
    const int64_t ngroups = a.cols / a.group;
    for (int64_t r = 0; r < a.rows; ++r) {
        const float* w = a.w + r * a.cols;
        const int64_t bad = first_non_finite(w, a.cols);
        if (bad >= 0) return {Status::non_finite, r, bad};
        uint8_t* codes = a.codes + r * (a.cols / 2);
        for (int64_t j = 0; j < ngroups; ++j) {
            const float* x = w + j * a.group;
            const uint32_t amax = max_abs_bits(x, a.group);
            int64_t peak = 0;  // first index of the largest |w| (numpy argmax)
            while ((f32_bits(x[peak]) & 0x7fffffffu) != amax) ++peak;
            const uint16_t d16 = f32_to_f16(x[peak] / -8.0f);
            if (f16_is_inf(d16)) return {Status::scale_overflow, r, j};
            a.scales[r * ngroups + j] = d16;
            const float inv = reciprocal(f16_to_f32(d16));
            uint8_t* out = codes + j * a.group / 2;
            for (int64_t i = 0; i < a.group; i += 2) {
                const float q0 = round_clip(x[i] * inv, -8.0f, 7.0f) + 8.0f;
                const float q1 = round_clip(x[i + 1] * inv, -8.0f, 7.0f) + 8.0f;
                out[i / 2] = static_cast<uint8_t>(static_cast<unsigned>(q0) |
                                                  (static_cast<unsigned>(q1) << 4));
            }
        }
    }
    return {};
}

Result quantize_i4_asym(const QuantI4Args& a) {
    const int64_t ngroups = a.cols / a.group;
    for (int64_t r = 0; r < a.rows; ++r) {
        const float* w = a.w + r * a.cols;
        const int64_t bad = first_non_finite(w, a.cols);
        if (bad >= 0) return {Status::non_finite, r, bad};
        uint8_t* codes = a.codes + r * (a.cols / 2);
        for (int64_t j = 0; j < ngroups; ++j) {
            const float* x = w + j * a.group;
            float lo, hi;
            min_max(x, a.group, lo, hi);
            lo = lo + 0.0f;  // canonical +0, as in codecs.py
            hi = hi + 0.0f;
            const uint16_t d16 = f32_to_f16((hi - lo) / 15.0f);
            const uint16_t m16 = f32_to_f16(lo);
            if (f16_is_inf(d16)) return {Status::scale_overflow, r, j};
            if (f16_is_inf(m16)) return {Status::min_overflow, r, j};
            a.scales[r * ngroups + j] = d16;
            a.mins[r * ngroups + j] = m16;
            const float inv = reciprocal(f16_to_f32(d16));
            const float m = f16_to_f32(m16);
            uint8_t* out = codes + j * a.group / 2;
            for (int64_t i = 0; i < a.group; i += 2) {
                const float q0 = round_clip((x[i] - m) * inv, 0.0f, 15.0f);
                const float q1 = round_clip((x[i + 1] - m) * inv, 0.0f, 15.0f);
                out[i / 2] = static_cast<uint8_t>(static_cast<unsigned>(q0) |
                                                  (static_cast<unsigned>(q1) << 4));
            }
        }
    }
    return {};
}

void dequantize_i4(const DequantI4Args& a) {
    const int64_t ngroups = a.cols / a.group;
    for (int64_t r = 0; r < a.rows; ++r) {
        const uint8_t* codes = a.codes + r * (a.cols / 2);
        float* out = a.out + r * a.cols;
        for (int64_t j = 0; j < ngroups; ++j) {
            const float d = f16_to_f32(a.scales[r * ngroups + j]);
            const uint8_t* q = codes + j * a.group / 2;
            float* o = out + j * a.group;
            if (a.mins == nullptr) {
                for (int64_t i = 0; i < a.group / 2; ++i) {
                    o[2 * i] = static_cast<float>((q[i] & 0x0f) - 8) * d;
                    o[2 * i + 1] = static_cast<float>((q[i] >> 4) - 8) * d;
                }
            } else {
                const float m = f16_to_f32(a.mins[r * ngroups + j]);
                for (int64_t i = 0; i < a.group / 2; ++i) {
                    const float p0 = static_cast<float>(q[i] & 0x0f) * d;
                    const float p1 = static_cast<float>(q[i] >> 4) * d;
                    o[2 * i] = p0 + m;
                    o[2 * i + 1] = p1 + m;
                }
            }
        }
    }
}

}  // namespace ref

const KernelTable& scalar_table() {
    static const KernelTable t = {
        "scalar", 0, ref::quantize_i8, ref::dequantize_i8, ref::quantize_i4_sym,
        ref::quantize_i4_asym, ref::dequantize_i4,
    };
    return t;
}

}  // namespace edgepack

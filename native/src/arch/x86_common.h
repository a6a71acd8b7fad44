// Helpers shared by the x86 overrides.  Everything is `static inline` so each ISA
// translation unit gets its own copy compiled with its own flags.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "../fp16.h"
#include "../kernels.h"

namespace edgepack {
namespace x86 {

constexpr int32_t kAbsMask = 0x7fffffff;
constexpr int32_t kExpAll = 0x7f800000;  // abs bits >= this: inf or NaN

// Scalar round-half-to-even that ignores MXCSR, matching the vector paths.
static inline float rint_ss(float x) {
    return _mm_cvtss_f32(
        _mm_round_ss(_mm_setzero_ps(), _mm_set_ss(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

static inline float clamp_ss(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

static inline float reciprocal(float d) { return d != 0.0f ? 1.0f / d : 0.0f; }

static inline bool is_inf_f(float v) { return (f32_bits(v) & 0x7fffffffu) == 0x7f800000u; }

// F16C conversion: round to nearest even, identical to the portable f32_to_f16.
static inline uint16_t to_f16(float v) {
    return static_cast<uint16_t>(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
}

static inline float from_f16(uint16_t h) { return _cvtsh_ss(h); }

static inline int64_t first_non_finite(const float* w, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        if ((f32_bits(w[i]) & 0x7f800000u) == 0x7f800000u) return i;
    }
    return -1;
}

// Non-finite values win over a float16 overflow found later in the same row, matching the
// reference, which checks the whole row before quantizing it.
static inline Result overflow_or_non_finite(Status s, const float* row, int64_t cols, int64_t r,
                                            int64_t group) {
    const int64_t bad = first_non_finite(row, cols);
    if (bad >= 0) return {Status::non_finite, r, bad};
    return {s, r, group};
}

static inline void store4(uint8_t* dst, __m128i v) {
    const int32_t x = _mm_cvtsi128_si32(v);
    std::memcpy(dst, &x, 4);
}

}  // namespace x86
}  // namespace edgepack

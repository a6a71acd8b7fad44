// Portable IEEE binary16 <-> binary32 conversion, round-to-nearest-even, bit-identical to
// numpy's astype (overflow -> inf, gradual underflow to subnormals, NaN stays NaN).
// Functions are `static inline` so each translation unit (compiled for a different ISA)
// keeps its own copy: no vague-linkage symbol can leak AVX code into the scalar path.
#pragma once

#include <cstdint>
#include <cstring>

namespace edgepack {

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_f32(uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_f16(float f) {
    const uint32_t x = f32_bits(f);
    const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) {  // inf or NaN (keep NaN quiet and non-zero)
        return static_cast<uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x0200u | ((ax >> 13) & 0x3ffu) : 0u));
    }
    if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
    if (ax >= 0x38800000u) {  // normal half: add the rounding bias, then rebias 127 -> 15
        const uint32_t r = ax + 0x0fffu + ((ax >> 13) & 1u);
        return static_cast<uint16_t>(sign | ((r - 0x38000000u) >> 13));
    }
    if (ax <= 0x33000000u) return sign;  // <= 2^-25: ties to even -> zero
    // Subnormal half: value = k * 2^-24 with k = mant * 2^(e - 126).
    const uint32_t e = ax >> 23;
    const uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14..24
    uint32_t k = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (k & 1u))) ++k;
    return static_cast<uint16_t>(sign | k);
}

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t mant = h & 0x3ffu;
    if (exp == 0x1fu) return bits_f32(sign | 0x7f800000u | (mant << 13));
    if (exp != 0) return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
    if (mant == 0) return bits_f32(sign);
    // Subnormal: mant * 2^-24 is exact in float32.
    const float v = static_cast<float>(mant) * bits_f32(0x33800000u);  // 2^-24
    return sign ? -v : v;
}

static inline bool f16_is_inf(uint16_t h) { return (h & 0x7fffu) == 0x7c00u; }

}  // namespace edgepack

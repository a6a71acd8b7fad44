// Elementwise, normalization, RoPE and attention kernels written once against a small
// SIMD wrapper `V` (ggml's GGML_F32_VEC idea) and instantiated in every ISA translation
// unit: ref_infer.cpp with the scalar wrapper VS below, arch/<isa>/infer_<isa>.cpp with
// their own.  Include this header from exactly one .cpp per ISA, after defining V: all
// code sits in an anonymous namespace, so every TU keeps its own copy compiled with its
// own flags (no inline symbol can carry AVX-512 code into the portable path).
//
// Bit-exactness across ISAs (see infer.h) follows from three rules kept here:
//   1. elementwise math is one fixed sequence of IEEE mul/add/sub/div/sqrt (never fused:
//      the build uses -ffp-contract=off and no FMA intrinsic appears below);
//   2. float sums use 16 canonical lanes (element k -> lane k % 16) folded 16->8->4->2->1;
//   3. max/min are `a > b ? a : b` / `a < b ? a : b` on every ISA, and the abs-max of a
//      quantization group is an integer max over |x| bits (exact, order-free, NaN-aware).
//
// Required from V (T = its vector type of W floats, W in {1, 4, 8, 16}):
//   load store set1 zero add sub mul div max min round(nearest-even)
//   load_i8(const int8_t*)           W int8 -> float
//   store_i8(int8_t*, T)             T holds integers in [-127, 127]
//   pow2i(T n)                       2^n for integral n in [-126, 127]
//   fold16(const T* acc)             canonical fold of the 16 lanes held in acc[16 / W]
//   fold16x16(const T (&a)[16])      (W = 16 only) lane p = fold16(&a[p])
//   v6_codes16(nb, hb)               (W = 16 only) float(code) of 16 int6 V elements
//   butterfly16(T x, int h)          (W = 16 only) one Hadamard stage h < 16 in the lanes
//   max_abs_bits(const float*, n)    max over |x| float bits as uint32
//   nib32(const uint8_t* p, float* o)  o[i] = float(nib_i) - 8 for the 32 nibbles of p[0, 16)
//   h2f(uint16_t)                    float16 bits -> float (exact)
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "../fp16.h"
#include "infer.h"

namespace edgepack {
namespace infer {
namespace {

constexpr uint32_t kNonFinite = 0x7f800000u;  // |x| bits >= this: Inf or NaN

// ---- the scalar wrapper: reference semantics, also used for every vector tail ----------
struct VS {
    static constexpr int W = 1;
    using T = float;
    static T load(const float* p) { return *p; }
    static void store(float* p, T v) { *p = v; }
    static T set1(float v) { return v; }
    static T zero() { return 0.0f; }
    static T add(T a, T b) { return a + b; }
    static T sub(T a, T b) { return a - b; }
    static T mul(T a, T b) { return a * b; }
    static T div(T a, T b) { return a / b; }
    static T max(T a, T b) { return a > b ? a : b; }
    static T min(T a, T b) { return a < b ? a : b; }
    // Nearest-even for |v| < 2^22 (all callers bound v first): the ggml magic-number trick.
    static T round(T v) { return (v + 12582912.0f) - 12582912.0f; }
    static T load_i8(const int8_t* p) { return static_cast<float>(*p); }
    static void store_i8(int8_t* p, T v) { *p = static_cast<int8_t>(static_cast<int32_t>(v)); }
    static T pow2i(T n) { return bits_f32(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23); }
    static float fold16(const T* acc) {
        float l[16];
        for (int i = 0; i < 16; ++i) l[i] = acc[i];
        for (int h = 8; h >= 1; h >>= 1) {
            for (int i = 0; i < h; ++i) l[i] = l[i] + l[i + h];
        }
        return l[0];
    }
    static uint32_t max_abs_bits(const float* x, int64_t n) {
        uint32_t m = 0;
        for (int64_t i = 0; i < n; ++i) {
            const uint32_t b = f32_bits(x[i]) & 0x7fffffffu;
            m = b > m ? b : m;
        }
        return m;
    }
    static float h2f(uint16_t h) { return f16_to_f32(h); }
    static void nib32(const uint8_t* p, float* o) {
        for (int i = 0; i < 16; ++i) {
            o[2 * i] = static_cast<float>(p[i] & 0x0f) - 8.0f;
            o[2 * i + 1] = static_cast<float>(p[i] >> 4) - 8.0f;
        }
    }
};

// ---- vector math ------------------------------------------------------------------------
// exp(x) for finite x: Cephes expf (range reduction with a split ln 2, degree-6
// polynomial), about 2 ulp.  x is clamped to [-87.3, 88] so 2^n stays a normal float; NaN
// inputs give an unspecified finite value (callers make NaN propagate through other
// operands).
template <class V>
inline typename V::T exp_v(typename V::T x) {
    using T = typename V::T;
    x = V::min(V::max(x, V::set1(-87.33f)), V::set1(88.0f));
    const T n = V::round(V::mul(x, V::set1(1.44269504088896341f)));
    T r = V::sub(x, V::mul(n, V::set1(0.693359375f)));
    r = V::sub(r, V::mul(n, V::set1(-2.12194440e-4f)));
    T p = V::set1(1.9875691500e-4f);
    p = V::add(V::mul(p, r), V::set1(1.3981999507e-3f));
    p = V::add(V::mul(p, r), V::set1(8.3334519073e-3f));
    p = V::add(V::mul(p, r), V::set1(4.1665795894e-2f));
    p = V::add(V::mul(p, r), V::set1(1.6666665459e-1f));
    p = V::add(V::mul(p, r), V::set1(5.0000001201e-1f));
    p = V::add(V::add(V::mul(p, V::mul(r, r)), r), V::set1(1.0f));
    return V::mul(p, V::pow2i(n));
}

// silu(g) * u = g / (1 + exp(-g)) * u.  NaN in g or u propagates.
template <class V>
inline typename V::T swiglu_v(typename V::T g, typename V::T u) {
    const typename V::T e = exp_v<V>(V::sub(V::zero(), g));
    return V::mul(V::div(g, V::add(V::set1(1.0f), e)), u);
}

// Canonical 16-lane dot product of a[0, n) and b[0, n) (b converted by Load).
template <class V, class B, class LoadB>
inline float dot16(const float* a, const B* b, int64_t n, LoadB load_b) {
    constexpr int NA = 16 / V::W;
    typename V::T acc[NA];
    for (int j = 0; j < NA; ++j) acc[j] = V::zero();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        for (int j = 0; j < NA; ++j) {
            acc[j] = V::add(acc[j], V::mul(V::load(a + i + j * V::W), load_b(b + i + j * V::W)));
        }
    }
    if (i == n) return V::fold16(acc);
    float lanes[16];
    for (int j = 0; j < NA; ++j) V::store(lanes + j * V::W, acc[j]);
    for (int64_t k = i; k < n; ++k) lanes[k - i] = lanes[k - i] + a[k] * static_cast<float>(b[k]);
    return VS::fold16(lanes);
}

// Canonical 16-lane sum of x[0, n): element k in lane k % 16, folded like dot16.
template <class V>
inline float sum16(const float* x, int64_t n) {
    constexpr int NA = 16 / V::W;
    typename V::T acc[NA];
    for (int j = 0; j < NA; ++j) acc[j] = V::zero();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        for (int j = 0; j < NA; ++j) acc[j] = V::add(acc[j], V::load(x + i + j * V::W));
    }
    if (i == n) return V::fold16(acc);
    float lanes[16];
    for (int j = 0; j < NA; ++j) V::store(lanes + j * V::W, acc[j]);
    for (int64_t k = i; k < n; ++k) lanes[k - i] = lanes[k - i] + x[k];
    return VS::fold16(lanes);
}

// ---- activation quantization ------------------------------------------------------------
// Quantize x[0, n) with one scale, as edgepack.format.codecs.quantize_int8_channel does:
// d = amax / 127, inv = 1/d (0 if d == 0), q = clip(rint(x * inv), -127, 127), except that
// 0 * inf (inv overflowing for a subnormal d) is defined as 0.  False on NaN/Inf.
template <class V>
inline void quant_with(const float* x, int64_t n, float d, int8_t* q);

template <class V>
inline bool quant_group(const float* x, int64_t n, int8_t* q, float* s) {
    const uint32_t bits = V::max_abs_bits(x, n);
    if (bits >= kNonFinite) return false;
    const float d = bits_f32(bits) / 127.0f;
    *s = d;
    quant_with<V>(x, n, d, q);
    return true;
}

// q = clip(rint(x * (1/d)), -127, 127) for a given scale d (finite x).
template <class V>
inline void quant_with(const float* x, int64_t n, float d, int8_t* q) {
    const float inv = d != 0.0f ? 1.0f / d : 0.0f;
    if ((f32_bits(inv) & 0x7fffffffu) == kNonFinite) {
        for (int64_t i = 0; i < n; ++i) {
            const float y = x[i] * inv;
            q[i] = y != y ? int8_t{0} : static_cast<int8_t>(y > 0 ? 127 : -127);
            if (x[i] == 0.0f) q[i] = 0;
        }
        return;
    }
    const typename V::T vi = V::set1(inv), lo = V::set1(-127.0f), hi = V::set1(127.0f);
    int64_t i = 0;
    for (; i + V::W <= n; i += V::W) {
        const typename V::T y = V::min(V::max(V::mul(V::load(x + i), vi), lo), hi);
        V::store_i8(q + i, V::round(y));
    }
    for (; i < n; ++i) VS::store_i8(q + i, VS::round(VS::min(VS::max(x[i] * inv, -127.0f), 127.0f)));
}

inline int64_t first_bad(const float* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        if ((f32_bits(x[i]) & kNonFinite) == kNonFinite) return i;
    }
    return 0;
}

template <class V>
Result quant_act_row(const float* x, int64_t K, int64_t group, int8_t* q, float* s) {
    for (int64_t g0 = 0, j = 0; g0 < K; g0 += group, ++j) {
        if (!quant_group<V>(x + g0, group, q + g0, s + j)) {
            return {Status::non_finite, 0, g0 + first_bad(x + g0, group)};
        }
    }
    return {};
}

// Quantize values produced on the fly by make(i0, i1, buf) (buf[0, i1 - i0) = y[i0, i1)),
// group by group.  Groups that fit the stack buffer are produced once; larger groups are
// produced twice (abs-max pass, then quantize pass): elementwise, so identical both times.
constexpr int64_t kQuantBuf = 4096;

template <class V, class Make>
inline Result quant_made(int64_t K, int64_t group, int8_t* q, float* s, Make make) {
    alignas(64) float buf[kQuantBuf];
    for (int64_t g0 = 0, j = 0; g0 < K; g0 += group, ++j) {
        if (group <= kQuantBuf) {
            make(g0, g0 + group, buf);
            if (!quant_group<V>(buf, group, q + g0, s + j)) {
                return {Status::non_finite, 0, g0 + first_bad(buf, group)};
            }
            continue;
        }
        uint32_t bits = 0;
        for (int64_t c = g0; c < g0 + group; c += kQuantBuf) {
            const int64_t n = c + kQuantBuf < g0 + group ? kQuantBuf : g0 + group - c;
            make(c, c + n, buf);
            const uint32_t b = V::max_abs_bits(buf, n);
            if (b >= kNonFinite) return {Status::non_finite, 0, c + first_bad(buf, n)};
            bits = b > bits ? b : bits;
        }
        const float d = bits_f32(bits) / 127.0f;
        const float inv = d != 0.0f ? 1.0f / d : 0.0f;
        s[j] = d;
        const typename V::T vi = V::set1(inv), lo = V::set1(-127.0f), hi = V::set1(127.0f);
        const bool inf_inv = (f32_bits(inv) & 0x7fffffffu) == kNonFinite;
        for (int64_t c = g0; c < g0 + group; c += kQuantBuf) {
            const int64_t n = c + kQuantBuf < g0 + group ? kQuantBuf : g0 + group - c;
            make(c, c + n, buf);
            int64_t i = 0;
            if (!inf_inv) {
                for (; i + V::W <= n; i += V::W) {
                    const typename V::T y = V::min(V::max(V::mul(V::load(buf + i), vi), lo), hi);
                    V::store_i8(q + c + i, V::round(y));
                }
            }
            for (; i < n; ++i) {
                const float y = buf[i] * inv;
                if (inf_inv) {
                    q[c + i] = (y != y || buf[i] == 0.0f) ? int8_t{0}
                                                          : static_cast<int8_t>(y > 0 ? 127 : -127);
                } else {
                    VS::store_i8(q + c + i, VS::round(VS::min(VS::max(y, -127.0f), 127.0f)));
                }
            }
        }
    }
    return {};
}

// ---- RMSNorm ----------------------------------------------------------------------------
// r = 1 / sqrt(sum(x^2) / K + eps) (canonical 16-lane sum); y = (x * r) * w.
template <class V>
inline float rms_factor(const float* x, int64_t K, float eps) {
    const float ss = dot16<V>(x, x, K, [](const float* p) { return V::load(p); });
    return 1.0f / std::sqrt(ss / static_cast<float>(K) + eps);
}

template <class V>
inline void rms_apply(const float* x, const float* w, float r, int64_t i0, int64_t i1, float* y) {
    const typename V::T vr = V::set1(r);
    int64_t i = i0;
    for (; i + V::W <= i1; i += V::W) {
        V::store(y + (i - i0), V::mul(V::mul(V::load(x + i), vr), V::load(w + i)));
    }
    for (; i < i1; ++i) y[i - i0] = (x[i] * r) * w[i];
}

template <class V>
void rmsnorm_row(const float* x, const float* w, int64_t K, float eps, float* y) {
    rms_apply<V>(x, w, rms_factor<V>(x, K, eps), 0, K, y);
}

template <class V>
Result rmsnorm_quant_row(const float* x, const float* w, int64_t K, float eps, int64_t group,
                         int8_t* q, float* s) {
    const float r = rms_factor<V>(x, K, eps);
    return quant_made<V>(K, group, q, s, [&](int64_t i0, int64_t i1, float* buf) {
        rms_apply<V>(x, w, r, i0, i1, buf);
    });
}

// ---- SwiGLU -----------------------------------------------------------------------------
template <class V>
inline void swiglu_apply(const float* g, const float* u, int64_t i0, int64_t i1, float* y) {
    int64_t i = i0;
    for (; i + V::W <= i1; i += V::W) V::store(y + (i - i0), swiglu_v<V>(V::load(g + i), V::load(u + i)));
    for (; i < i1; ++i) y[i - i0] = swiglu_v<VS>(g[i], u[i]);
}

template <class V>
void swiglu_row(const float* g, const float* u, int64_t F, float* y) {
    swiglu_apply<V>(g, u, 0, F, y);
}

template <class V>
Result swiglu_quant_row(const float* g, const float* u, int64_t F, int64_t group, int8_t* q,
                        float* s) {
    return quant_made<V>(F, group, q, s, [&](int64_t i0, int64_t i1, float* buf) {
        swiglu_apply<V>(g, u, i0, i1, buf);
    });
}

// ---- RoPE (NeoX / rotate-half) ------------------------------------------------------------
// For i < D/2: y[i] = x[i] c - x[i + D/2] s; y[i + D/2] = x[i + D/2] c + x[i] s.
template <class V>
void rope_row(float* x, int64_t H, int64_t D, int64_t hstride, const float* cs, const float* sn) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < H; ++h) {
        float* a = x + h * hstride;
        float* b = a + half;
        int64_t i = 0;
        for (; i + V::W <= half; i += V::W) {
            const typename V::T x1 = V::load(a + i), x2 = V::load(b + i);
            const typename V::T c = V::load(cs + i), s = V::load(sn + i);
            V::store(a + i, V::sub(V::mul(x1, c), V::mul(x2, s)));
            V::store(b + i, V::add(V::mul(x2, c), V::mul(x1, s)));
        }
        for (; i < half; ++i) {
            const float x1 = a[i], x2 = b[i];
            a[i] = x1 * cs[i] - x2 * sn[i];
            b[i] = x2 * cs[i] + x1 * sn[i];
        }
    }
}

// ---- KV cache ---------------------------------------------------------------------------
// V group of n elements (n = kv.v_group, a multiple of 8): d = peak / -8 (+0, so an
// all-zero group gets +0) with peak the first element of largest |v| (codecs int4 sym),
// rounded to float16 when the scale pool is float16; nib = clip(rint(v * (1/d)), -8, 7) + 8.
inline int v_peak(const float* v, int64_t n) {
    uint32_t m = 0;
    int peak = 0;
    for (int i = 0; i < n; ++i) {
        const uint32_t b = f32_bits(v[i]) & 0x7fffffffu;
        if (b > m) {
            m = b;
            peak = i;
        }
    }
    return peak;
}

inline bool quant_v_group(const float* v, int64_t n, uint8_t* out, float* d_out, uint16_t* d16_out) {
    float d = v[v_peak(v, n)] / -8.0f + 0.0f;  // + 0 turns -0 (an all-zero group) into +0
    if (d16_out != nullptr) {
        const uint16_t h = f32_to_f16(d);
        if (f16_is_inf(h)) return false;
        *d16_out = h;
        d = f16_to_f32(h);
    } else {
        *d_out = d;
    }
    const float inv = d != 0.0f ? 1.0f / d : 0.0f;
    const bool inf_inv = (f32_bits(inv) & 0x7fffffffu) == kNonFinite;
    for (int64_t i = 0; i < n / 2; ++i) {
        int32_t q[2];
        for (int k = 0; k < 2; ++k) {
            const float y = v[2 * i + k] * inv;
            float c;
            if (inf_inv && (y != y || v[2 * i + k] == 0.0f)) {
                c = 0.0f;
            } else {
                c = VS::round(VS::min(VS::max(y, -8.0f), 7.0f));
            }
            q[k] = static_cast<int32_t>(c) + 8;
        }
        out[i] = static_cast<uint8_t>(q[0] | (q[1] << 4));
    }
    return true;
}

// Layouts "int8" / "int8-v5" (v5): K scale d = f16(amax / 127) (then q as quant_with); V
// group of n: m = f16(min), d = f16((max - m) / 31), c = clip(rint((v - m) * (1/d)), 0, 31)
// (1/d = 0 when d == 0), low nibble of c in the nibble plane, bit 4 in the bit plane.
inline float k16_scale_f32(const float* k, int64_t D) { return bits_f32(VS::max_abs_bits(k, D)) / 127.0f; }

inline void v5_group_range(const float* v, int64_t n, float* lo, float* hi) {
    float a = v[0], b = v[0];
    for (int64_t i = 1; i < n; ++i) {
        a = v[i] < a ? v[i] : a;
        b = v[i] > b ? v[i] : b;
    }
    *lo = a;
    *hi = b;
}

// True when a float16 K scale or V5 scale / min of this token and head would overflow.
inline bool v5_overflows(const float* k, const float* v, int64_t D, int64_t n) {
    if (f16_is_inf(f32_to_f16(k16_scale_f32(k, D)))) return true;
    for (int64_t g = 0; g < D / n; ++g) {
        float lo, hi;
        v5_group_range(v + g * n, n, &lo, &hi);
        const uint16_t m16 = f32_to_f16(lo);
        if (f16_is_inf(m16) || f16_is_inf(f32_to_f16((hi - f16_to_f32(m16)) / 31.0f))) return true;
    }
    return false;
}

inline void quant_v5_group(const float* v, int64_t n, uint8_t* nib, uint8_t* high, uint16_t* d16, uint16_t* m16) {
    float lo, hi;
    v5_group_range(v, n, &lo, &hi);
    *m16 = f32_to_f16(lo);
    const float m = f16_to_f32(*m16);
    *d16 = f32_to_f16((hi - m) / 31.0f);
    const float d = f16_to_f32(*d16);
    const float inv = d != 0.0f ? 1.0f / d : 0.0f;
    for (int64_t i0 = 0; i0 < n; i0 += 8) {
        uint8_t c[8];
        for (int i = 0; i < 8; ++i) {
            c[i] = static_cast<uint8_t>(VS::round(VS::min(VS::max((v[i0 + i] - m) * inv, 0.0f), 31.0f)));
        }
        uint8_t b = 0;
        for (int i = 0; i < 4; ++i) nib[i0 / 2 + i] = static_cast<uint8_t>((c[2 * i] & 15) | ((c[2 * i + 1] & 15) << 4));
        for (int i = 0; i < 8; ++i) b = static_cast<uint8_t>(b | ((c[i] >> 4) << i));
        high[i0 / 8] = b;
    }
}

// Layout "int8" (v6): V int6 symmetric per group of n: d = f16(absmax / 31) rounded up to
// 8 bits (e5m3: the top byte of the float16's magnitude bits; 248 and above: overflow),
// c = clip(rint(v * (1/d)), -31, 31) + 32, low nibble in the nibble plane, bits 4-5 in the
// high plane (element i: bits 2 (i % 4) and 2 (i % 4) + 1 of byte i / 4).
constexpr uint32_t kV6ScaleOverflow = 248;

inline uint32_t v6_scale_code(const float* v, int64_t n) {
    return (static_cast<uint32_t>(f32_to_f16(bits_f32(VS::max_abs_bits(v, n)) / 31.0f)) + 127u) >> 7;
}

inline float v6_scale(uint8_t b) { return f16_to_f32(static_cast<uint16_t>(static_cast<uint32_t>(b) << 7)); }

inline void quant_v6_group(const float* v, int64_t n, uint8_t* nib, uint8_t* high, uint8_t* sb) {
    *sb = static_cast<uint8_t>(v6_scale_code(v, n));
    const float d = v6_scale(*sb);
    const float inv = d != 0.0f ? 1.0f / d : 0.0f;
    for (int64_t i0 = 0; i0 < n; i0 += 4) {
        uint32_t c[4];
        for (int i = 0; i < 4; ++i) {
            c[i] = static_cast<uint32_t>(static_cast<int32_t>(VS::round(VS::min(VS::max(v[i0 + i] * inv, -31.0f), 31.0f))) + 32);
        }
        nib[i0 / 2] = static_cast<uint8_t>((c[0] & 15u) | ((c[1] & 15u) << 4));
        nib[i0 / 2 + 1] = static_cast<uint8_t>((c[2] & 15u) | ((c[3] & 15u) << 4));
        high[i0 / 4] = static_cast<uint8_t>((c[0] >> 4) | ((c[1] >> 4) << 2) | ((c[2] >> 4) << 4) | ((c[3] >> 4) << 6));
    }
}

// True when the float16 K scale or a v6 V scale of this token and head would overflow.
inline bool v6_overflows(const float* k, const float* v, int64_t D, int64_t n) {
    if (f16_is_inf(f32_to_f16(k16_scale_f32(k, D)))) return true;
    for (int64_t g = 0; g < D / n; ++g) {
        if (v6_scale_code(v + g * n, n) >= kV6ScaleOverflow) return true;
    }
    return false;
}

// V scale i and K scale idx as float (float16 through V::h2f: hardware where the ISA has it).
template <class V = VS>
inline float v_scale_at(const KvCache& kv, int64_t i) {
    if (kv.v6) return V::h2f(static_cast<uint16_t>(static_cast<uint32_t>(static_cast<const uint8_t*>(kv.v_scale)[i]) << 7));
    return kv.v_scale_f16 ? V::h2f(static_cast<const uint16_t*>(kv.v_scale)[i])
                          : static_cast<const float*>(kv.v_scale)[i];
}

template <class V>
inline float k_scale_at(const KvCache& kv, int64_t idx) {
    return kv.k_scale16 != nullptr ? V::h2f(kv.k_scale16[idx]) : kv.k_scale[idx];
}

// Byte tables for assembling int5 / int6 V codes 8 (4) at a time (little-endian words):
// nib[b] = the two codes' low nibbles of byte b as two bytes; hi5[h] = 16 * bit i of h in
// byte i; hi6[h] = 16 * bits 2i..2i+1 of h in byte i.
struct VCodeTables {
    uint16_t nib[256];
    uint64_t hi5[256];
    uint32_t hi6[256];
    constexpr VCodeTables() : nib(), hi5(), hi6() {
        for (int b = 0; b < 256; ++b) {
            nib[b] = static_cast<uint16_t>((b & 15) | ((b >> 4) << 8));
            uint64_t x = 0;
            for (int i = 0; i < 8; ++i) x |= static_cast<uint64_t>(((b >> i) & 1) * 16) << (8 * i);
            hi5[b] = x;
            uint32_t y = 0;
            for (int i = 0; i < 4; ++i) y |= static_cast<uint32_t>(((b >> (2 * i)) & 3) * 16) << (8 * i);
            hi6[b] = y;
        }
    }
};
constexpr VCodeTables kVCodes{};
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the V code tables assume little-endian words");

constexpr int64_t kMaxVGroup = 1024;  // the binding refuses larger V groups

// The int5 / int6 codes (0..31 / 0..63) of elements [e0, e0 + cnt) of the V row at cache
// index idx (e0, cnt multiples of 8: the planes run along the whole row, whatever the V
// group), as cnt bytes (scalar table work; callers convert them with V::load_i8 well after
// the stores, so the vector load never waits on a partial store forward).
inline void v_code_bytes_at(const KvCache& kv, int64_t idx, int64_t e0, int64_t cnt, int8_t* c) {
    const int64_t D = kv.head_dim;
    const uint8_t* nb = kv.v + idx * (D / 2) + e0 / 2;
    if (kv.v6) {
        const uint8_t* hb = kv.v_high + idx * (D / 4) + e0 / 4;
        for (int64_t j = 0; j < cnt / 4; ++j) {
            const uint32_t y = kVCodes.hi6[hb[j]] | kVCodes.nib[nb[2 * j]] |
                               (static_cast<uint32_t>(kVCodes.nib[nb[2 * j + 1]]) << 16);
            std::memcpy(c + 4 * j, &y, 4);
        }
        return;
    }
    const uint8_t* hb = kv.v_high + idx * (D / 8) + e0 / 8;
    for (int64_t j = 0; j < cnt / 8; ++j) {
        const uint8_t* p = nb + 4 * j;
        const uint64_t x = kVCodes.hi5[hb[j]] | kVCodes.nib[p[0]] | (static_cast<uint64_t>(kVCodes.nib[p[1]]) << 16) |
                           (static_cast<uint64_t>(kVCodes.nib[p[2]]) << 32) |
                           (static_cast<uint64_t>(kVCodes.nib[p[3]]) << 48);
        std::memcpy(c + 8 * j, &x, 8);
    }
}

// The same for group gi of the row (n = v_group bytes).
inline void v_code_bytes(const KvCache& kv, int64_t idx, int64_t gi, int8_t* c) {
    v_code_bytes_at(kv, idx, gi * kv.v_group, kv.v_group, c);
}

// n code bytes as floats minus off (0 for int5, 32 for int6).
template <class V>
inline void codes_to_float(const int8_t* c, int64_t n, float off, float* row) {
    const typename V::T vo = V::set1(off);
    int64_t i = 0;
    for (; i + V::W <= n; i += V::W) V::store(row + i, V::sub(V::load_i8(c + i), vo));
    for (; i < n; ++i) row[i] = static_cast<float>(c[i]) - off;
}

inline float v_code_offset(const KvCache& kv) { return kv.v6 ? 32.0f : 0.0f; }

// The int4 values nib - 8 of elements [e0, e0 + cnt) of the row (e0, cnt even).
template <class V>
inline void decode_v4_at(const KvCache& kv, int64_t idx, int64_t e0, int64_t cnt, float* row) {
    const uint8_t* vq = kv.v + idx * (kv.head_dim / 2) + e0 / 2;
    int64_t i0 = 0;
    for (; i0 + 32 <= cnt; i0 += 32) V::nib32(vq + i0 / 2, row + i0);
    for (; i0 < cnt; i0 += 2) {
        const uint8_t b = vq[i0 / 2];
        row[i0] = static_cast<float>(b & 0x0f) - 8.0f;
        row[i0 + 1] = static_cast<float>(b >> 4) - 8.0f;
    }
}

// x[w] = float(code) - 32 of the int6 V elements [e0 + 16 w, e0 + 16 w + 16) of row idx
// (with AVX-512 only: the codes of v_code_bytes_at, converted as there).
template <class V, int NV>
inline void v6_lanes(const KvCache& kv, int64_t idx, int64_t e0, typename V::T off, typename V::T* x) {
    if constexpr (V::W == 16) {
        const int64_t D = kv.head_dim;
        for (int w = 0; w < NV; ++w) {
            x[w] = V::sub(V::v6_codes16(kv.v + idx * (D / 2) + (e0 + 16 * w) / 2,
                                        kv.v_high + idx * (D / 4) + (e0 + 16 * w) / 4), off);
        }
    }
}

// Elements [e0, e0 + cnt) of the V row at cache index idx as floats (e0, cnt multiples of
// 8): nib - 8 (int4), the int5 code c, or c - 32 (int6; with AVX-512 and multiples of 16
// straight from the planes: the same integers, so the same floats, without the code
// bytes' store-to-load stall).
template <class V>
inline void decode_v_at(const KvCache& kv, int64_t idx, int64_t e0, int64_t cnt, float* row) {
    if constexpr (V::W == 16) {
        if (kv.v6 && e0 % 16 == 0 && cnt % 16 == 0) {
            const typename V::T off = V::set1(v_code_offset(kv));
            for (int64_t i = 0; i < cnt; i += 16) {
                typename V::T x[1];
                v6_lanes<V, 1>(kv, idx, e0 + i, off, x);
                V::store(row + i, x[0]);
            }
            return;
        }
    }
    if (kv.v5 || kv.v6) {
        alignas(64) int8_t c[kMaxVGroup];
        v_code_bytes_at(kv, idx, e0, cnt, c);
        codes_to_float<V>(c, cnt, v_code_offset(kv), row);
        return;
    }
    decode_v4_at<V>(kv, idx, e0, cnt, row);
}

// Group gi of the row.
template <class V>
inline void decode_v_group(const KvCache& kv, int64_t idx, int64_t gi, float* row) {
    decode_v_at<V>(kv, idx, gi * kv.v_group, kv.v_group, row);
}

// The orthonormal Walsh-Hadamard transform of x[0, D) in blocks of the largest power of
// two dividing D: butterflies (a + b, a - b) at stride 1, 2, 4, ..., then one multiply by
// float(1 / sqrt(block)) (runtime_shim.kv_cache.rotate_heads does the same operations).
inline void hadamard_row(float* x, int64_t D) {
    const int64_t b = D & -D;
    const float s = static_cast<float>(1.0 / std::sqrt(static_cast<double>(b)));
    for (int64_t o = 0; o < D; o += b) {
        float* y = x + o;
        for (int64_t h = 1; h < b; h <<= 1) {
            for (int64_t i = 0; i < b; i += 2 * h) {
                for (int64_t j = i; j < i + h; ++j) {
                    const float a = y[j], c = y[j + h];
                    y[j] = a + c;
                    y[j + h] = a - c;
                }
            }
        }
    }
    for (int64_t i = 0; i < D; ++i) x[i] = x[i] * s;
}

// hadamard_row on the W rows held in the lanes of x[d * stride], d < D (the same operations
// per row, so the same bits).
template <class V>
inline void hadamard_lanes(float* x, int64_t stride, int64_t D) {
    const int64_t b = D & -D;
    const typename V::T s = V::set1(static_cast<float>(1.0 / std::sqrt(static_cast<double>(b))));
    for (int64_t o = 0; o < D; o += b) {
        float* y = x + o * stride;
        for (int64_t h = 1; h < b; h <<= 1) {
            for (int64_t i = 0; i < b; i += 2 * h) {
                for (int64_t j = i; j < i + h; ++j) {
                    const typename V::T a = V::load(y + j * stride), c = V::load(y + (j + h) * stride);
                    V::store(y + j * stride, V::add(a, c));
                    V::store(y + (j + h) * stride, V::sub(a, c));
                }
            }
        }
    }
    for (int64_t d = 0; d < D; ++d) V::store(x + d * stride, V::mul(V::load(x + d * stride), s));
}

// hadamard_row on n contiguous rows of D (infer.h HadamardRowsFn).  With W = 16 the
// stages h < 16 run inside each 16-element vector (V::butterfly16: lanes i, i ^ h), the
// others on whole vectors: the same operations per element, so the same bits.
template <class V>
void hadamard_rows(float* x, int64_t n, int64_t D) {
    const int64_t b = D & -D;
    if (V::W != 16 || b < 16) {
        for (int64_t r = 0; r < n; ++r) hadamard_row(x + r * D, D);
        return;
    }
    if constexpr (V::W == 16) {
        using T = typename V::T;
        const T s = V::set1(static_cast<float>(1.0 / std::sqrt(static_cast<double>(b))));
        for (float* row = x; row < x + n * D; row += D) {
            for (float* y = row; y < row + D; y += b) {
                for (int64_t k = 0; k < b; k += 16) {
                    T v = V::load(y + k);
                    for (int h = 1; h < 16; h <<= 1) v = V::butterfly16(v, h);
                    V::store(y + k, v);
                }
                for (int64_t h = 16; h < b; h <<= 1) {
                    for (int64_t i = 0; i < b; i += 2 * h) {
                        for (int64_t j = i; j < i + h; j += 16) {
                            const T a = V::load(y + j), c = V::load(y + j + h);
                            V::store(y + j, V::add(a, c));
                            V::store(y + j + h, V::sub(a, c));
                        }
                    }
                }
            }
            for (int64_t i = 0; i < D; i += 16) V::store(row + i, V::mul(V::load(row + i), s));
        }
    }
}

// Writes one token (the driver has rotated it already for a rotating layout).
template <class V>
Result kv_write(const KvCache& kv, int64_t pos, const float* k, int64_t kstride, const float* v,
                int64_t vstride) {
    const int64_t H = kv.n_kv_heads, D = kv.head_dim;
    for (int64_t h = 0; h < H; ++h) {  // check everything first: a failed write changes nothing
        if (V::max_abs_bits(k + h * kstride, D) >= kNonFinite) {
            return {Status::non_finite, h, first_bad(k + h * kstride, D)};
        }
        if (V::max_abs_bits(v + h * vstride, D) >= kNonFinite) {
            return {Status::non_finite, H + h, first_bad(v + h * vstride, D)};
        }
    }
    if (!kv.quantized) {
        for (int64_t h = 0; h < H; ++h) {
            const int64_t idx = kv.index(pos, h);
            std::memcpy(kv.kf + idx * D, k + h * kstride, static_cast<size_t>(D) * sizeof(float));
            std::memcpy(kv.vf + idx * D, v + h * vstride, static_cast<size_t>(D) * sizeof(float));
        }
        return {};
    }
    const int64_t n = kv.v_group, G = D / n;
    if (kv.v5 || kv.v6) {  // float16 K scales; V int5 (scale + min) or int6 (scale byte)
        for (int64_t h = 0; h < H; ++h) {
            const bool over = kv.v6 ? v6_overflows(k + h * kstride, v + h * vstride, D, n)
                                    : v5_overflows(k + h * kstride, v + h * vstride, D, n);
            if (over) return {Status::scale_overflow, h, 0};
        }
        for (int64_t h = 0; h < H; ++h) {
            const int64_t idx = kv.index(pos, h);
            kv.k_scale16[idx] = f32_to_f16(k16_scale_f32(k + h * kstride, D));
            quant_with<V>(k + h * kstride, D, f16_to_f32(kv.k_scale16[idx]), kv.k + idx * D);
            for (int64_t g = 0; g < G; ++g) {
                const float* vg = v + h * vstride + g * n;
                uint8_t* nib = kv.v + idx * (D / 2) + g * (n / 2);
                if (kv.v6) {
                    quant_v6_group(vg, n, nib, kv.v_high + idx * (D / 4) + g * (n / 4),
                                   static_cast<uint8_t*>(kv.v_scale) + idx * G + g);
                } else {
                    quant_v5_group(vg, n, nib, kv.v_high + idx * (D / 8) + g * (n / 8),
                                   static_cast<uint16_t*>(kv.v_scale) + idx * G + g, kv.v_min + idx * G + g);
                }
            }
        }
        return {};
    }
    if (kv.v_scale_f16) {  // the only failure left: a V scale beyond float16 range
        for (int64_t h = 0; h < H; ++h) {
            for (int64_t g = 0; g < G; ++g) {
                const float* vg = v + h * vstride + g * n;
                if (f16_is_inf(f32_to_f16(vg[v_peak(vg, n)] / -8.0f))) return {Status::scale_overflow, h, g};
            }
        }
    }
    for (int64_t h = 0; h < H; ++h) {
        const int64_t idx = kv.index(pos, h);
        quant_group<V>(k + h * kstride, D, kv.k + idx * D, kv.k_scale + idx);
        uint8_t* vq = kv.v + idx * (D / 2);
        for (int64_t g = 0; g < G; ++g) {
            if (kv.v_scale_f16) {
                quant_v_group(v + h * vstride + g * n, n, vq + g * (n / 2), nullptr,
                              static_cast<uint16_t*>(kv.v_scale) + idx * G + g);
            } else {
                quant_v_group(v + h * vstride + g * n, n, vq + g * (n / 2),
                              static_cast<float*>(kv.v_scale) + idx * G + g, nullptr);
            }
        }
    }
    return {};
}

// ---- attention: nq query heads sharing one kv head, over positions [0, L) -------------
// Per query head: s_p = (q . float(kq_p)) * k_scale_p * scale (canonical dot; float cache:
// (q . k_p) * scale), m = max s, e_p = exp(s_p - m), Z = canonical 16-lane sum of e_p
// (position p in lane p % 16), then per V group out[i] += (e_p * v_scale) * (nib_i - 8)
// (float cache: out[i] += e_p * v[i]) in position order, and out *= 1 / Z.  Each head's sequence of operations does not depend
// on nq, so decode (nq = 1) and prefill (nq = heads per kv head) give identical bits.
// Positions are walked block by block through the block table (no division per position).
// q [nq, D] contiguous, out [nq, D], sc holds nq * L + D floats.
// Largest of x[0, n) (n >= 1).  Exact for non-NaN values; among equal values only the
// sign of a zero can differ, which does not change any x - max.
template <class V>
inline float max_of(const float* x, int64_t n) {
    float m = x[0];
    int64_t i = 0;
    if (n >= V::W) {
        typename V::T vm = V::load(x);
        for (i = V::W; i + V::W <= n; i += V::W) vm = V::max(V::load(x + i), vm);
        float lanes[V::W];
        V::store(lanes, vm);
        m = lanes[0];
        for (int k = 1; k < V::W; ++k) m = lanes[k] > m ? lanes[k] : m;
    }
    for (; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
}

template <class V>
inline void axpy_row(float* out, float a, const float* v, int64_t D) {
    const typename V::T va = V::set1(a);
    const int64_t nv = D / V::W * V::W;
    for (int64_t i = 0; i < nv; i += V::W) V::store(out + i, V::add(V::load(out + i), V::mul(va, V::load(v + i))));
    for (int64_t i = nv; i < D; ++i) out[i] = out[i] + a * v[i];
}

template <class V>
inline void add_const(float* out, float a, int64_t n) {
    const typename V::T va = V::set1(a);
    const int64_t nv = n / V::W * V::W;
    for (int64_t i = 0; i < nv; i += V::W) V::store(out + i, V::add(V::load(out + i), va));
    for (int64_t i = nv; i < n; ++i) out[i] = out[i] + a;
}

// Tile of queries (see AttnTile): lengths L_j = L0 + j / per are nondecreasing in j, so
// the queries that see position p are those with j >= first_active(p).
inline int64_t first_active(const AttnTile& t, int64_t p) { return p < t.L0 ? 0 : (p - t.L0 + 1) * t.per; }

// The positions the tile's last query sees (a decode step's group: t.L0).
inline int64_t group_rows(const AttnTile& t) { return t.L0 + (t.nq - 1) / t.per; }

inline const float* tile_q(const AttnTile& t, int64_t j, int64_t D) {
    return t.q + (j / t.per) * t.qstride + (j % t.per) * D;
}
inline float* tile_out(const AttnTile& t, int64_t j, int64_t D) {
    return t.out + (j / t.per) * t.ostride + (j % t.per) * D;
}

// out_j += (e_jp * v_scale) * (nib - 8) over positions, accumulating in memory (int5:
// out_j += (e_jp * v_scale) * c, then out_j += e_jp * v_min).
template <class V>
inline void attn_v_mem(const KvCache& kv, int64_t head, const AttnTile& t, const float* sc,
                       int64_t Lmax, float* row) {
    const int64_t D = kv.head_dim, H = kv.n_kv_heads, BS = kv.block_size, n = kv.v_group, G = D / n;
    for (int64_t p0 = 0, b = 0; p0 < Lmax; p0 += BS, ++b) {
        const int64_t cnt = BS < Lmax - p0 ? BS : Lmax - p0;
        const int64_t base = static_cast<int64_t>(kv.table[b]) * BS * H + head;
        for (int64_t s = 0; s < cnt; ++s) {
            const int64_t idx = base + s * H, p = p0 + s, j0 = first_active(t, p);
            if (!kv.quantized) {
                for (int64_t tt = j0 / t.per, j = j0; j < t.nq; ++tt) {
                    float* ot = t.out + tt * t.ostride;
                    for (int64_t r = 0; r < t.per; ++r, ++j) axpy_row<V>(ot + r * D, sc[j * Lmax + p], kv.vf + idx * D, D);
                }
                continue;
            }
            for (int64_t g = 0; g < G; ++g) {
                decode_v_group<V>(kv, idx, g, row + g * n);
                const float d = v_scale_at<V>(kv, idx * G + g);
                const float mn = kv.v5 ? V::h2f(kv.v_min[idx * G + g]) : 0.0f;
                for (int64_t tt = j0 / t.per, j = j0; j < t.nq; ++tt) {
                    float* ot = t.out + tt * t.ostride + g * n;
                    for (int64_t r = 0; r < t.per; ++r, ++j) {
                        const float e = sc[j * Lmax + p];
                        axpy_row<V>(ot + r * D, e * d, row + g * n, n);
                        if (kv.v5) add_const<V>(ot + r * D, e * mn, n);
                    }
                }
            }
        }
    }
}

// The same for a single query with D and the V group NN known at compile time: the
// accumulators stay in registers (identical operations, so identical bits); int5 / int6
// code bytes are assembled for kAttnCodeRows positions before any is converted.
constexpr int64_t kAttnCodeRows = 8;
template <class V, int DD, int NN>
inline void attn_v_regs(const KvCache& kv, int64_t head, int64_t L, const float* sc, float* out,
                        float* row) {
    constexpr int NV = DD / V::W, G = DD / NN, PW = NN / V::W;
    const int64_t H = kv.n_kv_heads, BS = kv.block_size;
    const bool coded = kv.v5 || kv.v6;
    const typename V::T off = V::set1(v_code_offset(kv));
    typename V::T acc[NV];
    for (int i = 0; i < NV; ++i) acc[i] = V::zero();
    alignas(64) int8_t codes[kAttnCodeRows * DD];
    for (int64_t p0 = 0, b = 0; p0 < L; p0 += BS, ++b) {
        const int64_t n = BS < L - p0 ? BS : L - p0;
        const int64_t base = static_cast<int64_t>(kv.table[b]) * BS * H + head;
        for (int64_t s0 = 0; s0 < n; s0 += kAttnCodeRows) {
            const int64_t m = kAttnCodeRows < n - s0 ? kAttnCodeRows : n - s0;
            if (coded) {  // all code bytes of these rows first, converted after (see v_code_bytes)
                for (int64_t s = 0; s < m; ++s) {
                    for (int g = 0; g < G; ++g) v_code_bytes(kv, base + (s0 + s) * H, g, codes + s * DD + g * NN);
                }
            }
            for (int64_t s = s0; s < s0 + m; ++s) {
                const int64_t idx = base + s * H;
                const float e = sc[p0 + s];
                for (int g = 0; g < G; ++g) {
                    const typename V::T va = V::set1(e * v_scale_at<V>(kv, idx * G + g));
                    if (coded) {
                        const int8_t* c = codes + (s - s0) * DD + g * NN;
                        for (int w = 0; w < PW; ++w) {
                            const typename V::T x = V::sub(V::load_i8(c + w * V::W), off);
                            acc[g * PW + w] = V::add(acc[g * PW + w], V::mul(va, x));
                        }
                    } else {
                        decode_v_group<V>(kv, idx, g, row + g * NN);
                        for (int w = 0; w < PW; ++w) {
                            acc[g * PW + w] = V::add(acc[g * PW + w], V::mul(va, V::load(row + g * NN + w * V::W)));
                        }
                    }
                    if (kv.v5) {
                        const typename V::T vm = V::set1(e * V::h2f(kv.v_min[idx * G + g]));
                        for (int w = 0; w < PW; ++w) acc[g * PW + w] = V::add(acc[g * PW + w], vm);
                    }
                }
            }
        }
    }
    for (int i = 0; i < NV; ++i) V::store(out + i * V::W, acc[i]);
}

// ---- attention over a tile of queries (prefill): the queries in vector lanes ------------
// Query j of the tile is lane j % W of query vector j / W (AttnScratch's layout; padding
// lanes hold a zero query and are never written out).  Every position's K row and V row is
// converted once per tile and serves all of its queries; each lane does exactly the
// operations of one query in the decode path (the comment above max_of), so the bits do
// not depend on the tile:
//   scores: lane partials P_i = sum over d = i (mod 16), in increasing d, of q_d * k_d
//           (from +0, multiply then add), folded 16->8->4->2->1 (dot16's tree), then
//           (* k_scale) * scale;
//   softmax: the max over the lane's positions (exact, order-free), e = exp(s - m) and
//           Z = the canonical 16-lane sum (position p in lane p % 16);
//   output: out += (e * v_scale) * code (int5: then out += e * v_min) in position order
//           from +0, then out * (1 / Z).
// A lane also runs over positions it does not see (up to the tile's last query), with
// e = 0 there: a sum that starts at +0 is never -0, and x + (+-0) == x for every other x,
// so those terms change no bit.

// The lengths of the tile's queries: lane j sees [lo(j), len(j)); padding lanes see the
// tile's longest range.
struct TileLanes {
    const AttnTile& t;
    int64_t Lmax;
    int64_t len(int64_t j) const { return j < t.nq ? t.L0 + j / t.per : Lmax; }
    int64_t lo(int64_t j) const {
        const int64_t L = len(j);
        return j < t.nq && t.window > 0 && L > t.window ? L - t.window : 0;
    }
};

// The 16->8->4->2->1 fold of 16 vectors of lane partials, lane by lane (constant bounds:
// with the `h` loop of VS::fold16 the compiler would take P through memory).
template <class V>
inline typename V::T fold_tree16(typename V::T* P) {
    for (int i = 0; i < 8; ++i) P[i] = V::add(P[i], P[i + 8]);
    for (int i = 0; i < 4; ++i) P[i] = V::add(P[i], P[i + 4]);
    for (int i = 0; i < 2; ++i) P[i] = V::add(P[i], P[i + 2]);
    return V::add(P[0], P[1]);
}

// Scores of every query vector that sees position p against K row kr (float).  TAIL:
// D % 16 != 0 (a separate instance: the tail's conditions would keep P in memory).
template <class V, bool TAIL>
inline void tile_scores_row(const float* qt, int64_t QW, int64_t D, const float* kr, typename V::T post,
                            bool quantized, typename V::T vscale, int64_t qv0, int64_t nqv, float* srow) {
    using T = typename V::T;
    for (int64_t qv = qv0; qv < nqv; ++qv) {
        const float* q = qt + qv * V::W;
        T P[16];
        for (int i = 0; i < 16; ++i) P[i] = V::zero();
        int64_t d0 = 0;
        for (; d0 + 16 <= D; d0 += 16) {  // i compile-time: P stays in registers
            for (int i = 0; i < 16; ++i) {
                P[i] = V::add(P[i], V::mul(V::load(q + (d0 + i) * QW), V::set1(kr[d0 + i])));
            }
        }
        for (int i = 0; TAIL && i < 16; ++i) {
            if (d0 + i < D) P[i] = V::add(P[i], V::mul(V::load(q + (d0 + i) * QW), V::set1(kr[d0 + i])));
        }
        const T dot = fold_tree16<V>(P);
        V::store(srow + qv * V::W, quantized ? V::mul(V::mul(dot, post), vscale) : V::mul(dot, vscale));
    }
}

// Softmax numerators of query vector qv in place (column of stride QW), its 1 / Z to zinv.
template <class V>
inline void tile_softmax(const TileLanes& ln, int64_t qv, float* sc, int64_t QW, float* zinv) {
    using T = typename V::T;
    constexpr int W = V::W;
    const AttnTile& t = ln.t;
    const int64_t j0 = qv * W, pend = ln.len(j0 + W - 1);
    float* S = sc + j0;
    const float ninf = -std::numeric_limits<float>::infinity();
    int64_t all_lo = 0, all_hi = pend;  // positions every lane of the vector sees
    for (int64_t w = 0; w < W; ++w) {
        const int64_t j = j0 + w, L = ln.len(j), lo = ln.lo(j);
        if (j >= t.nq) continue;
        if (t.softcap > 0.0f) {
            for (int64_t p = lo; p < L; ++p) S[p * QW + w] = t.softcap * std::tanh(S[p * QW + w] / t.softcap);
        }
        for (int64_t p = 0; p < lo; ++p) S[p * QW + w] = ninf;
        for (int64_t p = L; p < pend; ++p) S[p * QW + w] = ninf;
        all_lo = lo > all_lo ? lo : all_lo;
        all_hi = L < all_hi ? L : all_hi;
    }
    T m = V::set1(ninf);
    for (int64_t p = 0; p < pend; ++p) m = V::max(V::load(S + p * QW), m);
    T Z[16];
    for (int i = 0; i < 16; ++i) Z[i] = V::zero();
    auto numerator = [&](int64_t p) {
        T e = exp_v<V>(V::sub(V::load(S + p * QW), m));
        if (p < all_lo || p >= all_hi) {  // some lane does not see p: its e is 0
            alignas(64) float tmp[W];
            V::store(tmp, e);
            for (int64_t w = 0; w < W; ++w) {
                if (p < ln.lo(j0 + w) || p >= ln.len(j0 + w)) tmp[w] = 0.0f;
            }
            e = V::load(tmp);
        }
        V::store(S + p * QW, e);
        return e;
    };
    int64_t p = 0;
    for (; p + 16 <= pend; p += 16) {
        for (int i = 0; i < 16; ++i) Z[i] = V::add(Z[i], numerator(p + i));
    }
    for (int i = 0; i < 16; ++i) {
        if (p + i < pend) Z[i] = V::add(Z[i], numerator(p + i));
    }
    V::store(zinv + j0, V::div(V::set1(1.0f), fold_tree16<V>(Z)));
}

// Output sums of elements [c0, c0 + E) of query vector qv (acc [d][lane]) over positions
// [p0, p1) whose V rows are rows[p - p0] with scale vs[(p - p0) * G + g] (and min vm).
template <class V, int E>
inline void tile_v_chunk(const KvCache& kv, const float* const* rows, const float* vs, const float* vm,
                         int64_t G, const float* sc, int64_t QW, int64_t qv, int64_t p0, int64_t p1,
                         int64_t c0, float* acc) {
    using T = typename V::T;
    constexpr int W = V::W;
    const int64_t g = kv.quantized ? c0 / kv.v_group : 0;
    T a[E];
    for (int i = 0; i < E; ++i) a[i] = V::load(acc + (c0 + i) * QW + qv * W);
    for (int64_t p = p0; p < p1; ++p) {
        const T e = V::load(sc + p * QW + qv * W);
        const float* vr = rows[p - p0] + c0;
        const T w = kv.quantized ? V::mul(e, V::set1(vs[(p - p0) * G + g])) : e;
        for (int i = 0; i < E; ++i) a[i] = V::add(a[i], V::mul(w, V::set1(vr[i])));
        if (kv.v5) {
            const T wm = V::mul(e, V::set1(vm[(p - p0) * G + g]));
            for (int i = 0; i < E; ++i) a[i] = V::add(a[i], wm);
        }
    }
    for (int i = 0; i < E; ++i) V::store(acc + (c0 + i) * QW + qv * W, a[i]);
}

template <class V>
void attn_tile(const KvCache& kv, int64_t head, const AttnTile& t, float* scratch) {
    using T = typename V::T;
    constexpr int W = V::W;
    const int64_t D = kv.head_dim, Lmax = t.L0 + (t.nq - 1) / t.per;
    const AttnScratch lay(t.nq, Lmax, D);
    const int64_t QW = lay.lanes, nqv = (t.nq + W - 1) / W, used = nqv * W;
    float* qt = scratch + lay.qt;
    float* sc = scratch + lay.sc;
    float* acc = scratch + lay.acc;
    float* zinv = scratch + lay.zinv;
    const TileLanes ln{t, Lmax};
    for (int64_t j = 0; j < used; ++j) {
        const float* q = j < t.nq ? tile_q(t, j, D) : nullptr;
        for (int64_t d = 0; d < D; ++d) qt[d * QW + j] = q != nullptr ? q[d] : 0.0f;
    }
    if (kv.rotate) {  // q . k in the stored basis
        for (int64_t qv = 0; qv < nqv; ++qv) hadamard_lanes<V>(qt + qv * W, QW, D);
    }
    // scores, one position (K row converted once) against every query vector that sees it
    float* krow = scratch + lay.krow;
    const T vscale = V::set1(t.scale);
    for (int64_t p = 0; p < Lmax; ++p) {
        const int64_t idx = kv.index(p, head);
        const float* kr = kv.kf + idx * D;
        float ks = 1.0f;
        if (kv.quantized) {
            const int8_t* kq = kv.k + idx * D;
            int64_t i = 0;
            for (; i + W <= D; i += W) V::store(krow + i, V::load_i8(kq + i));
            for (; i < D; ++i) krow[i] = static_cast<float>(kq[i]);
            kr = krow;
            ks = k_scale_at<V>(kv, idx);
        }
        const int64_t qv0 = first_active(t, p) / W;
        if (D % 16 == 0) {
            tile_scores_row<V, false>(qt, QW, D, kr, V::set1(ks), kv.quantized, vscale, qv0, nqv, sc + p * QW);
        } else {
            tile_scores_row<V, true>(qt, QW, D, kr, V::set1(ks), kv.quantized, vscale, qv0, nqv, sc + p * QW);
        }
    }
    for (int64_t qv = 0; qv < nqv; ++qv) tile_softmax<V>(ln, qv, sc, QW, zinv);
    // output sums: kVRows V rows converted at a time, then every query vector over them
    for (int64_t i = 0; i < D * QW; ++i) acc[i] = 0.0f;
    const int64_t n = kv.v_group, G = kv.quantized ? D / n : 1;
    float* vrows = scratch + lay.vrows;
    float* vs = scratch + lay.vscale;
    float* vm = scratch + lay.vmin;
    const float* rows[AttnScratch::kVRows];
    const bool e16 = W != 8 && (kv.quantized ? n % 16 == 0 : D % 16 == 0);  // AVX2: 16 registers
    for (int64_t p0 = 0; p0 < Lmax; p0 += AttnScratch::kVRows) {
        const int64_t m = AttnScratch::kVRows < Lmax - p0 ? AttnScratch::kVRows : Lmax - p0;
        for (int64_t r = 0; r < m; ++r) {
            const int64_t idx = kv.index(p0 + r, head);
            if (!kv.quantized) {
                rows[r] = kv.vf + idx * D;
                continue;
            }
            float* row = vrows + r * D;
            for (int64_t g = 0; g < G; ++g) {
                decode_v_group<V>(kv, idx, g, row + g * n);
                vs[r * G + g] = v_scale_at<V>(kv, idx * G + g);
                if (kv.v5) vm[r * G + g] = V::h2f(kv.v_min[idx * G + g]);
            }
            rows[r] = row;
        }
        for (int64_t qv = first_active(t, p0) / W; qv < nqv; ++qv) {
            const int64_t pend = ln.len(qv * W + W - 1), p1 = p0 + m < pend ? p0 + m : pend;
            int64_t c0 = 0;
            if (e16) {
                for (; c0 + 16 <= D; c0 += 16) tile_v_chunk<V, 16>(kv, rows, vs, vm, G, sc, QW, qv, p0, p1, c0, acc);
            }
            for (; c0 + 8 <= D; c0 += 8) tile_v_chunk<V, 8>(kv, rows, vs, vm, G, sc, QW, qv, p0, p1, c0, acc);
            for (; c0 < D; ++c0) tile_v_chunk<V, 1>(kv, rows, vs, vm, G, sc, QW, qv, p0, p1, c0, acc);
        }
    }
    for (int64_t qv = 0; qv < nqv; ++qv) {
        const T zi = V::load(zinv + qv * W);
        for (int64_t d = 0; d < D; ++d) V::store(acc + d * QW + qv * W, V::mul(V::load(acc + d * QW + qv * W), zi));
        if (kv.rotate) hadamard_lanes<V>(acc + qv * W, QW, D);  // back from the stored basis
    }
    for (int64_t j = 0; j < t.nq; ++j) {
        float* o = tile_out(t, j, D);
        for (int64_t d = 0; d < D; ++d) o[d] = acc[d * QW + j];
    }
}

// Softmax numerators of one query's scores sj[0, L) in place (soft-capped first; keys
// outside a sliding window get 0).
template <class V>
inline void softmax_numerators(float* sj, int64_t L, const AttnTile& t) {
    const int64_t lo = t.window > 0 && L > t.window ? L - t.window : 0;
    if (t.softcap > 0.0f) {
        for (int64_t p = lo; p < L; ++p) sj[p] = t.softcap * std::tanh(sj[p] / t.softcap);
    }
    for (int64_t p = 0; p < lo; ++p) sj[p] = 0.0f;
    const float m = max_of<V>(sj + lo, L - lo);
    const typename V::T vm = V::set1(m);
    int64_t p = lo;
    for (; p + V::W <= L; p += V::W) V::store(sj + p, exp_v<V>(V::sub(V::load(sj + p), vm)));
    for (; p < L; ++p) sj[p] = exp_v<VS>(sj[p] - m);
}

// ---- decode: the query heads of one token that share a kv head --------------------------
// t.nq == t.per heads over positions [0, t.L0), output elements [t.e0, t.e1) only: each K
// row is converted once for all the heads and each V row once for all of them.  With 2+
// threads a kv head's work runs in phases (AttnTile::Phase): its scores by position
// ranges, their softmax, its V sums by output elements.  Per head these are the
// operations of the one-query path (attn_heads), so the same bits.
// attn_group's output sums for R heads and E elements from e0 (inside one V group) with
// the accumulators in registers and the int5 / int6 code bytes of kAttnCodeRows rows
// assembled first (as attn_v_regs): the same operations as its memory loop.
template <class V, int R, int E>
inline void group_v_regs(const KvCache& kv, int64_t head, const AttnTile& t, int64_t r0, int64_t L, const float* S) {
    const int64_t e0 = t.e0;
    using T = typename V::T;
    constexpr int NV = E / V::W;
    const int64_t D = kv.head_dim, H = kv.n_kv_heads, BS = kv.block_size, n = kv.v_group, G = D / n, g = e0 / n;
    const bool coded = kv.v5 || kv.v6;
    const bool direct6 = V::W == 16 && kv.v6;  // int6 codes straight into lanes (V::v6_codes16)
    const T off = V::set1(v_code_offset(kv));
    T acc[R][NV];
    for (int r = 0; r < R; ++r) {
        for (int w = 0; w < NV; ++w) acc[r][w] = V::zero();
    }
    alignas(64) int8_t codes[kAttnCodeRows * E];
    alignas(64) float row[E];
    for (int64_t p0 = 0, b = 0; p0 < L; p0 += BS, ++b) {
        const int64_t m0 = BS < L - p0 ? BS : L - p0;
        const int64_t base = static_cast<int64_t>(kv.table[b]) * BS * H + head;
        if (coded && p0 + BS < L) {  // the next block's rows from memory while this one computes
            const int64_t nb = static_cast<int64_t>(kv.table[b + 1]) * BS * H + head;
            const int64_t nn = BS < L - p0 - BS ? BS : L - p0 - BS, hd = kv.v6 ? 4 : 8;
            const uint8_t* nib = kv.v + nb * (D / 2) + e0 / 2;
            const uint8_t* high = kv.v_high + nb * (D / hd) + e0 / hd;
            for (int64_t s = 0; s < nn; ++s) {
                __builtin_prefetch(nib + s * H * (D / 2));
                __builtin_prefetch(high + s * H * (D / hd));
            }
        }
        for (int64_t s0 = 0; s0 < m0; s0 += kAttnCodeRows) {
            const int64_t m = kAttnCodeRows < m0 - s0 ? kAttnCodeRows : m0 - s0;
            if (coded && !direct6) {
                for (int64_t s = 0; s < m; ++s) v_code_bytes_at(kv, base + (s0 + s) * H, e0, E, codes + s * E);
            }
            for (int64_t s = s0; s < s0 + m; ++s) {
                const int64_t idx = base + s * H, p = p0 + s;
                T x[NV];
                if (direct6) {
                    v6_lanes<V, NV>(kv, idx, e0, off, x);
                } else if (coded) {
                    for (int w = 0; w < NV; ++w) x[w] = V::sub(V::load_i8(codes + (s - s0) * E + w * V::W), off);
                } else {
                    decode_v4_at<V>(kv, idx, e0, E, row);
                    for (int w = 0; w < NV; ++w) x[w] = V::load(row + w * V::W);
                }
                const float d = v_scale_at<V>(kv, idx * G + g);
                const float mn = kv.v5 ? V::h2f(kv.v_min[idx * G + g]) : 0.0f;
                for (int r = 0; r < R; ++r) {
                    const float e = S[(r0 + r) * L + p];
                    const T va = V::set1(e * d);
                    for (int w = 0; w < NV; ++w) acc[r][w] = V::add(acc[r][w], V::mul(va, x[w]));
                    if (kv.v5) {
                        const T vm = V::set1(e * mn);
                        for (int w = 0; w < NV; ++w) acc[r][w] = V::add(acc[r][w], vm);
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int w = 0; w < NV; ++w) V::store(tile_out(t, r0 + r, D) + e0 + w * V::W, acc[r][w]);
    }
}

// group_v_regs for queries [r0, r0 + R) of the tile with R = n at run time (1 <= n <= RM).
template <class V, int E, int RM>
inline void group_v_rows(const KvCache& kv, int64_t head, const AttnTile& t, int64_t r0, int64_t n, int64_t L, const float* S) {
    if constexpr (RM > 1) {
        if (n < RM) return group_v_rows<V, E, RM - 1>(kv, head, t, r0, n, L, S);
    }
    group_v_regs<V, RM, E>(kv, head, t, r0, L, S);
}

// The V sums of every query of the tile, kGroupRows of them at a time (as many
// accumulators as the registers hold; each query's operations do not depend on its chunk).
template <class V, int E>
inline bool group_v_fast(const KvCache& kv, int64_t head, const AttnTile& t, const float* S, int64_t L) {
    if (!kv.quantized || t.e1 - t.e0 != E || kv.v_group % E != 0) return false;
    constexpr int kGroupRows = V::W == 16 && E == 32 ? 8 : 4;
    for (int64_t r0 = 0; r0 < t.nq; r0 += kGroupRows) {
        group_v_rows<V, E, kGroupRows>(kv, head, t, r0, std::min<int64_t>(kGroupRows, t.nq - r0), L, S);
    }
    return true;
}

// The cache index of (position p, head) for p = 0, 1, 2, ... without a division per step.
struct KvWalk {
    const KvCache& kv;
    int64_t head, b = 0, slot = 0, idx;
    KvWalk(const KvCache& c, int64_t h, int64_t p = 0)
        : kv(c), head(h), b(p / c.block_size), slot(p % c.block_size), idx(c.index(p, h)) {}
    void next() {
        if (++slot < kv.block_size) {
            idx += kv.n_kv_heads;
            return;
        }
        slot = 0;
        ++b;
        if (b < kv.table_len) idx = (static_cast<int64_t>(kv.table[b]) * kv.block_size) * kv.n_kv_heads + head;
    }
};

// attn_group's scores for the positions [0, 16 floor(L / 16)) with AVX-512: each dot16 as
// there (one 16-lane accumulator from +0, multiply then add, chunk by chunk), but the
// folds of 16 positions done together (V::fold16x16, the same adds) and the scaling
// (dot * k_scale) * scale in vector lanes.  Only positions [p_begin, p_end) (p_begin a
// multiple of 16, so the same batches whatever the range).  Returns the first position it
// did not score.
template <class V>
inline int64_t group_scores16(const KvCache& kv, int64_t head, const AttnTile& t, float* S, int64_t p_begin, int64_t p_end) {
    constexpr int64_t kMaxD = 128;
    const int64_t D = kv.head_dim, L = group_rows(t), R = t.nq;
    if constexpr (V::W != 16) {
        return p_begin;
    } else {
        if (D % 16 != 0 || D > kMaxD) return p_begin;
        using T = typename V::T;
        alignas(64) float kb[16 * kMaxD];  // the 16 K rows as float
        alignas(64) float ks[16];
        const int64_t C = D / 16;
        int64_t p0 = p_begin;
        KvWalk at(kv, head, p0), ahead(kv, head, p0);  // the rows of this batch, the next batch's
        for (int64_t s = 0; s < 16 && p0 + s < p_end; ++s) ahead.next();
        for (; p0 + 16 <= p_end; p0 += 16) {
            for (int64_t s = 0; s < 16 && p0 + 16 + s < p_end; ++s) {  // from memory while this batch computes
                __builtin_prefetch(kv.quantized ? static_cast<const void*>(kv.k + ahead.idx * D) : kv.kf + ahead.idx * D);
                ahead.next();
            }
            for (int64_t s = 0; s < 16; ++s) {
                const int64_t idx = at.idx;
                at.next();
                if (kv.quantized) {
                    for (int64_t c = 0; c < C; ++c) V::store(kb + s * D + c * 16, V::load_i8(kv.k + idx * D + c * 16));
                    ks[s] = k_scale_at<V>(kv, idx);
                } else {
                    std::memcpy(kb + s * D, kv.kf + idx * D, static_cast<size_t>(D) * sizeof(float));
                }
            }
            const T vks = V::load(ks), vscale = V::set1(t.scale);
            for (int64_t r = 0; r < R; ++r) {
                const float* q = tile_q(t, r, D);
                T acc[16];
                for (int s = 0; s < 16; ++s) {
                    T a = V::zero();
                    for (int64_t c = 0; c < C; ++c) a = V::add(a, V::mul(V::load(q + c * 16), V::load(kb + s * D + c * 16)));
                    acc[s] = a;
                }
                const T dot = V::fold16x16(acc);
                V::store(S + r * L + p0, kv.quantized ? V::mul(V::mul(dot, vks), vscale) : V::mul(dot, vscale));
            }
        }
        return p0;
    }
}

// attn_group's scores of positions [p_begin, p_end) (p_begin a multiple of 16) into S
// (rows of t.L0): every position gets the same operations whatever the range.
template <class V>
void group_scores(const KvCache& kv, int64_t head, const AttnTile& t, float* S, int64_t p_begin, int64_t p_end, float* krow) {
    const int64_t D = kv.head_dim, R = t.nq, L = group_rows(t);
    const int64_t p16 = group_scores16<V>(kv, head, t, S, p_begin, p_end);
    for (int64_t p = p16, idx = 0; p < p_end; ++p) {
        idx = p % kv.block_size != 0 && p > p16 ? idx + kv.n_kv_heads : kv.index(p, head);
        const float* kr = kv.kf + idx * D;
        if (kv.quantized) {
            const int8_t* kq = kv.k + idx * D;
            int64_t i = 0;
            for (; i + V::W <= D; i += V::W) V::store(krow + i, V::load_i8(kq + i));
            for (; i < D; ++i) krow[i] = static_cast<float>(kq[i]);
            kr = krow;
        }
        const float ks = kv.quantized ? k_scale_at<V>(kv, idx) : 1.0f;
        for (int64_t r = 0; r < R; ++r) {
            const float dot = dot16<V>(tile_q(t, r, D), kr, D, [](const float* x) { return V::load(x); });
            S[r * L + p] = kv.quantized ? (dot * ks) * t.scale : dot * t.scale;
        }
    }
}

// Query r's score row sj (of group_rows(t)) as softmax numerators in place, 0 past the
// positions it sees (those terms of group_v change no bit: the TileLanes note); returns
// 1 / their sum.
template <class V>
float group_softmax(float* sj, const AttnTile& t, int64_t r) {
    const int64_t L = t.L0 + r / t.per;
    softmax_numerators<V>(sj, L, t);
    for (int64_t p = L; p < group_rows(t); ++p) sj[p] = 0.0f;
    return 1.0f / sum16<V>(sj, L);
}

// attn_group's output elements [e0, e1) of its R queries from the numerators S and the
// 1 / sums inv.
template <class V>
void group_v(const KvCache& kv, int64_t head, const AttnTile& t, const float* S, const float* inv, float* row) {
    const int64_t D = kv.head_dim, R = t.nq, L = group_rows(t), n = kv.v_group, G = kv.quantized ? D / n : 1;
    for (int64_t r = 0; r < R; ++r) {
        for (int64_t i = t.e0; i < t.e1; ++i) tile_out(t, r, D)[i] = 0.0f;
    }
    const bool fast = group_v_fast<V, 32>(kv, head, t, S, L) || group_v_fast<V, 64>(kv, head, t, S, L);
    for (int64_t p = 0, idx = 0; p < L && !fast; ++p) {
        idx = p % kv.block_size != 0 ? idx + kv.n_kv_heads : kv.index(p, head);
        for (int64_t a = t.e0; a < t.e1;) {  // the parts of [e0, e1) in one V group each
            const int64_t g = kv.quantized ? a / n : 0;
            const int64_t b = kv.quantized && (g + 1) * n < t.e1 ? (g + 1) * n : t.e1;
            const float* vr = kv.vf + idx * D + a;
            float d = 1.0f, mn = 0.0f;
            if (kv.quantized) {
                decode_v_at<V>(kv, idx, a, b - a, row);
                vr = row;
                d = v_scale_at<V>(kv, idx * G + g);
                if (kv.v5) mn = V::h2f(kv.v_min[idx * G + g]);
            }
            for (int64_t r = 0; r < R; ++r) {
                const float e = S[r * L + p];
                axpy_row<V>(tile_out(t, r, D) + a, kv.quantized ? e * d : e, vr, b - a);
                if (kv.v5) add_const<V>(tile_out(t, r, D) + a, e * mn, b - a);
            }
            a = b;
        }
    }
    for (int64_t r = 0; r < R; ++r) {
        const typename V::T vi = V::set1(inv[r]);
        float* o = tile_out(t, r, D);
        int64_t i = t.e0;
        for (; i + V::W <= t.e1; i += V::W) V::store(o + i, V::mul(V::load(o + i), vi));
        for (; i < t.e1; ++i) o[i] = o[i] * inv[r];
    }
}

// (A pass of several tokens, nq > per, brings its own S and inv: the scratch holds
// kMaxHeads rows.)
template <class V>
void attn_group(const KvCache& kv, int64_t head, const AttnTile& t, float* sc) {
    const int64_t L = group_rows(t);
    const AttnScratch lay(1, L, kv.head_dim);
    float* S = t.S != nullptr ? t.S : sc + lay.sc;
    if (t.phase == AttnTile::kScores) return group_scores<V>(kv, head, t, S, t.p0, t.p1, sc + lay.krow);
    if (t.phase == AttnTile::kSoftmax) {
        for (int64_t r = 0; r < t.nq; ++r) t.inv[r] = group_softmax<V>(S + r * L, t, r);
        return;
    }
    float inv_own[AttnScratch::kMaxHeads];
    float* inv = t.inv != nullptr ? t.inv : inv_own;
    if (t.phase == AttnTile::kWhole) {
        group_scores<V>(kv, head, t, S, 0, L, sc + lay.krow);
        for (int64_t r = 0; r < t.nq; ++r) inv[r] = group_softmax<V>(S + r * L, t, r);
    }
    group_v<V>(kv, head, t, S, inv, sc + lay.vrows);
}

template <class V>
void attn_heads(const KvCache& kv, int64_t head, const AttnTile& tile, float* sc) {
    if (tile.e1 > 0) return attn_group<V>(kv, head, tile, sc);
    if (tile.nq > 1 && V::W > 1) return attn_tile<V>(kv, head, tile, sc);
    // One query, or the scalar reference's tiles (one lane: cheaper query by query, within
    // the tile's scratch: scores [nq, Lmax], a row, the rotated queries).
    const int64_t D = kv.head_dim, H = kv.n_kv_heads, BS = kv.block_size;
    AttnTile t = tile;
    const int64_t Lmax = t.L0 + (t.nq - 1) / t.per;
    const AttnScratch lay(1, Lmax, D);
    float* row = t.nq == 1 ? sc + lay.krow : sc + t.nq * Lmax;  // one K or V row as float
    if (kv.rotate) {  // q . k and sum p v in the stored basis: rotate q now, the output after
        float* qr = t.nq == 1 ? sc + lay.qt : row + D;
        for (int64_t j = 0; j < t.nq; ++j) {
            std::memcpy(qr + j * D, tile_q(tile, j, D), static_cast<size_t>(D) * sizeof(float));
            hadamard_row(qr + j * D, D);
        }
        t.q = qr;
        t.qstride = t.per * D;
    }
    // scores, one key at a time
    for (int64_t p0 = 0, b = 0; p0 < Lmax; p0 += BS, ++b) {
        const int64_t n = BS < Lmax - p0 ? BS : Lmax - p0;
        const int64_t base = static_cast<int64_t>(kv.table[b]) * BS * H + head;
        for (int64_t s = 0; s < n; ++s) {
            const int64_t idx = base + s * H, p = p0 + s, j0 = first_active(t, p);
            if (kv.quantized && t.nq == 1) {  // convert in registers (same floats)
                const float dot = dot16<V>(t.q, kv.k + idx * D, D, [](const int8_t* x) { return V::load_i8(x); });
                sc[p] = (dot * k_scale_at<V>(kv, idx)) * t.scale;
                continue;
            }
            const float* kr;
            float ks = 1.0f;
            if (kv.quantized) {  // several queries: convert the row once
                const int8_t* kq = kv.k + idx * D;
                int64_t i = 0;
                for (; i + V::W <= D; i += V::W) V::store(row + i, V::load_i8(kq + i));
                for (; i < D; ++i) row[i] = static_cast<float>(kq[i]);
                kr = row;
                ks = k_scale_at<V>(kv, idx);
            } else {
                kr = kv.kf + idx * D;
            }
            for (int64_t tt = j0 / t.per, j = j0; j < t.nq; ++tt) {
                const float* qt = t.q + tt * t.qstride;
                for (int64_t r = 0; r < t.per; ++r, ++j) {
                    const float dot = dot16<V>(qt + r * D, kr, D, [](const float* x) { return V::load(x); });
                    sc[j * Lmax + p] = kv.quantized ? (dot * ks) * t.scale : dot * t.scale;
                }
            }
        }
    }
    // softmax numerators (soft-capped scores first; keys outside a sliding window get 0)
    for (int64_t j = 0; j < t.nq; ++j) {
        softmax_numerators<V>(sc + j * Lmax, t.L0 + j / t.per, t);
        float* o = tile_out(t, j, D);
        for (int64_t i = 0; i < D; ++i) o[i] = 0.0f;
    }
    const bool one = t.nq == 1 && kv.quantized;
    if (one && kv.v_group == 32 && D == 64) {
        attn_v_regs<V, 64, 32>(kv, head, Lmax, sc, t.out, row);
    } else if (one && kv.v_group == 32 && D == 128) {
        attn_v_regs<V, 128, 32>(kv, head, Lmax, sc, t.out, row);
    } else if (one && kv.v_group == 64 && D == 64) {
        attn_v_regs<V, 64, 64>(kv, head, Lmax, sc, t.out, row);
    } else if (one && kv.v_group == 128 && D == 128) {
        attn_v_regs<V, 128, 128>(kv, head, Lmax, sc, t.out, row);
    } else {
        attn_v_mem<V>(kv, head, t, sc, Lmax, row);
    }
    for (int64_t j = 0; j < t.nq; ++j) {
        const float z = sum16<V>(sc + j * Lmax, t.L0 + j / t.per);
        const float inv = 1.0f / z;
        const typename V::T vi = V::set1(inv);
        float* o = tile_out(t, j, D);
        int64_t i = 0;
        for (; i + V::W <= D; i += V::W) V::store(o + i, V::mul(V::load(o + i), vi));
        for (; i < D; ++i) o[i] = o[i] * inv;
        if (kv.rotate) hadamard_row(o, D);
    }
}

// ---- LoRA up-projection (infer.h LoraUpFn) ------------------------------------------------
// U vectors of outputs at once: independent add chains hide the add latency (r is small).
template <class V, bool I8, int U>
inline void lora_up_block(const LoraUp& b, const float* h, int64_t n, float* y) {
    using T = typename V::T;
    T acc[U];
    for (int u = 0; u < U; ++u) acc[u] = V::zero();
    for (int64_t j = 0; j < b.r; ++j) {
        const T hj = V::set1(h[j]);
        const int64_t row = j * b.N + n;
        for (int u = 0; u < U; ++u) {
            const T w = I8 ? V::load_i8(static_cast<const int8_t*>(b.codes) + row + u * V::W)
                           : V::load(static_cast<const float*>(b.codes) + row + u * V::W);
            acc[u] = V::add(acc[u], V::mul(hj, w));
        }
    }
    for (int u = 0; u < U; ++u) {
        float* yo = y + n + u * V::W;
        const T a = I8 ? V::mul(acc[u], V::load(b.scales + n + u * V::W)) : acc[u];
        V::store(yo, V::add(V::load(yo), a));
    }
}

template <class V, bool I8>
void lora_up_range(const LoraUp& b, const float* h, int64_t n0, int64_t n1, float* y) {
    int64_t n = n0;
    for (; n + 4 * V::W <= n1; n += 4 * V::W) lora_up_block<V, I8, 4>(b, h, n, y);
    for (; n + V::W <= n1; n += V::W) lora_up_block<V, I8, 1>(b, h, n, y);
    for (; n < n1; ++n) lora_up_block<VS, I8, 1>(b, h, n, y);
}

template <class V>
void lora_up_row(const LoraUp& b, const float* h, int64_t n0, int64_t n1, float* y) {
    if (b.scales != nullptr) return lora_up_range<V, true>(b, h, n0, n1, y);
    lora_up_range<V, false>(b, h, n0, n1, y);
}

}  // namespace
}  // namespace infer
}  // namespace edgepack

// Table helper: the generic kernels of ISA wrapper V plus the given matmul kernels.
#define EDGEPACK_INFER_TABLE(NAME, V, Q8B, Q8P, Q8G, FB, FP, FG)                                  \
    {                                                                                            \
        NAME, quant_act_row<V>, rmsnorm_row<V>, rmsnorm_quant_row<V>, swiglu_row<V>,             \
            swiglu_quant_row<V>, rope_row<V>, kv_write<V>, attn_heads<V>, Q8B, Q8P, Q8G, FB, FP, FG, \
            lora_up_row<V>, hadamard_rows<V>                                                     \
    }

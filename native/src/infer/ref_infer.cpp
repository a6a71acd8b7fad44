// Portable reference inference kernels.  The generic kernels (infer/generic.h) are
// instantiated with the scalar wrapper; the matmuls below are plain loops that spell out
// the integer-accumulation semantics every ISA override is tested against:
//
//  matmul_q8, block B = act group for int8 weights, min(act group, weight group) for int4:
//    isum_b = sum_{k in b} xq[k] * wq[k]   (exact int32; wq = c, nib - 8 or nib)
//    int8:   y = (sum_j xs[j] * isum_j) * w_scale[n]
//    int4 s: y = sum_b (xs[b] * d[b]) * isum_b
//    int4 a: y = sum_b ((xs[b] * d[b]) * isum_b + (xs[b] * m[b]) * xsum_b),
//            xsum_b = sum_{k in b} xq[k]
//  matmul_f32: y = sum_k x[k] w[k] with w dequantized exactly as codecs does for float
//    and int4 weights ((nib - 8) * d, nib * d + m); int8: (sum_k x[k] c[k]) * s[n].
//  then y = (y + bias[n]) + residual[t, n].
#include "../fp16.h"
#include "generic.h"
#include "infer.h"

namespace edgepack {
namespace infer {
namespace {

inline float finish(float acc, const GemmOut& o, int64_t t, int64_t n) {
    if (o.bias != nullptr) acc = acc + o.bias[n];
    if (o.residual != nullptr) acc = acc + o.residual[t * o.ldr + n];
    return acc;
}

inline int nib(const uint8_t* row, int64_t k) {
    const uint8_t b = row[k >> 1];
    return (k & 1) ? (b >> 4) : (b & 0x0f);
}

float q8_row(const WeightView& w, const ActQ8& x, int64_t t, int64_t n) {
    const int8_t* xq = x.q + t * x.K;
    const float* xs = x.s + t * (x.K / x.group);
    const int64_t K = w.K;
    if (w.enc == WEnc::i8) {
        const int8_t* c = static_cast<const int8_t*>(w.codes) + n * K;
        float acc = 0.0f;
        for (int64_t j = 0; j * x.group < K; ++j) {
            int32_t isum = 0;
            for (int64_t k = j * x.group; k < (j + 1) * x.group; ++k) isum += int32_t{xq[k]} * c[k];
            acc = acc + xs[j] * static_cast<float>(isum);
        }
        return acc * w.scales_f32[n];
    }
    const int64_t gw = w.group, B = x.group < gw ? x.group : gw, G = K / gw;
    const uint8_t* c = static_cast<const uint8_t*>(w.codes) + n * (K / 2);
    const bool asym = w.enc == WEnc::i4asym;
    float acc = 0.0f;
    for (int64_t b0 = 0; b0 < K; b0 += B) {
        int32_t isum = 0, xsum = 0;
        for (int64_t k = b0; k < b0 + B; ++k) {
            isum += int32_t{xq[k]} * (asym ? nib(c, k) : nib(c, k) - 8);
            xsum += xq[k];
        }
        const float s = xs[b0 / x.group];
        const float d = f16_to_f32(w.scales_f16[n * G + b0 / gw]);
        acc = acc + (s * d) * static_cast<float>(isum);
        if (asym) {
            const float m = f16_to_f32(w.zeros_f16[n * G + b0 / gw]);
            acc = acc + (s * m) * static_cast<float>(xsum);
        }
    }
    return acc;
}

float f32_row(const WeightView& w, const float* x, int64_t n) {
    const int64_t K = w.K;
    float acc = 0.0f;
    switch (w.enc) {
        case WEnc::f32: {
            const float* c = static_cast<const float*>(w.codes) + n * K;
            for (int64_t k = 0; k < K; ++k) acc = acc + x[k] * c[k];
            return acc;
        }
        case WEnc::f16: {
            const uint16_t* c = static_cast<const uint16_t*>(w.codes) + n * K;
            for (int64_t k = 0; k < K; ++k) acc = acc + x[k] * f16_to_f32(c[k]);
            return acc;
        }
        case WEnc::bf16: {
            const uint16_t* c = static_cast<const uint16_t*>(w.codes) + n * K;
            for (int64_t k = 0; k < K; ++k) acc = acc + x[k] * bits_f32(uint32_t{c[k]} << 16);
            return acc;
        }
        case WEnc::i8: {
            const int8_t* c = static_cast<const int8_t*>(w.codes) + n * K;
            for (int64_t k = 0; k < K; ++k) acc = acc + x[k] * static_cast<float>(c[k]);
            return acc * w.scales_f32[n];
        }
        case WEnc::i4sym:
        case WEnc::i4asym: {
            const int64_t g = w.group, G = K / g;
            const uint8_t* c = static_cast<const uint8_t*>(w.codes) + n * (K / 2);
            const bool asym = w.enc == WEnc::i4asym;
            for (int64_t k = 0; k < K; ++k) {
                const float d = f16_to_f32(w.scales_f16[n * G + k / g]);
                const float wk = asym ? static_cast<float>(nib(c, k)) * d + f16_to_f32(w.zeros_f16[n * G + k / g])
                                      : static_cast<float>(nib(c, k) - 8) * d;
                acc = acc + x[k] * wk;
            }
            return acc;
        }
    }
    return acc;
}

}  // namespace

namespace ref {

int64_t q8_prep_bytes(const WeightView&, int64_t) { return 0; }
void q8_prep(const WeightView&, const ActQ8&, int64_t, int64_t) {}

void q8_gemm(const WeightView& w, const ActQ8& x, int64_t n0, int64_t n1, const GemmOut& out) {
    for (int64_t t = 0; t < x.T; ++t) {
        for (int64_t n = n0; n < n1; ++n) out.y[t * out.ldy + n] = finish(q8_row(w, x, t, n), out, t, n);
    }
}

int64_t f32_prep_bytes(const WeightView&) { return 0; }
void f32_prep(const WeightView&, const ActF32&, int64_t, int64_t) {}

void f32_gemm(const WeightView& w, const ActF32& x, int64_t n0, int64_t n1, const GemmOut& out) {
    for (int64_t t = 0; t < x.T; ++t) {
        for (int64_t n = n0; n < n1; ++n) {
            out.y[t * out.ldy + n] = finish(f32_row(w, x.x + t * x.K, n), out, t, n);
        }
    }
}

}  // namespace ref

const InferTable& scalar_infer_table() {
    static const InferTable t = EDGEPACK_INFER_TABLE(
        "scalar", VS, ref::q8_prep_bytes, ref::q8_prep, ref::q8_gemm, ref::f32_prep_bytes,
        ref::f32_prep, ref::f32_gemm);
    return t;
}

}  // namespace infer
}  // namespace edgepack

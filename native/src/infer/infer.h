// Inference kernel interface shared by the portable reference (infer/ref_infer.cpp) and
// every ISA override (arch/<isa>/infer_<isa>.cpp).
//
// Kernels work on one row / one head / one block of output rows, never allocate, throw or
// touch Python.  The drivers in infer/ops.cpp split work across the thread pool and the
// bindings in infer/bind_infer.cpp validate every argument before a kernel sees it, so a
// kernel may assume the shapes and alignments documented here.
//
// Numerics contract (tested in tests/test_native_infer.py):
// * Activation quantization (quant_act, rmsnorm_quant, swiglu_quant, KV quantize-on-write)
//   is bit-identical across ISAs: every step is an elementwise IEEE operation or an exact
//   max, and scales follow edgepack.format.codecs (d = amax/127, q = clip(rint(x*(1/d)))).
// * Float reductions (RMSNorm sum of squares, attention q.k) use one canonical order: 16
//   lane partial sums (element k goes to lane k % 16, added in increasing k), folded
//   pairwise 16->8->4->2->1 (lane i + lane i+half).  Elementwise math is multiply then add,
//   never fused; exp uses one polynomial (infer/vecmath.h).  So RMSNorm, SwiGLU, RoPE and
//   attention are bit-identical across scalar/AVX2/AVX-512/NEON too.
// * The integer GEMV/GEMM accumulates exact int32 partial sums per block.  On AVX-512 and
//   NEON the int8-activation matmul then combines them with the float scales in the
//   reference's order (ref::q8_row), so its outputs are bit-identical to the reference;
//   elsewhere (AVX2, float activations) the combination happens in SIMD lanes, so matmul
//   outputs agree with the reference to within a stated tolerance
//   (|err| <= 2e-6 * sum|terms| + 1e-30), not bits.
//   Per output element the operation sequence does not depend on the token tile, the
//   number of tokens or the thread split, so GEMV and GEMM rows and any thread count give
//   bit-identical results on one ISA.
#pragma once

#include <cstdint>

#include "../encodings.h"  // WEnc: the weight encodings, generated from the registry
#include "../fp16.h"
#include "../kernels.h"

namespace edgepack {
namespace infer {

// One weight matrix [N, K] exactly as stored in a package (C-contiguous parts):
//   f32/f16/bf16: codes [N, K] (bf16 as uint16 bits)
//   i8:     codes int8 [N, K], scales f32 [N]                      w = c * s[n]
//   i4sym:  codes u8 [N, K/2] (low nibble = even k), scales f16 [N, K/g]
//                                                                  w = (nib - 8) * d
//   i4asym: as i4sym plus zeros (mins) f16 [N, K/g]                w = nib * d + m
struct WeightView {
    WEnc enc = WEnc::f32;
    int64_t N = 0, K = 0, group = 0;  // group: int4 group size; K for i8; 0 for floats
    const void* codes = nullptr;
    const float* scales_f32 = nullptr;   // i8
    const uint16_t* scales_f16 = nullptr;  // i4
    const uint16_t* zeros_f16 = nullptr;   // i4asym
};

// Where a GEMM writes: y[t, n] = acc (+ bias[n]) (+ residual[t, n]).  residual may alias y.
struct GemmOut {
    float* y = nullptr;
    int64_t ldy = 0;
    const float* residual = nullptr;
    int64_t ldr = 0;
    const float* bias = nullptr;  // [N]
};

// int8 activations [T, K] with float scales [T, K / group] (group divides K).
// `prep` is per-token scratch laid out privately by the ISA kernel that asked for it.
struct ActQ8 {
    int64_t T = 0, K = 0, group = 0;
    const int8_t* q = nullptr;  // row stride K
    const float* s = nullptr;   // row stride K / group
    uint8_t* prep = nullptr;
    int64_t prep_stride = 0;  // bytes per token
};

struct ActF32 {
    int64_t T = 0, K = 0;
    const float* x = nullptr;  // row stride K
    uint8_t* prep = nullptr;
    int64_t prep_stride = 0;
};

// Paged KV cache of one layer.  Position p of a sequence lives in physical block
// table[p / block_size], slot p % block_size; index (block, slot, head) is
// ((block * block_size + slot) * n_kv_heads + head).
//   quantized: k int8 [NB, BS, H, D], k_scale f32 [NB, BS, H],
//              v u8 [NB, BS, H, D/2] (low nibble = even d), v_scale f16|f32 [NB, BS, H, D/32]
//              k = q * k_scale; v = (nib - 8) * v_scale (group 32 along D)
//   v5 (layout "int8-v5"): k as above with k_scale16 f16 [NB, BS, H]; v nibbles as above plus
//              v_high u8 [NB, BS, H, D/8] (bit 4 of element i = bit i % 8 of byte i / 8),
//              v_scale and v_min f16 [NB, BS, H, D/32]: v = c * v_scale + v_min,
//              c = nib + 16 * bit (0..31)
//   v6 (layout "int8"): k as v5; v nibbles (low 4 bits of c) plus v_high u8 [NB, BS, H, D/4]
//              (bits 4-5 of element i = bits 2 (i % 4), 2 (i % 4) + 1 of byte i / 4) and
//              v_scale u8 [NB, BS, H, D/g] (e5m3: the float16 whose bits are byte << 7):
//              v = (c - 32) * v_scale, c = 0..63
//   float:     kf, vf f32 [NB, BS, H, D]
// V groups: v_group elements along D (a multiple of 8 dividing D; D/32 above is D/v_group).
// rotate (layout "int8"): K and V are stored Walsh-Hadamard rotated (hadamard_rows); the
// driver rotates them on write (ops.cpp: kv_write never sees the flag) and q / the output
// of a decode step; attn_heads rotates those of a tile (in its vector lanes).
struct KvCache {
    int64_t n_blocks = 0, block_size = 0, n_kv_heads = 0, head_dim = 0;
    int64_t v_group = 32;
    bool quantized = true;
    bool v_scale_f16 = true;
    bool v5 = false;
    bool v6 = false;
    bool rotate = false;
    uint16_t* k_scale16 = nullptr;  // v5, v6: K scales in float16 (k_scale unused)
    uint8_t* v_high = nullptr;
    uint16_t* v_min = nullptr;
    int8_t* k = nullptr;
    float* k_scale = nullptr;
    uint8_t* v = nullptr;
    void* v_scale = nullptr;
    float* kf = nullptr;
    float* vf = nullptr;
    const int32_t* table = nullptr;  // validated: every entry used is in [0, n_blocks)
    int64_t table_len = 0;

    float kscale(int64_t idx) const { return k_scale16 != nullptr ? f16_to_f32(k_scale16[idx]) : k_scale[idx]; }

    int64_t index(int64_t pos, int64_t head) const {
        const int64_t blk = table[pos / block_size];
        return (blk * block_size + pos % block_size) * n_kv_heads + head;
    }
};

// --- kernel signatures ---------------------------------------------------------------
// Row kernels.  Result.status == non_finite reports NaN/Inf in the row (col = element);
// scale_overflow a V scale that does not fit float16.
using QuantActFn = Result (*)(const float* x, int64_t K, int64_t group, int8_t* q, float* s);
using RmsNormFn = void (*)(const float* x, const float* w, int64_t K, float eps, float* y);
using RmsNormQuantFn = Result (*)(const float* x, const float* w, int64_t K, float eps,
                                  int64_t group, int8_t* q, float* s);
using SwigluFn = void (*)(const float* g, const float* u, int64_t F, float* y);
using SwigluQuantFn = Result (*)(const float* g, const float* u, int64_t F, int64_t group,
                                 int8_t* q, float* s);
// RoPE on one token: x[h * hstride + i], i < D, NeoX rotate-half, in place.
using RopeFn = void (*)(float* x, int64_t H, int64_t D, int64_t hstride, const float* cos,
                        const float* sin);
// Quantize (or copy) one token's K and V ([H, D] each, row stride kstride / vstride) into
// the cache at position pos.  Checks everything before writing anything.
using KvWriteFn = Result (*)(const KvCache& kv, int64_t pos, const float* k, int64_t kstride,
                             const float* v, int64_t vstride);
// A tile of queries attending to one kv head: query j (j < nq) is token j / per, head
// j % per of that token's group, at q + (j / per) * qstride + (j % per) * D, writes
// out + (j / per) * ostride + (j % per) * D, and sees positions [0, L0 + j / per).
struct AttnTile {
    const float* q = nullptr;
    int64_t qstride = 0;
    float* out = nullptr;
    int64_t ostride = 0;
    int64_t nq = 0, per = 1, L0 = 0;
    float scale = 0.0f;
    int64_t window = 0;    // > 0: query j sees only positions [L_j - window, L_j)
    float softcap = 0.0f;  // > 0: scores s -> softcap * tanh(s / softcap) before the softmax
    // e1 > 0: a group, the per heads of each of nq / per tokens (a decode step: one, rows
    // of D at q and out; a short pass: token strides qstride / ostride), and only output
    // elements [e0, e1) (multiples of 8) are written.
    int64_t e0 = 0, e1 = 0;
    // A decode step's kv head split over threads in phases (e1 > 0): kScores the positions
    // [p0, p1) of the heads' score rows S (rows of L0, shared), kSoftmax their numerators
    // and 1 / sums inv, kValues output elements [e0, e1) from them; kWhole all of it alone.
    enum Phase { kWhole, kScores, kSoftmax, kValues };
    Phase phase = kWhole;
    int64_t p0 = 0, p1 = 0;
    float* S = nullptr;
    float* inv = nullptr;
};
// The scratch of attn_heads (floats, offsets 64-byte aligned from a 64-byte aligned base)
// for nq queries over at most Lmax positions.  One query (decode): its scores and a K / V
// row.  A tile: the queries sit in vector lanes (query j in lane j % W of query vector
// j / W, lanes padded to kLanes): transposed queries, scores and output sums
// [d or position][lane], plus kVRows V rows converted to float with their scales.
struct AttnScratch {
    static constexpr int64_t kLanes = 16;  // a multiple of every ISA's vector width
    static constexpr int64_t kVRows = 32;
    static constexpr int64_t kMaxHeads = 16;  // query heads per kv head in one decode task
    int64_t lanes = 0, qt = 0, sc = 0, acc = 0, zinv = 0, krow = 0, vrows = 0, vscale = 0, vmin = 0;
    int64_t total = 0;
    AttnScratch(int64_t nq, int64_t Lmax, int64_t D) {
        if (nq == 1) {  // one token: the scores of up to kMaxHeads heads, a K and a V row,
            krow = Lmax * kMaxHeads;  // the rotated q
            vrows = krow + D;
            qt = krow + 8 * D;
            total = krow + 16 * D;
            return;
        }
        lanes = (nq + kLanes - 1) / kLanes * kLanes;
        const int64_t G = D;  // at most D V groups per row
        int64_t at = 0;
        auto take = [&at](int64_t n) { const int64_t o = at; at += (n + 15) / 16 * 16; return o; };
        qt = take(D * lanes);
        sc = take(Lmax * lanes);
        acc = take(D * lanes);
        zinv = take(lanes);
        krow = take(D);
        vrows = take(kVRows * D);
        vscale = take(kVRows * G);
        vmin = take(kVRows * G);
        total = at;
    }
};
using AttnHeadsFn = void (*)(const KvCache& kv, int64_t head, const AttnTile& tile, float* scratch);

// int8-activation GEMM.  prep_bytes == 0 means the kernel reads ActQ8.q/s directly.
using Q8PrepBytesFn = int64_t (*)(const WeightView& w, int64_t act_group);
using Q8PrepFn = void (*)(const WeightView& w, const ActQ8& x, int64_t t0, int64_t t1);
using Q8GemmFn = void (*)(const WeightView& w, const ActQ8& x, int64_t n0, int64_t n1,
                          const GemmOut& out);
using F32PrepBytesFn = int64_t (*)(const WeightView& w);
using F32PrepFn = void (*)(const WeightView& w, const ActF32& x, int64_t t0, int64_t t1);
using F32GemmFn = void (*)(const WeightView& w, const ActF32& x, int64_t n0, int64_t n1,
                           const GemmOut& out);

// A LoRA up-projection factor stored transposed, B^T [r, N] row-major (runtime_shim
// .adapters.LoraPair.b_t): int8 codes with per-output scales, or float32 (scales null).
struct LoraUp {
    const void* codes = nullptr;
    const float* scales = nullptr;  // [N]; non-null iff the codes are int8
    int64_t r = 0, N = 0;
};
// y[n] += scale[n] * sum_j h[j] * B^T[j, n] for n in [n0, n1): per output, mul then add
// in increasing j, then the scale, then the add to y, so bit-identical on every ISA.
using LoraUpFn = void (*)(const LoraUp& b, const float* h, int64_t n0, int64_t n1, float* y);
// The orthonormal Walsh-Hadamard transform (generic.h hadamard_row) of n rows of D in place.
using HadamardRowsFn = void (*)(float* x, int64_t n, int64_t D);

// The dispatch table of inference kernels of one ISA; every entry is filled.  Selected
// together with the quantization KernelTable of the same name (dispatch.cpp).
struct InferTable {
    const char* name;
    QuantActFn quant_act;
    RmsNormFn rmsnorm;
    RmsNormQuantFn rmsnorm_quant;
    SwigluFn swiglu;
    SwigluQuantFn swiglu_quant;
    RopeFn rope;
    KvWriteFn kv_write;
    AttnHeadsFn attn_heads;
    Q8PrepBytesFn q8_prep_bytes;
    Q8PrepFn q8_prep;
    Q8GemmFn q8_gemm;
    F32PrepBytesFn f32_prep_bytes;
    F32PrepFn f32_prep;
    F32GemmFn f32_gemm;
    LoraUpFn lora_up;
    HadamardRowsFn hadamard_rows;
};

const InferTable& scalar_infer_table();
#if defined(EDGEPACK_HAVE_AVX2)
const InferTable& avx2_infer_table();
#endif
#if defined(EDGEPACK_HAVE_AVX512)
const InferTable& avx512_infer_table();
#endif
#if defined(EDGEPACK_HAVE_AMX)
const InferTable& amx_infer_table();  // avx512's, with the AMX tile GEMM as q8_gemm
#endif
#if defined(EDGEPACK_HAVE_NEON)
const InferTable& neon_infer_table();
#endif

// Reference matmul entry points, called by ISA kernels for shapes they do not cover.
namespace ref {
int64_t q8_prep_bytes(const WeightView& w, int64_t act_group);
void q8_prep(const WeightView& w, const ActQ8& x, int64_t t0, int64_t t1);
void q8_gemm(const WeightView& w, const ActQ8& x, int64_t n0, int64_t n1, const GemmOut& out);
int64_t f32_prep_bytes(const WeightView& w);
void f32_prep(const WeightView& w, const ActF32& x, int64_t t0, int64_t t1);
void f32_gemm(const WeightView& w, const ActF32& x, int64_t n0, int64_t n1, const GemmOut& out);
}  // namespace ref

}  // namespace infer
}  // namespace edgepack

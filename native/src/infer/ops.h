// Multi-threaded drivers of the inference kernels: the C++ API behind the Python bindings
// and the whole-layer entry point.  Arguments are already validated; call without the GIL.
// Numeric failures come back as a Result (row = token / head, col = element / group).
#pragma once

#include <cstdint>

#include "infer.h"

namespace edgepack {
namespace infer {

const InferTable& active();

// Row-strided float matrix view [rows, cols] (inner stride 1).
struct Rows {
    const float* p = nullptr;
    int64_t ld = 0;
};

Result quant_act(Rows x, int64_t T, int64_t K, int64_t group, int8_t* q, float* s);
void rmsnorm(Rows x, const float* w, int64_t T, int64_t K, float eps, float* y, int64_t ldy);
Result rmsnorm_quant(Rows x, const float* w, int64_t T, int64_t K, float eps, int64_t group,
                     int8_t* q, float* s);
void swiglu(Rows g, Rows u, int64_t T, int64_t F, float* y, int64_t ldy);
Result swiglu_quant(Rows g, Rows u, int64_t T, int64_t F, int64_t group, int8_t* q, float* s);
// act(g) * u for the gated activations other than SiLU, as the numpy reference computes
// them (runtime_shim.kernels.activations): act in double, rounded to float, times u.
enum class GatedAct : int { gelu = 1, gelu_tanh = 2, relu = 3 };
void gated_act(Rows g, Rows u, int64_t T, int64_t F, GatedAct act, float* y, int64_t ldy);

// x[t * tstride + h * hstride + i]; cos/sin [T, D/2] (row t for token t).
void rope(float* x, int64_t T, int64_t tstride, int64_t H, int64_t hstride, int64_t D,
          const float* cos, const float* sin);
// cos/sin [n, D/2] of angle float32(pos[i]) * inv_freq[j] (cos/sin evaluated in double).
void rope_table(const int64_t* pos, int64_t n, const float* inv_freq, int64_t half, float* cos,
                float* sin);

void matmul_q8(const WeightView& w, const ActQ8& x, const GemmOut& out);
// matmul_q8 of n weights on the same activations of a small pass (a decode step, prompt
// lookup's verify pass: matmul_q8_shared_fits), as one pool job: the tasks are each
// weight's own chunks (so every output has matmul_q8's bits), one barrier for all, and
// weights too small to split run on another thread than the caller's.
constexpr int kSharedMaxWeights = 4;  // n of matmul_q8_shared: 1..4
bool matmul_q8_shared_fits(const ActQ8& x);
void matmul_q8_shared(const WeightView* const* ws, const GemmOut* outs, int n, const ActQ8& x);
void matmul_f32(const WeightView& w, const ActF32& x, const GemmOut& out);
// y = U (V x): V [r, K], U [N, r]; the [T, r] intermediate stays internal.
void lowrank(const WeightView& u, const WeightView& v, const ActF32& x, const GemmOut& out);
// A LoRA adapter's up-projection: y[t, n] += scale[n] * sum_j h[t, j] * B^T[j, n] (h [T, r]).
void lora_up(const LoraUp& b, const float* h, int64_t T, float* y, int64_t ldy);

// Write T tokens (k/v [T, Hkv, D] with token strides) at positions start.. start+T-1 and
// attend causally: query t sees positions [0, start + t].  q [T, Hq, D] (token stride
// qts), out [T, Hq, D] contiguous.  Nothing is written when a value is non-finite.
struct AttnArgs {
    const float* q = nullptr;
    int64_t qts = 0;
    const float* k = nullptr;
    int64_t kts = 0;
    const float* v = nullptr;
    int64_t vts = 0;
    int64_t T = 0, n_heads = 0, start = 0;
    float scale = 0.0f;
    float* out = nullptr;
    int64_t window = 0;    // sliding window (0: none): query t sees [start + t + 1 - window, start + t]
    float softcap = 0.0f;  // score soft-capping (0: none)
    // Where a rotating cache (KvCache::rotate) puts its rotated q, k and v ([T, heads, D]
    // floats each): the caller's buffers (a planned arena's), or nullptr: per-thread scratch.
    float* rot_q = nullptr;
    float* rot_k = nullptr;
    float* rot_v = nullptr;
};
Result kv_append(const KvCache& kv, const AttnArgs& a);
void attend(const KvCache& kv, const AttnArgs& a);  // after kv_append
Result attention(const KvCache& kv, const AttnArgs& a);

// The float32 argmax of a row of n >= 1 as numpy's: the first maximum, or the first NaN.
int64_t argmax_first(const float* r, int64_t n);
// argmax_first of each of `rows` rows of n (Stack.run's picks).
void argmax_rows(const float* y, int64_t rows, int64_t n, int64_t* picks);

// Reads n bytes with the pool (memory-bandwidth probe for benchmarks); returns a checksum.
uint64_t read_probe(const uint8_t* p, int64_t n);

// Positions [0, L) of the cache as float [L, Hkv, D] each (for tests and references).
void kv_read(const KvCache& kv, int64_t L, float* k, float* v);

}  // namespace infer
}  // namespace edgepack

// Drivers: split each op into tasks with fixed index ranges (so the result never depends
// on the thread count), run them on the persistent pool, and own all scratch memory.
#include "ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <vector>

#include "../dispatch.h"
#include "../threadpool.h"
#include "generic.h"

namespace edgepack {
namespace infer {
namespace {

constexpr int64_t kParallelMin = 1 << 15;  // elements (or MACs / 8) below which one thread runs

ThreadPool& pool() { return ThreadPool::instance(); }

// Grow-only 64-byte-aligned per-thread buffers; slot separates nested users.
uint8_t* scratch(int slot, int64_t bytes) {
    struct Buf {
        uint8_t* p = nullptr;
        int64_t n = 0;
        ~Buf() { std::free(p); }
    };
    thread_local Buf bufs[7];
    Buf& b = bufs[slot];
    if (b.n < bytes) {
        std::free(b.p);
        const int64_t n = (std::max<int64_t>(bytes, 4096) + 63) & ~int64_t{63};
        b.p = static_cast<uint8_t*>(std::aligned_alloc(64, static_cast<size_t>(n)));
        if (b.p == nullptr) {
            b.n = 0;
            throw std::bad_alloc();
        }
        b.n = n;
    }
    return b.p;
}

// Run row kernel fn(t) -> Result over T rows; returns the first failure in row order.
template <class Fn>
Result rows_parallel(int64_t T, int64_t work_per_row, Fn fn) {
    if (T * work_per_row < kParallelMin || T == 1) {
        for (int64_t t = 0; t < T; ++t) {
            Result r = fn(t);
            if (r.status != Status::ok) {
                r.row = t;
                return r;
            }
        }
        return {};
    }
    std::vector<Result> first(static_cast<size_t>(T));
    const int64_t grain = std::max<int64_t>(1, kParallelMin / 4 / std::max<int64_t>(1, work_per_row));
    pool().parallel_for(T, grain, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) first[static_cast<size_t>(t)] = fn(t);
    });
    for (int64_t t = 0; t < T; ++t) {
        if (first[static_cast<size_t>(t)].status != Status::ok) {
            Result r = first[static_cast<size_t>(t)];
            r.row = t;
            return r;
        }
    }
    return {};
}

}  // namespace

const InferTable& active() { return active_infer_table(); }

Result quant_act(Rows x, int64_t T, int64_t K, int64_t group, int8_t* q, float* s) {
    const InferTable& tb = active();
    return rows_parallel(T, K, [&](int64_t t) {
        return tb.quant_act(x.p + t * x.ld, K, group, q + t * K, s + t * (K / group));
    });
}

void rmsnorm(Rows x, const float* w, int64_t T, int64_t K, float eps, float* y, int64_t ldy) {
    const InferTable& tb = active();
    rows_parallel(T, K, [&](int64_t t) {
        tb.rmsnorm(x.p + t * x.ld, w, K, eps, y + t * ldy);
        return Result{};
    });
}

Result rmsnorm_quant(Rows x, const float* w, int64_t T, int64_t K, float eps, int64_t group,
                     int8_t* q, float* s) {
    const InferTable& tb = active();
    return rows_parallel(T, K, [&](int64_t t) {
        return tb.rmsnorm_quant(x.p + t * x.ld, w, K, eps, group, q + t * K, s + t * (K / group));
    });
}

void swiglu(Rows g, Rows u, int64_t T, int64_t F, float* y, int64_t ldy) {
    const InferTable& tb = active();
    rows_parallel(T, 8 * F, [&](int64_t t) {
        tb.swiglu(g.p + t * g.ld, u.p + t * u.ld, F, y + t * ldy);
        return Result{};
    });
}

namespace {
// erf in double: Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7), the numpy reference's.
double erf_as(double x) {
    const double a = std::fabs(x);
    const double t = 1.0 / (1.0 + 0.3275911 * a);
    double poly = t * (-1.453152027 + t * 1.061405429);
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + poly)));
    const double r = 1.0 - poly * std::exp(-a * a);
    return x > 0 ? r : (x < 0 ? -r : 0.0 * r);
}

float act_of(float gf, GatedAct act) {
    if (act == GatedAct::relu) return gf < 0.0f ? 0.0f : gf;
    const double g = gf;
    if (act == GatedAct::gelu_tanh) {
        const double c = std::sqrt(2.0 / 3.14159265358979323846);
        return static_cast<float>(0.5 * g * (1.0 + std::tanh(c * (g + 0.044715 * g * g * g))));
    }
    return static_cast<float>(0.5 * g * (1.0 + erf_as(g * std::sqrt(0.5))));
}
}  // namespace

void gated_act(Rows g, Rows u, int64_t T, int64_t F, GatedAct act, float* y, int64_t ldy) {
    rows_parallel(T, 32 * F, [&](int64_t t) {
        const float* gr = g.p + t * g.ld;
        const float* ur = u.p + t * u.ld;
        float* yr = y + t * ldy;
        for (int64_t i = 0; i < F; ++i) yr[i] = act_of(gr[i], act) * ur[i];
        return Result{};
    });
}

Result swiglu_quant(Rows g, Rows u, int64_t T, int64_t F, int64_t group, int8_t* q, float* s) {
    const InferTable& tb = active();
    return rows_parallel(T, 8 * F, [&](int64_t t) {
        return tb.swiglu_quant(g.p + t * g.ld, u.p + t * u.ld, F, group, q + t * F,
                               s + t * (F / group));
    });
}

void rope(float* x, int64_t T, int64_t tstride, int64_t H, int64_t hstride, int64_t D,
          const float* cos, const float* sin) {
    const InferTable& tb = active();
    const int64_t half = D / 2;
    rows_parallel(T, H * D, [&](int64_t t) {
        tb.rope(x + t * tstride, H, D, hstride, cos + t * half, sin + t * half);
        return Result{};
    });
}

void rope_table(const int64_t* pos, int64_t n, const float* inv_freq, int64_t half, float* cos,
                float* sin) {
    for (int64_t i = 0; i < n; ++i) {
        const float p = static_cast<float>(pos[i]);
        for (int64_t j = 0; j < half; ++j) {
            const double a = static_cast<double>(p * inv_freq[j]);
            cos[i * half + j] = static_cast<float>(std::cos(a));
            sin[i * half + j] = static_cast<float>(std::sin(a));
        }
    }
}

void matmul_q8(const WeightView& w, const ActQ8& xin, const GemmOut& out) {
    const InferTable& tb = active();
    ActQ8 x = xin;
    const int64_t pb = tb.q8_prep_bytes(w, x.group);
    if (pb > 0) {
        if (x.prep == nullptr) x.prep = scratch(0, x.T * pb);  // else the caller's T * pb bytes (a planned slot)
        x.prep_stride = pb;
        if (x.T * x.K < kParallelMin) {
            tb.q8_prep(w, x, 0, x.T);
        } else {
            pool().parallel_for(x.T, 4, [&](int64_t t0, int64_t t1) { tb.q8_prep(w, x, t0, t1); });
        }
    }
    if (w.N * w.K * x.T < 8 * kParallelMin) {
        tb.q8_gemm(w, x, 0, w.N, out);
        return;
    }
    pool().parallel_for(w.N, 16, [&](int64_t n0, int64_t n1) { tb.q8_gemm(w, x, n0, n1, out); }, 2);
}

bool matmul_q8_shared_fits(const ActQ8& x) { return x.T >= 1 && x.T * x.K < kParallelMin; }

void matmul_q8_shared(const WeightView* const* ws, const GemmOut* outs, int n, const ActQ8& xin) {
    constexpr int kMax = kSharedMaxWeights;
    if (n < 1 || n > kMax || !matmul_q8_shared_fits(xin)) throw std::logic_error("matmul_q8_shared: 1..4 weights, a small pass");
    const InferTable& tb = active();
    struct Task {
        int w;
        int64_t n0, n1;
    };
    struct Job {
        ActQ8 x[kMax];
        const WeightView* const* ws;
        const GemmOut* outs;
        std::vector<Task> tasks;
        const InferTable* tb;
    } job;
    job.ws = ws;
    job.outs = outs;
    job.tb = &tb;
    int64_t off = 0;
    for (int i = 0; i < n; ++i) {  // each weight's prep in its own part of one buffer
        job.x[i] = xin;
        const int64_t pb = tb.q8_prep_bytes(*ws[i], xin.group);
        job.x[i].prep_stride = pb;
        off += (xin.T * pb + 63) & ~int64_t{63};
    }
    uint8_t* prep = scratch(0, std::max<int64_t>(off, 1));
    off = 0;
    for (int i = 0; i < n; ++i) {
        const WeightView& w = *ws[i];
        if (job.x[i].prep_stride > 0) {
            job.x[i].prep = prep + off;
            off += (xin.T * job.x[i].prep_stride + 63) & ~int64_t{63};
            tb.q8_prep(w, job.x[i], 0, xin.T);  // serial, as matmul_q8 at this size
        }
        // matmul_q8's split of this weight (one chunk where it runs on one thread)
        const int64_t chunks = w.N * w.K * xin.T < 8 * kParallelMin ? 1 : pool().chunk_count(w.N, 16, 2);
        for (int64_t c = 0; c < chunks; ++c) job.tasks.push_back({i, c * w.N / chunks, (c + 1) * w.N / chunks});
    }
    pool().run(static_cast<int64_t>(job.tasks.size()), [](void* p, int64_t t) {
        const Job& j = *static_cast<const Job*>(p);
        const Task& k = j.tasks[static_cast<size_t>(t)];
        j.tb->q8_gemm(*j.ws[k.w], j.x[k.w], k.n0, k.n1, j.outs[k.w]);
    }, &job);
}

void matmul_f32(const WeightView& w, const ActF32& xin, const GemmOut& out) {
    const InferTable& tb = active();
    ActF32 x = xin;
    const int64_t pb = tb.f32_prep_bytes(w);
    if (pb > 0) {
        x.prep = scratch(1, x.T * pb);
        x.prep_stride = pb;
        tb.f32_prep(w, x, 0, x.T);
    }
    if (w.N * w.K * x.T < 8 * kParallelMin) {
        tb.f32_gemm(w, x, 0, w.N, out);
        return;
    }
    pool().parallel_for(w.N, 16, [&](int64_t n0, int64_t n1) { tb.f32_gemm(w, x, n0, n1, out); }, 2);
}

void lowrank(const WeightView& u, const WeightView& v, const ActF32& x, const GemmOut& out) {
    const int64_t r = v.N;
    auto* h = reinterpret_cast<float*>(scratch(2, x.T * r * static_cast<int64_t>(sizeof(float))));
    GemmOut mid;
    mid.y = h;
    mid.ldy = r;
    matmul_f32(v, x, mid);
    ActF32 hx;
    hx.T = x.T;
    hx.K = r;
    hx.x = h;
    matmul_f32(u, hx, out);
}

void lora_up(const LoraUp& b, const float* h, int64_t T, float* y, int64_t ldy) {
    const InferTable& tb = active();
    auto rows = [&](int64_t n0, int64_t n1) {
        for (int64_t t = 0; t < T; ++t) tb.lora_up(b, h + t * b.r, n0, n1, y + t * ldy);
    };
    if (b.N * b.r * T < 8 * kParallelMin) return rows(0, b.N);
    pool().parallel_for(b.N, 64, rows, 2);
}

// [T, H, D] rows (token stride ts) rotated into `into` (nullptr: scratch of the given slot).
static const float* rotated(int slot, float* into, const float* x, int64_t ts, int64_t T, int64_t H, int64_t D) {
    auto* r = into != nullptr ? into : reinterpret_cast<float*>(scratch(slot, T * H * D * static_cast<int64_t>(sizeof(float))));
    const InferTable& tb = active();
    rows_parallel(T, 8 * H * D, [&](int64_t t) {
        for (int64_t h = 0; h < H; ++h) std::memcpy(r + (t * H + h) * D, x + t * ts + h * D, static_cast<size_t>(D) * sizeof(float));
        tb.hadamard_rows(r + t * H * D, H, D);
        return Result{};
    });
    return r;
}

Result kv_append(const KvCache& kv_in, const AttnArgs& a_in) {
    const InferTable& tb = active();
    const int64_t H = kv_in.n_kv_heads, D = kv_in.head_dim;
    KvCache kv = kv_in;
    AttnArgs a = a_in;
    if (kv.rotate) {  // the stored basis: K and V rotated, then quantized as usual
        kv.rotate = false;
        a.k = rotated(4, a.rot_k, a.k, a.kts, a.T, H, D);
        a.v = rotated(5, a.rot_v, a.v, a.vts, a.T, H, D);  // (attend's rotated q reuses slot 5 later)
        a.kts = a.vts = H * D;
    }
    const int64_t n = kv.v_group;
    // All-or-nothing: check every token before the first write (kv_write re-checks its own).
    for (int64_t t = 0; t < a.T; ++t) {
        for (int64_t h = 0; h < H; ++h) {
            const float* kr = a.k + t * a.kts + h * D;
            const float* vr = a.v + t * a.vts + h * D;
            if (VS::max_abs_bits(kr, D) >= kNonFinite) return {Status::non_finite, t, h};
            if (VS::max_abs_bits(vr, D) >= kNonFinite) return {Status::non_finite, t, H + h};
        }
    }
    if (kv.v6) {
        for (int64_t t = 0; t < a.T; ++t) {
            for (int64_t h = 0; h < H; ++h) {
                if (v6_overflows(a.k + t * a.kts + h * D, a.v + t * a.vts + h * D, D, n)) return {Status::scale_overflow, t, h};
            }
        }
    } else if (kv.v5) {
        for (int64_t t = 0; t < a.T; ++t) {
            for (int64_t h = 0; h < H; ++h) {
                if (v5_overflows(a.k + t * a.kts + h * D, a.v + t * a.vts + h * D, D, n)) return {Status::scale_overflow, t, h};
            }
        }
    } else if (kv.quantized && kv.v_scale_f16) {
        for (int64_t t = 0; t < a.T; ++t) {
            for (int64_t h = 0; h < H; ++h) {
                for (int64_t g = 0; g < D / n; ++g) {
                    const float* vg = a.v + t * a.vts + h * D + g * n;
                    if (f16_is_inf(f32_to_f16(vg[v_peak(vg, n)] / -8.0f))) return {Status::scale_overflow, t, g};
                }
            }
        }
    }
    rows_parallel(a.T, 4 * H * D, [&](int64_t t) {
        return tb.kv_write(kv, a.start + t, a.k + t * a.kts, D, a.v + t * a.vts, D);
    });
    return {};
}

// A decode step's or a short pass's grouped attention (every query of a kv head, its T
// tokens' query heads, as one group: each K / V row converted once for all of them) over
// the threads in two phases, so no score is computed twice: the score rows of every kv
// head by position halves (the half that ends last runs their softmax), then the V sums
// by output halves (attn_group's operations, so the same bits; one thread when `split`
// is false).
static void attend_phased(const KvCache& kv, const AttnArgs& a, int64_t bytes, bool split) {
    const InferTable& tb = active();
    const int64_t Hq = a.n_heads, D = kv.head_dim, Hkv = kv.n_kv_heads, rep = Hq / Hkv, L = a.start + a.T;
    const int64_t nq = a.T * rep;  // a kv head's queries: token j / rep, head j % rep
    constexpr int64_t kHalves = 2;
    const int64_t mid = L / kHalves / 16 * 16;  // (a multiple of 16: group_scores16's batches)
    auto* S = reinterpret_cast<float*>(scratch(6, (Hkv * nq * L + Hkv * nq) * static_cast<int64_t>(sizeof(float))));
    float* inv = S + Hkv * nq * L;
    const auto tile_of = [&](int64_t g, AttnTile::Phase phase) {
        AttnTile t;
        t.scale = a.scale;
        t.window = a.window;
        t.softcap = a.softcap;
        t.q = a.q + g * rep * D;
        t.qstride = a.qts;
        t.out = a.out + g * rep * D;
        t.ostride = Hq * D;
        t.nq = nq;
        t.per = rep;
        t.L0 = a.start + 1;
        t.e1 = D;
        t.phase = phase;
        t.S = S + g * nq * L;
        t.inv = inv + g * nq;
        return t;
    };
    const auto run = [&](int64_t tasks, auto&& task) {
        const int64_t chunks = split ? pool().chunk_count(tasks, 1, 1) : 1;
        pool().parallel_chunks(tasks, chunks, [&](int64_t, int64_t i0, int64_t i1) {
            auto* sc = reinterpret_cast<float*>(scratch(3, bytes));  // this thread's
            for (int64_t i = i0; i < i1; ++i) task(i, sc);
        });
    };
    std::vector<std::atomic<int>> scored(static_cast<size_t>(Hkv));  // halves done per kv head
    run(Hkv * kHalves, [&](int64_t i, float* sc) {
        const int64_t g = i / kHalves;
        AttnTile t = tile_of(g, AttnTile::kScores);
        t.p0 = i % kHalves == 0 ? 0 : mid;
        t.p1 = i % kHalves == 0 ? mid : L;
        tb.attn_heads(kv, g, t, sc);
        // The last half of a kv head to finish runs its softmax (no barrier between).
        if (scored[static_cast<size_t>(g)].fetch_add(1, std::memory_order_acq_rel) != kHalves - 1) return;
        t.phase = AttnTile::kSoftmax;
        tb.attn_heads(kv, g, t, sc);
    });
    run(Hkv * kHalves, [&](int64_t i, float* sc) {
        AttnTile t = tile_of(i / kHalves, AttnTile::kValues);
        t.e0 = (i % kHalves) * (D / kHalves);
        t.e1 = t.e0 + D / kHalves;
        tb.attn_heads(kv, i / kHalves, t, sc);
    });
}

void attend(const KvCache& kv_in, const AttnArgs& a_in) {
    const InferTable& tb = active();
    KvCache kv = kv_in;
    AttnArgs a = a_in;
    const int64_t Hq = a.n_heads, D = kv.head_dim, Hkv = kv.n_kv_heads, rep = Hq / Hkv;
    const bool decode = a.T == 1;
    // Decode: one task per kv head (with 2+ threads: attend_phased's phases) with all of
    // its query heads (one without GQA), so each K / V row is converted once for them (a
    // short pass: for every token's, see `pass`).  Prefill: one task per (kv head, tile of
    // tokens) with all of its query heads (the queries fill vector lanes), so each K / V
    // row is converted once per tile.  Every query's arithmetic is the same either way.
    const int64_t work = Hq * a.T * (a.start + a.T) * D;
    const bool group = decode && rep <= AttnScratch::kMaxHeads;
    const bool split = work >= kParallelMin && pool().threads() > 1;
    const bool phased = group && split && D % 16 == 0;  // (the bits do not depend on it)
    // A short pass (prompt lookup's verify pass): the decode step's group with every token's
    // query heads, phased over the threads (its queries would fill few vector lanes of a
    // tile, and a tile per kv head keeps one of two threads waiting).
    constexpr int64_t kGroupPass = 8;  // (T = 9, 27 queries in 32 lanes: cheaper as tiles)
    const bool pass = !decode && a.T <= kGroupPass && D % 16 == 0 && rep <= AttnScratch::kMaxHeads;
    if ((decode || pass) && kv.rotate) {  // (a tile rotates q and its output in its lanes itself)
        kv.rotate = false;
        a.q = rotated(5, a.rot_q, a.q, a.qts, a.T, Hq, D);
        a.qts = Hq * D;
    }
    // A pass of a few tokens whose rep * T queries take more than one 16-lane vector (prompt
    // lookup's verify passes not taken by `pass`: T = 9 and more with 3 query heads per kv
    // head, or from T = 6 when D is not a multiple of 16) is cut into
    // tiles that fill one each: with only n_kv_heads tasks, the threads would wait on the
    // last, twice as long; more tiles convert the K / V rows more often, which costs less.
    constexpr int64_t kTile = 32, kLanes = 16, kSmallPass = 15;
    const bool small = !decode && split && a.T <= kSmallPass && a.T * rep > kLanes;
    const int64_t tile_tokens = small ? std::max<int64_t>(1, kLanes / rep) : kTile;
    const int64_t tiles = decode ? 1 : (a.T + tile_tokens - 1) / tile_tokens;
    const int64_t tasks = group ? Hkv : decode ? Hq : Hkv * tiles;
    const int64_t chunks = (!split || tasks == 1) ? 1 : pool().chunk_count(tasks, 1, decode ? 1 : 8);
    const int64_t Lmax = a.start + a.T;
    const int64_t bytes = AttnScratch(decode || pass ? 1 : rep * std::min(tile_tokens, a.T), Lmax, D).total * static_cast<int64_t>(sizeof(float));
    if (phased || pass) {
        attend_phased(kv, a, bytes, split);
    } else pool().parallel_chunks(tasks, chunks, [&](int64_t, int64_t i0, int64_t i1) {
        auto* sc = reinterpret_cast<float*>(scratch(3, bytes));  // this thread's
        for (int64_t i = i0; i < i1; ++i) {
            AttnTile t;
            t.scale = a.scale;
            t.window = a.window;
            t.softcap = a.softcap;
            if (group) {
                const int64_t g = i;
                t.q = a.q + g * rep * D;
                t.out = a.out + g * rep * D;
                t.nq = t.per = rep;
                t.L0 = a.start + 1;
                t.e1 = D;
                tb.attn_heads(kv, g, t, sc);
                continue;
            }
            if (decode) {
                t.q = a.q + i * D;
                t.out = a.out + i * D;
                t.nq = 1;
                t.L0 = a.start + 1;
                tb.attn_heads(kv, i / rep, t, sc);
                continue;
            }
            // Tiles run from the last (longest) to the first so the heaviest go out first.
            const int64_t g = i % Hkv, tile = tiles - 1 - i / Hkv;
            const int64_t t0 = tile * tile_tokens, nt = std::min(tile_tokens, a.T - t0);
            t.q = a.q + t0 * a.qts + g * rep * D;
            t.qstride = a.qts;
            t.out = a.out + (t0 * Hq + g * rep) * D;
            t.ostride = Hq * D;
            t.nq = nt * rep;
            t.per = rep;
            t.L0 = a.start + t0 + 1;
            tb.attn_heads(kv, g, t, sc);
        }
    });
    if (kv_in.rotate && (decode || pass)) {
        tb.hadamard_rows(a.out, a.T * Hq, D);
    }
}

Result attention(const KvCache& kv, const AttnArgs& a) {
    const Result r = kv_append(kv, a);
    if (r.status != Status::ok) return r;
    attend(kv, a);
    return {};
}

namespace {
int64_t argmax_scan(const float* r, int64_t from, int64_t best, int64_t n) {
    for (int64_t i = from; i < n; ++i) {
        if (std::isnan(r[i])) return i;
        if (r[i] > r[best]) best = i;
    }
    return best;
}
}  // namespace

// A verify pass takes the argmax of T rows of the vocabulary (49152 for SmolLM2): the
// scalar scan cost ~36 us a row, serial after the head.  Blocks of 256 reduce in 16 lanes
// (GCC vector extensions: SSE2 / NEON, any build) to their maximum (`v > m ? v : m`, no
// NaN among them, else the scalar scan of the whole row); the first block whose maximum
// exceeds all earlier ones holds the first maximum (equal values, +-0 included, stay in
// the earlier block), and the scalar scan continues from its first element equal to it
// through the tail: numpy's result.
int64_t argmax_first(const float* r, int64_t n) {
    typedef float F4 __attribute__((vector_size(16)));
    typedef int32_t I4 __attribute__((vector_size(16)));
    constexpr int64_t kBlock = 256;
    float best_max = 0.0f;
    int64_t best_block = -1, b = 0;
    for (; b + kBlock <= n; b += kBlock) {
        F4 lm[4];
        I4 nan[4];
        for (int j = 0; j < 4; ++j) {
            std::memcpy(&lm[j], r + b + 4 * j, sizeof(F4));
            nan[j] = lm[j] != lm[j];
        }
        for (int64_t i = b + 16; i < b + kBlock; i += 16) {
            for (int j = 0; j < 4; ++j) {
                F4 v;
                std::memcpy(&v, r + i + 4 * j, sizeof(F4));
                nan[j] |= v != v;
                lm[j] = v > lm[j] ? v : lm[j];
            }
        }
        const I4 any = nan[0] | nan[1] | nan[2] | nan[3];
        if ((any[0] | any[1] | any[2] | any[3]) != 0) return argmax_scan(r, 0, 0, n);
        float m = lm[0][0];
        for (int j = 0; j < 4; ++j) {
            for (int l = 0; l < 4; ++l) m = lm[j][l] > m ? lm[j][l] : m;
        }
        if (best_block < 0 || m > best_max) {
            best_max = m;
            best_block = b;
        }
    }
    int64_t best = 0;
    if (best_block >= 0) {
        for (best = best_block; !(r[best] == best_max); ++best) {
        }
    }
    return argmax_scan(r, b, best, n);
}

void argmax_rows(const float* y, int64_t rows, int64_t n, int64_t* picks) {
    for (int64_t t = 0; t < rows; ++t) picks[t] = argmax_first(y + t * n, n);
}

uint64_t read_probe(const uint8_t* p, int64_t n) {
    const int64_t words = n / 8;
    const int64_t chunks = pool().chunk_count(words, 1 << 16, 1);
    std::vector<uint64_t> part(static_cast<size_t>(std::max<int64_t>(chunks, 1)), 0);
    pool().parallel_chunks(words, chunks, [&](int64_t c, int64_t i0, int64_t i1) {
        uint64_t a[8] = {};
        int64_t i = i0;
        for (; i + 8 <= i1; i += 8) {
            for (int j = 0; j < 8; ++j) {
                uint64_t v;
                std::memcpy(&v, p + 8 * (i + j), 8);
                a[j] += v;
            }
        }
        for (; i < i1; ++i) {
            uint64_t v;
            std::memcpy(&v, p + 8 * i, 8);
            a[0] += v;
        }
        part[static_cast<size_t>(c)] = a[0] ^ a[1] ^ a[2] ^ a[3] ^ a[4] ^ a[5] ^ a[6] ^ a[7];
    });
    uint64_t r = 0;
    for (uint64_t v : part) r ^= v;
    return r;
}

void kv_read(const KvCache& kv, int64_t L, float* k, float* v) {
    const int64_t H = kv.n_kv_heads, D = kv.head_dim, n = kv.v_group, G = D / n;
    for (int64_t p = 0; p < L; ++p) {
        for (int64_t h = 0; h < H; ++h) {
            const int64_t idx = kv.index(p, h);
            float* ko = k + (p * H + h) * D;
            float* vo = v + (p * H + h) * D;
            if (!kv.quantized) {
                std::copy(kv.kf + idx * D, kv.kf + (idx + 1) * D, ko);
                std::copy(kv.vf + idx * D, kv.vf + (idx + 1) * D, vo);
                continue;
            }
            for (int64_t i = 0; i < D; ++i) ko[i] = static_cast<float>(kv.k[idx * D + i]) * kv.kscale(idx);
            for (int64_t g = 0; g < G; ++g) {
                const float d = v_scale_at(kv, idx * G + g);
                decode_v_group<VS>(kv, idx, g, vo + g * n);
                for (int64_t i = 0; i < n; ++i) {
                    vo[g * n + i] = kv.v5 ? vo[g * n + i] * d + f16_to_f32(kv.v_min[idx * G + g]) : vo[g * n + i] * d;
                }
            }
            if (kv.rotate) {  // back from the stored basis
                hadamard_row(ko, D);
                hadamard_row(vo, D);
            }
        }
    }
}

}  // namespace infer
}  // namespace edgepack

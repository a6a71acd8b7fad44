// AMX (AMX-TILE + AMX-INT8) int8-activation GEMM, bit-identical to ref::q8_gemm.
//
// Everything else in the "amx" table is the AVX-512 table's; so is q8_gemm for shapes the
// tiles do not cover and for token counts where the VNNI kernels are faster (use_small's
// lower bound).  Two tile layouts: few tokens of int8 weights (T <= 16, "swapped", below)
// take the weights as the A tile; many (T >= kMinTokens, unless swapped) take them as B:
//
// Big path: A = 16 tokens x ks bytes of the activations, loaded straight from ActQ8.q (stride
// K); B = one panel of 16 weight rows in the VNNI layout [K/4][16 rows][4 bytes] (int8 as
// stored; int4 nibbles unpacked to nib - 8 (sym) or nib (asym)), repacked once per panel
// and reused by every token tile; C = 16 tokens x 16 rows of exact int32 block sums (one
// TDPBSSD per ks <= 64 elements of a block).  Each C is stored and combined into 16 float
// accumulators (one per token, lanes = weight rows) in the reference order: per block
// acc = acc + (s * d) * float(isum) (asym: + (s * m) * float(xsum)), int8
// acc = acc + s * float(isum) then acc * w_scale; separate multiplies and adds, so the
// output bits are those of ref::q8_row for every tile shape, token count and thread split.
#include <immintrin.h>

#include <cstring>

#include "../../infer/infer.h"
#include "../avx512/transpose16.h"

namespace edgepack {
namespace infer {
namespace {

// Smallest token count that takes the big path (use_small goes first): below it the
// swapped tiles or the VNNI kernels are faster, since every call repacks each weight panel (a fixed cost per call that only many token tiles
// pay back).  Measured on 2026-12-01 in the whole SmolLM2 forward (one pass of T tokens
// after 200, 2 threads, amx vs avx512 in turn): int4-g32 T = 4 12.1 vs 7.7 ms, T = 8 14.8
// vs 12.7, T = 12 18.2 vs 17.4, T = 16 19.4 vs 21.2; the int8 package crosses between 12
// and 16 too (one small matrix alone, in bench/kernels.py, crossed at T = 4).
// At most 16: the tests take every T >= 16 as a tile GEMM.
constexpr int64_t kMinTokens = 16;
static_assert(kMinTokens <= 16, "tests/native/test_native_amx.py takes T >= 16 as tiles");
// The panel buffer lives on the stack: K * 16 bytes (64 KiB at the limit).
constexpr int64_t kMaxK = 4096;
// Per-panel weight scales (one 16-lane vector per weight group).
constexpr int64_t kMaxGroups = 256;

// The block layout of one weight matrix against one activation grouping.
struct Plan {
    bool ok = false;
    int64_t block = 0;  // B: elements per exact int32 sum
    int64_t ks = 0;     // elements per TDPBSSD (a multiple of 4 <= 64 dividing B)
};

Plan plan_for(const WeightView& w, int64_t ga) {
    Plan p;
    const int64_t K = w.K;
    const bool i8 = w.enc == WEnc::i8;
    if (!i8 && w.enc != WEnc::i4sym && w.enc != WEnc::i4asym) return p;
    const int64_t B = i8 ? ga : (ga < w.group ? ga : w.group);
    if (B <= 0 || B % 4 != 0 || K % B != 0 || K > kMaxK) return p;
    if (!i8 && (K % 8 != 0 || K / w.group > kMaxGroups)) return p;
    p.block = B;
    for (p.ks = 64; B % p.ks != 0; p.ks -= 4) {
    }
    p.ok = true;
    return p;
}

bool use_tiles(const WeightView& w, const ActQ8& x) {
    return x.T >= kMinTokens && plan_for(w, x.group).ok;
}

bool use_small(const WeightView& w, const ActQ8& x);

struct alignas(64) TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Tiles 0-3: C (nt tokens x 16 int32); 4, 5: A (nt tokens x ks bytes); 6, 7: B.
void configure(int nt, int64_t ks) {
    TileConfig c;
    for (int i = 0; i < 4; ++i) {
        c.rows[i] = static_cast<uint8_t>(nt);
        c.colsb[i] = 64;
    }
    for (int i = 4; i < 6; ++i) {
        c.rows[i] = static_cast<uint8_t>(nt);
        c.colsb[i] = static_cast<uint16_t>(ks);
        c.rows[2 + i] = static_cast<uint8_t>(ks / 4);
        c.colsb[2 + i] = 64;
    }
    // Not _tile_loadconfig: GCC's version tells the compiler it reads one byte, so the
    // stores to the rest of the config may be dropped (seen at -O2).
    __asm__ volatile("ldtilecfg %0" : : "m"(c));
}

// The weights of rows [n, n + nr) in the VNNI layout: dword (q, r) = elements 4q..4q+3 of
// row r as signed bytes (int4: nib - 8 sym, nib asym); rows nr..15 are zero.  A 16 x 16
// dword transpose of 16 rows' next 64 code bytes (int8: 16 quads; int4: 32 quads, two per
// dword, whose nibbles are then spread to bytes).
template <WEnc E>
void repack(const WeightView& w, int64_t n, int nr, int8_t* panel) {
    constexpr bool I8 = E == WEnc::i8;
    constexpr int64_t step = I8 ? 64 : 128;  // elements per 64 code bytes
    const int64_t K = w.K, rb = I8 ? K : K / 2;
    const uint8_t* base = static_cast<const uint8_t*>(w.codes) + n * rb;
    // int4: code bytes 0, 1 (2, 3) of each dword to 16-bit lanes; (u | u << 4) & 0x0f0f
    // then puts a byte's low nibble (the even element) in the low byte, the high nibble
    // in the high byte: elements 4q..4q+3 in order.
    const __m512i sel0 = _mm512_broadcast_i32x4(_mm_setr_epi8(0, -128, 1, -128, 4, -128, 5, -128, 8, -128, 9, -128, 12, -128, 13, -128));
    const __m512i sel1 = _mm512_broadcast_i32x4(_mm_setr_epi8(2, -128, 3, -128, 6, -128, 7, -128, 10, -128, 11, -128, 14, -128, 15, -128));
    const __m512i m4 = _mm512_set1_epi16(0x0f0f);
    const __m512i eight = _mm512_set1_epi8(8);
    auto spread = [&](__m512i u) {
        const __m512i v = _mm512_ternarylogic_epi32(u, _mm512_slli_epi16(u, 4), m4, 0xa8);
        return E == WEnc::i4sym ? _mm512_sub_epi8(v, eight) : v;
    };
    for (int64_t k = 0; k < K; k += step) {
        const int64_t left = K - k < step ? K - k : step;  // int8: a multiple of 4; int4: of 8
        const int64_t bytes = I8 ? left : left / 2;
        const __mmask64 m = bytes == 64 ? ~__mmask64{0} : (uint64_t{1} << bytes) - 1;
        __m512i r[16];
        for (int i = 0; i < 16; ++i) {
            r[i] = i < nr ? _mm512_maskz_loadu_epi8(m, base + i * rb + (I8 ? k : k / 2)) : _mm512_setzero_si512();
        }
        transpose16(r);
        int8_t* out = panel + 16 * k;
        for (int j = 0; j < bytes / 4; ++j) {
            if constexpr (I8) {
                _mm512_store_si512(out + 64 * j, r[j]);
            } else {
                _mm512_store_si512(out + 128 * j, spread(_mm512_shuffle_epi8(r[j], sel0)));
                _mm512_store_si512(out + 128 * j + 64, spread(_mm512_shuffle_epi8(r[j], sel1)));
            }
        }
    }
}

// f16 values [n * G + g] of rows n..n+nr as float vectors out[g][r] (rows >= nr zero):
// 16 groups of 16 rows converted, then transposed.
void transpose_scales(const uint16_t* src, int64_t n, int nr, int64_t G, float* out) {
    const uint16_t* base = src + n * G;
    for (int64_t g0 = 0; g0 < G; g0 += 16) {
        const int64_t ng = G - g0 < 16 ? G - g0 : 16;
        const __mmask16 m = static_cast<__mmask16>((1u << ng) - 1u);
        __m512i r[16];
        for (int i = 0; i < 16; ++i) {
            r[i] = i < nr ? _mm512_castps_si512(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, base + i * G + g0)))
                          : _mm512_setzero_si512();
        }
        transpose16(r);
        for (int j = 0; j < ng; ++j) _mm512_store_si512(out + 16 * (g0 + j), r[j]);
    }
}

// One call's fixed inputs.
struct Ctx {
    const WeightView& w;
    const ActQ8& x;
    const GemmOut& out;
    int64_t B, ks, gw;
    const int8_t* panel;
    const float* dsc;  // [G][16]
    const float* msc;  // [G][16], asym
};

// C tile `ct` = the int32 sums of block i for the token tile at a (A tile `at`, B tile
// `bt`).  A macro: GCC's tile intrinsics take the tile number as a literal.
#define EDGEPACK_BLOCK_SUMS(ct, at, bt, c, a, i)                       \
    do {                                                               \
        const int64_t k0_ = (i) * (c).B;                               \
        _tile_zero(ct);                                                \
        for (int64_t k_ = k0_; k_ < k0_ + (c).B; k_ += (c).ks) {       \
            _tile_loadd(at, (a) + k_, (c).w.K);                        \
            _tile_loadd(bt, (c).panel + 16 * k_, 64);                  \
            _tile_dpbssd(ct, at, bt);                                  \
        }                                                              \
    } while (0)

// Tokens [t0, t0 + nt) x rows [n, n + nr); NT = 16 (a full tile, accumulators in
// registers) or 0 (nt at run time).
template <int NT, bool I8, bool ASYM>
void token_tile(const Ctx& c, int64_t t0, int nt_rt, int64_t n, int nr) {
    const int nt = NT != 0 ? NT : nt_rt;
    const ActQ8& x = c.x;
    const int64_t K = c.w.K, ga = x.group, nb = K / c.B, ns = K / ga;
    const int8_t* a = x.q + t0 * K;
    const float* srow[16];
    const float* xsum[16];
    for (int t = 0; t < 16; ++t) {
        const int64_t tt = t < nt ? t0 + t : t0;
        srow[t] = x.s + tt * ns;
        xsum[t] = ASYM ? reinterpret_cast<const float*>(x.prep + tt * x.prep_stride) : nullptr;
    }
    __m512 acc[16];
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
    alignas(64) int32_t cbuf[4][16][16];
    auto combine = [&](int64_t i, const int32_t (*cb)[16]) {
        const int64_t b0 = i * c.B, ja = b0 / ga;
        if constexpr (I8) {
            for (int t = 0; t < nt; ++t) {
                const __m512 f = _mm512_cvtepi32_ps(_mm512_load_si512(cb[t]));
                acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_set1_ps(srow[t][ja]), f));
            }
        } else {
            const int64_t jw = b0 / c.gw;
            const __m512 dv = _mm512_load_ps(c.dsc + 16 * jw);
            const __m512 mv = ASYM ? _mm512_load_ps(c.msc + 16 * jw) : dv;
            for (int t = 0; t < nt; ++t) {
                const __m512 f = _mm512_cvtepi32_ps(_mm512_load_si512(cb[t]));
                const __m512 s = _mm512_set1_ps(srow[t][ja]);
                acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_mul_ps(s, dv), f));
                if (ASYM) {
                    acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_mul_ps(s, mv), _mm512_set1_ps(xsum[t][i])));
                }
            }
        }
    };
    // Two stages: the sums of the next two blocks are issued (C2, C3 or C0, C1) before the
    // two in hand are stored and combined, so the tile unit's latency overlaps the float
    // work.  The blocks are still combined in order.
    auto issue01 = [&](int64_t i) {
        if (i < nb) EDGEPACK_BLOCK_SUMS(0, 4, 6, c, a, i);
        if (i + 1 < nb) EDGEPACK_BLOCK_SUMS(1, 5, 7, c, a, i + 1);
    };
    auto issue23 = [&](int64_t i) {
        if (i < nb) EDGEPACK_BLOCK_SUMS(2, 4, 6, c, a, i);
        if (i + 1 < nb) EDGEPACK_BLOCK_SUMS(3, 5, 7, c, a, i + 1);
    };
    auto drain01 = [&](int64_t i) {
        if (i < nb) _tile_stored(0, cbuf[0], 64);
        if (i + 1 < nb) _tile_stored(1, cbuf[1], 64);
        if (i < nb) combine(i, cbuf[0]);
        if (i + 1 < nb) combine(i + 1, cbuf[1]);
    };
    auto drain23 = [&](int64_t i) {
        if (i < nb) _tile_stored(2, cbuf[2], 64);
        if (i + 1 < nb) _tile_stored(3, cbuf[3], 64);
        if (i < nb) combine(i, cbuf[2]);
        if (i + 1 < nb) combine(i + 1, cbuf[3]);
    };
    issue01(0);
    for (int64_t i = 0; i < nb; i += 4) {
        issue23(i + 2);
        drain01(i);
        issue01(i + 4);
        drain23(i + 2);
    }
    const __mmask16 rm = static_cast<__mmask16>((1u << nr) - 1u);
    const GemmOut& o = c.out;
    const __m512 ws = I8 ? _mm512_maskz_loadu_ps(rm, c.w.scales_f32 + n) : _mm512_setzero_ps();
    for (int t = 0; t < nt; ++t) {
        __m512 v = I8 ? _mm512_mul_ps(acc[t], ws) : acc[t];
        if (o.bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(rm, o.bias + n));
        if (o.residual != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(rm, o.residual + (t0 + t) * o.ldr + n));
        _mm512_mask_storeu_ps(o.y + (t0 + t) * o.ldy + n, rm, v);
    }
}

#undef EDGEPACK_BLOCK_SUMS

template <bool I8, bool ASYM>
void tiles_gemm(const WeightView& w, const ActQ8& x, int64_t n0, int64_t n1, const GemmOut& out, const Plan& p) {
    alignas(64) int8_t panel[kMaxK * 16];
    alignas(64) float dsc[I8 ? 16 : kMaxGroups * 16];
    alignas(64) float msc[ASYM ? kMaxGroups * 16 : 16];
    const int64_t gw = I8 ? w.K : w.group, G = w.K / gw;
    const Ctx c{w, x, out, p.block, p.ks, gw, panel, dsc, msc};
    int configured = 0;
    for (int64_t n = n0; n < n1; n += 16) {
        const int nr = n1 - n < 16 ? static_cast<int>(n1 - n) : 16;
        if constexpr (I8) {
            repack<WEnc::i8>(w, n, nr, panel);
        } else {
            repack<ASYM ? WEnc::i4asym : WEnc::i4sym>(w, n, nr, panel);
            transpose_scales(w.scales_f16, n, nr, G, dsc);
            if (ASYM) transpose_scales(w.zeros_f16, n, nr, G, msc);
        }
        for (int64_t t0 = 0; t0 < x.T; t0 += 16) {
            const int nt = x.T - t0 < 16 ? static_cast<int>(x.T - t0) : 16;
            if (nt != configured) {
                configure(nt, p.ks);
                configured = nt;
            }
            if (nt == 16) {
                token_tile<16, I8, ASYM>(c, t0, nt, n, nr);
            } else {
                token_tile<0, I8, ASYM>(c, t0, nt, n, nr);
            }
        }
    }
    if (configured != 0) _tile_release();
}

// ---- Few tokens of int8 weights (use_small: T = 9..16): the roles swapped ----
//
// A = 16 weight rows x ks bytes, row-major as stored: tile-loaded straight from the mapped
// codes (stride K; a tail panel copied, zero-padded); B = the
// T tokens' codes in the VNNI layout [K/4][T][4], transposed once per call by q8_prep;
// C = 16 rows x T tokens of exact int32 block sums, stored densely ([row][token], 4T bytes
// a row: T vectors of 16 lanes) and combined in that layout.  Lane e of vector v holds
// row e / T, token e % T (e = 16 v + lane); the per-token scales and the per-row weight
// scales reach it by a permute.  Same operations and order per element as the big path.

// The token counts that take the swapped tiles (outside: avx512 below, the big path
// above).  Per matrix (SmolLM2-135M's shapes, 1 thread, ms per forward, amx vs avx512):
//   int8 layers T = 3/4/8/16: 4.1/4.4/5.5/7.8 vs 4.1/5.1/9.9/20.1 (big path at 16: 10.4)
//   int8 head   T = 3/4/6/16: 1.4/1.5/1.7/2.7 vs 1.1/1.4/1.9/6.2  (big path at 16: 5.7)
// but in the whole forward (/tmp/costT.py: one pass of T tokens after 200, 2 threads,
// amx vs avx512 in turn, 2026-12-01 21:57, load 1.7) the int8 package crossed at T = 9:
// T = 4/8/9/12/16 11.2-11.4/13.7-13.9/13.3-13.5/15.9-16.3/17.4-18.3 vs 9.3-9.4/13.0-13.6/
// 14.2-14.3/17.4-18.1/22.3-22.4 ms.  int4 weights never take them: their rows had to be
// spread from nibbles and stored for the tile loads, and the avx512 kernels were faster
// at every T = 2..16 in the same runs (sym g32 T = 8: 12.9-13.5 vs 10.2-10.7 ms; asym g32
// T = 8: 14.3-14.4 vs 11.5-12.4 ms); that path was removed.
// Tried and reverted (commit 3405e44): two 32-element blocks per TDPBSSD (block-diagonal
// activations), half the tile work: int8 T = 4/8 4.6/5.3 ms, no gain at the crossover.
constexpr int64_t kSmallMin = 9, kSmallMax = 16;
static_assert(kSmallMin == 9 && kSmallMax <= 16, "small_gemm_t has the cases 9..16 (tiles hold <= 16 tokens)");

bool use_small(const WeightView& w, const ActQ8& x) {
    return w.enc == WEnc::i8 && x.T >= kSmallMin && x.T <= kSmallMax && plan_for(w, x.group).ok;
}

// The prep of the swapped path (T tokens): codes [K/4][T][4] bytes, then the activation
// scales [K / ga][T] floats.
struct SmallPrep {
    int8_t* codes;
    float* scales;
};

SmallPrep small_prep_of(const ActQ8& x) {
    const int64_t T = x.T, K = x.K;
    int8_t* q = reinterpret_cast<int8_t*>(x.prep);
    float* s = reinterpret_cast<float*>(q + T * K);
    return {q, s};
}

int64_t small_prep_bytes(const WeightView& w, int64_t ga) {
    const Plan p = plan_for(w, ga);
    if (!p.ok || w.enc != WEnc::i8) return 0;
    return w.K + w.K / ga * 4;
}

void small_prep(const WeightView& w, const ActQ8& x, int64_t t0, int64_t t1) {
    const int64_t T = x.T, K = x.K, ns = K / x.group;
    const SmallPrep sp = small_prep_of(x);
    const __m512i lanes = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(static_cast<int>(T)));
    for (int64_t t = t0; t < t1; ++t) {
        const int8_t* q = x.q + t * K;
        int32_t* dst = reinterpret_cast<int32_t*>(sp.codes) + t;
        for (int64_t k = 0; k < K; k += 64) {
            const int64_t nq = K - k >= 64 ? 16 : (K - k) / 4;
            const __mmask16 m = static_cast<__mmask16>(nq == 16 ? 0xffff : (1u << nq) - 1u);
            const __m512i v = _mm512_maskz_loadu_epi32(m, q + k);
            _mm512_mask_i32scatter_epi32(dst + k / 4 * T, m, lanes, v, 4);
        }
        for (int64_t j = 0; j < ns; ++j) sp.scales[j * T + t] = x.s[t * ns + j];
    }
}

// Tiles 0-3: C (16 rows x 4T bytes); 4, 5: A (16 rows x ks bytes); 6, 7: B (ks / 4 rows x 4T).
void configure_small(int64_t T, int64_t ks) {
    TileConfig c;
    for (int i = 0; i < 4; ++i) {
        c.rows[i] = 16;
        c.colsb[i] = static_cast<uint16_t>(4 * T);
    }
    for (int i = 4; i < 6; ++i) {
        c.rows[i] = 16;
        c.colsb[i] = static_cast<uint16_t>(ks);
        c.rows[2 + i] = static_cast<uint8_t>(ks / 4);
        c.colsb[2 + i] = static_cast<uint16_t>(4 * T);
    }
    __asm__ volatile("ldtilecfg %0" : : "m"(c));
}

// A tail panel's rows [n, n + nr) with stride K, rows nr..15 zero.
void tail_rows(const WeightView& w, int64_t n, int nr, int8_t* rows) {
    const int64_t K = w.K;
    std::memcpy(rows, static_cast<const int8_t*>(w.codes) + n * K, static_cast<size_t>(nr * K));
    std::memset(rows + nr * K, 0, static_cast<size_t>((16 - nr) * K));
}

#define EDGEPACK_SMALL_SUMS(ct, at, bt, i)                             \
    do {                                                               \
        const int64_t k0_ = (i) * B;                                   \
        _tile_zero(ct);                                                \
        for (int64_t k_ = k0_; k_ < k0_ + B; k_ += ks) {               \
            _tile_loadd(at, arow + k_, astride);                       \
            _tile_loadd(bt, xb + k_ * T, 4 * T);                       \
            _tile_dpbssd(ct, at, bt);                                  \
        }                                                              \
    } while (0)

template <int T>
void small_gemm(const WeightView& w, const ActQ8& x, int64_t n0, int64_t n1, const GemmOut& out, const Plan& p) {
    alignas(64) int8_t rows[kMaxK * 16];
    alignas(64) int32_t cbuf[8][16 * T];
    alignas(64) int32_t ridx[T][16], tidx[T][16], gidx[T][16];
    for (int e = 0; e < 16 * T; ++e) {
        ridx[e / 16][e % 16] = e / T;
        tidx[e / 16][e % 16] = e % T;
    }
    for (int t = 0; t < T; ++t) {
        for (int r = 0; r < 16; ++r) gidx[t][r] = r * T + t;
    }
    const int64_t K = w.K, B = p.block, ks = p.ks, nb = K / B, ga = x.group;
    const SmallPrep sp = small_prep_of(x);
    const int8_t* xb = sp.codes;
    const __mmask16 tm = static_cast<__mmask16>((1u << T) - 1u);
    configure_small(T, ks);
    for (int64_t n = n0; n < n1; n += 16) {
        const int nr = n1 - n < 16 ? static_cast<int>(n1 - n) : 16;
        const int8_t* arow = rows;
        const int64_t astride = K;
        if (nr == 16) {
            arow = static_cast<const int8_t*>(w.codes) + n * K;
        } else {
            tail_rows(w, n, nr, rows);
        }
        __m512 acc[T];
        for (int v = 0; v < T; ++v) acc[v] = _mm512_setzero_ps();
        auto combine = [&](int64_t i, const int32_t* cb) {
            const int64_t b0 = i * B, ja = b0 / ga;
            const __m512 sv = _mm512_maskz_loadu_ps(tm, sp.scales + ja * T);
            for (int v = 0; v < T; ++v) {
                const __m512 f = _mm512_cvtepi32_ps(_mm512_load_si512(cb + 16 * v));
                const __m512 s = _mm512_permutexvar_ps(_mm512_load_si512(tidx[v]), sv);
                acc[v] = _mm512_add_ps(acc[v], _mm512_mul_ps(s, f));
            }
        };
        // Pairs of blocks (2s, 2s + 1) alternate between C tiles 0, 1 and 2, 3; a pair's
        // sums are issued one pair ahead and combined two pairs after their store (a
        // vector load right after a tile store waits for it), in block order.
        auto issue = [&](int64_t s) {
            const int64_t i = 2 * s;
            if (s & 1) {
                EDGEPACK_SMALL_SUMS(2, 4, 6, i);
                if (i + 1 < nb) EDGEPACK_SMALL_SUMS(3, 5, 7, i + 1);
            } else {
                EDGEPACK_SMALL_SUMS(0, 4, 6, i);
                if (i + 1 < nb) EDGEPACK_SMALL_SUMS(1, 5, 7, i + 1);
            }
        };
        auto store = [&](int64_t s) {
            int32_t* cb = cbuf[2 * (s & 3)];
            const bool two = 2 * s + 1 < nb;
            if (s & 1) {
                _tile_stored(2, cb, 4 * T);
                if (two) _tile_stored(3, cb + 16 * T, 4 * T);
            } else {
                _tile_stored(0, cb, 4 * T);
                if (two) _tile_stored(1, cb + 16 * T, 4 * T);
            }
        };
        auto drain = [&](int64_t s) {
            const int32_t* cb = cbuf[2 * (s & 3)];
            combine(2 * s, cb);
            if (2 * s + 1 < nb) combine(2 * s + 1, cb + 16 * T);
        };
        const int64_t np = (nb + 1) / 2;
        issue(0);
        for (int64_t s = 0; s < np; ++s) {
            if (s + 1 < np) issue(s + 1);
            store(s);
            if (s >= 2) drain(s - 2);
        }
        if (np >= 2) drain(np - 2);
        drain(np - 1);
        alignas(64) float ab[16 * T];
        const __mmask16 rm = static_cast<__mmask16>((1u << nr) - 1u);
        const __m512 ws = _mm512_maskz_loadu_ps(rm, w.scales_f32 + n);
        for (int v = 0; v < T; ++v) {
            const __m512 a = _mm512_mul_ps(acc[v], _mm512_permutexvar_ps(_mm512_load_si512(ridx[v]), ws));
            _mm512_store_ps(ab + 16 * v, a);
        }
        for (int t = 0; t < T; ++t) {
            __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), rm, _mm512_load_si512(gidx[t]), ab, 4);
            if (out.bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(rm, out.bias + n));
            if (out.residual != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(rm, out.residual + t * out.ldr + n));
            _mm512_mask_storeu_ps(out.y + t * out.ldy + n, rm, v);
        }
    }
    _tile_release();
}

#undef EDGEPACK_SMALL_SUMS

void small_gemm_t(const WeightView& w, const ActQ8& x, int64_t n0, int64_t n1, const GemmOut& out, const Plan& p) {
    switch (x.T) {
#define EDGEPACK_SMALL_CASE(t) \
    case t:                    \
        return small_gemm<t>(w, x, n0, n1, out, p);
        EDGEPACK_SMALL_CASE(9)
        EDGEPACK_SMALL_CASE(10)
        EDGEPACK_SMALL_CASE(11)
        EDGEPACK_SMALL_CASE(12)
        EDGEPACK_SMALL_CASE(13)
        EDGEPACK_SMALL_CASE(14)
        EDGEPACK_SMALL_CASE(15)
        EDGEPACK_SMALL_CASE(16)
#undef EDGEPACK_SMALL_CASE
        default:
            return;
    }
}

const InferTable& base() { return avx512_infer_table(); }

// Asym only: float(sum of the block's activation codes) per token and block.
int64_t tile_prep_bytes(const WeightView& w, int64_t ga) {
    const Plan p = plan_for(w, ga);
    return p.ok && w.enc == WEnc::i4asym ? w.K / p.block * 4 : 0;
}

void tile_prep(const WeightView& w, const ActQ8& x, int64_t t0, int64_t t1) {
    if (w.enc != WEnc::i4asym) return;
    const int64_t K = x.K, B = plan_for(w, x.group).block, nb = K / B;
    const __m512i ones = _mm512_set1_epi8(1);
    alignas(64) int32_t quads[kMaxK / 4];
    for (int64_t t = t0; t < t1; ++t) {
        const int8_t* q = x.q + t * K;
        for (int64_t k = 0; k < K; k += 64) {
            const __mmask64 m = K - k >= 64 ? ~__mmask64{0} : (uint64_t{1} << (K - k)) - 1;
            const __m512i v = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_maskz_loadu_epi8(m, q + k));
            _mm512_mask_storeu_epi32(quads + k / 4, static_cast<__mmask16>(K - k >= 64 ? 0xffff : (1u << ((K - k) / 4)) - 1u), v);
        }
        float* xs = reinterpret_cast<float*>(x.prep + t * x.prep_stride);
        for (int64_t i = 0; i < nb; ++i) {
            int32_t s = 0;
            for (int64_t j = i * B / 4; j < (i + 1) * B / 4; ++j) s += quads[j];
            xs[i] = static_cast<float>(s);
        }
    }
}

int64_t q8_prep_bytes(const WeightView& w, int64_t ga) {
    const int64_t a = base().q8_prep_bytes(w, ga), b = tile_prep_bytes(w, ga), c = small_prep_bytes(w, ga);
    return a > b ? (a > c ? a : c) : (b > c ? b : c);
}

void q8_prep(const WeightView& w, const ActQ8& x, int64_t t0, int64_t t1) {
    if (use_small(w, x)) return small_prep(w, x, t0, t1);
    if (use_tiles(w, x)) return tile_prep(w, x, t0, t1);
    base().q8_prep(w, x, t0, t1);
}

void q8_gemm(const WeightView& w, const ActQ8& x, int64_t n0, int64_t n1, const GemmOut& out) {
    if (use_small(w, x)) {
        const Plan p = plan_for(w, x.group);
        return small_gemm_t(w, x, n0, n1, out, p);
    }
    if (!use_tiles(w, x)) return base().q8_gemm(w, x, n0, n1, out);
    const Plan p = plan_for(w, x.group);
    if (w.enc == WEnc::i8) return tiles_gemm<true, false>(w, x, n0, n1, out, p);
    if (w.enc == WEnc::i4asym) return tiles_gemm<false, true>(w, x, n0, n1, out, p);
    tiles_gemm<false, false>(w, x, n0, n1, out, p);
}

}  // namespace

const InferTable& amx_infer_table() {
    static const InferTable t = [] {
        InferTable r = base();
        r.name = "amx";
        r.q8_prep_bytes = q8_prep_bytes;
        r.q8_prep = q8_prep;
        r.q8_gemm = q8_gemm;
        return r;
    }();
    return t;
}

}  // namespace infer
}  // namespace edgepack

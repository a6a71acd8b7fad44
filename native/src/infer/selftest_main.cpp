// Standalone self-test of the inference kernel tables against the reference, without
// Python: used to check the NEON path by cross-compiling for AArch64 and running under
// qemu (tests/test_native_infer.py::test_neon_kernels_under_qemu), and usable on any ISA.
// Not part of the extension build.
//
//   aarch64-linux-gnu-g++ -std=c++17 -O2 -ffp-contract=off -static -DEDGEPACK_HAVE_NEON
//       native/src/infer/selftest_main.cpp native/src/infer/ref_infer.cpp
//       native/src/arch/neon/infer_neon.cpp -o selftest && qemu-aarch64 ./selftest
//
// Checks: every generic kernel (the LoRA up-projection too) bit-identical to the reference; matmul_q8 bit-identical
// for NEON and AVX-512 (same block order as the reference) and within 1e-5 * sum|terms| elsewhere;
// matmul_f32 within 1e-4 of the largest output (a loose smoke bound; the Python tests
// check the stated per-element bounds).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../fp16.h"
#include "infer.h"

#if defined(EDGEPACK_HAVE_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#endif

using namespace edgepack;
using namespace edgepack::infer;

namespace {

int failures = 0;

void fail(const std::string& what) {
    std::printf("FAIL %s\n", what.c_str());
    ++failures;
}

template <class T>
bool same(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

std::mt19937 gen(1234);

std::vector<float> randn(size_t n, float scale = 1.0f) {
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<float> v(n);
    for (float& x : v) x = d(gen);
    return v;
}

void check_rows(const InferTable& ref, const InferTable& t) {
    const std::string name = t.name;
    for (int64_t K : {576, 100, 64, 4096, 7}) {
        const std::vector<float> x = randn(static_cast<size_t>(K), 3.0f), w = randn(static_cast<size_t>(K));
        std::vector<float> a(static_cast<size_t>(K)), b(static_cast<size_t>(K));
        ref.rmsnorm(x.data(), w.data(), K, 1e-5f, a.data());
        t.rmsnorm(x.data(), w.data(), K, 1e-5f, b.data());
        if (!same(a, b)) fail(name + " rmsnorm K=" + std::to_string(K));
        for (int64_t g : {K, K % 32 == 0 ? int64_t{32} : K}) {
            std::vector<int8_t> qa(static_cast<size_t>(K)), qb(static_cast<size_t>(K));
            std::vector<float> sa(static_cast<size_t>(K / g)), sb(static_cast<size_t>(K / g));
            ref.quant_act(x.data(), K, g, qa.data(), sa.data());
            t.quant_act(x.data(), K, g, qb.data(), sb.data());
            if (!same(qa, qb) || !same(sa, sb)) fail(name + " quant_act K=" + std::to_string(K));
            ref.rmsnorm_quant(x.data(), w.data(), K, 1e-5f, g, qa.data(), sa.data());
            t.rmsnorm_quant(x.data(), w.data(), K, 1e-5f, g, qb.data(), sb.data());
            if (!same(qa, qb) || !same(sa, sb)) fail(name + " rmsnorm_quant K=" + std::to_string(K));
            ref.swiglu_quant(x.data(), w.data(), K, g, qa.data(), sa.data());
            t.swiglu_quant(x.data(), w.data(), K, g, qb.data(), sb.data());
            if (!same(qa, qb) || !same(sa, sb)) fail(name + " swiglu_quant K=" + std::to_string(K));
        }
        ref.swiglu(x.data(), w.data(), K, a.data());
        t.swiglu(x.data(), w.data(), K, b.data());
        if (!same(a, b)) fail(name + " swiglu K=" + std::to_string(K));
    }
    // RoPE: 3 heads of 64, in place.
    std::vector<float> x = randn(3 * 64), cs = randn(32), sn = randn(32);
    std::vector<float> a = x, b = x;
    ref.rope(a.data(), 3, 64, 64, cs.data(), sn.data());
    t.rope(b.data(), 3, 64, 64, cs.data(), sn.data());
    if (!same(a, b)) fail(name + " rope");
}

void check_attention(const InferTable& ref, const InferTable& tbl) {
    const int64_t NB = 5, BS = 8, H = 2, D = 64, L = 30;
    std::vector<int32_t> table = {3, 0, 4, 1, 2};
    auto make = [&](std::vector<int8_t>& k, std::vector<float>& ks, std::vector<uint8_t>& v,
                    std::vector<uint16_t>& vs) {
        k.assign(static_cast<size_t>(NB * BS * H * D), 0);
        ks.assign(static_cast<size_t>(NB * BS * H), 0.0f);
        v.assign(static_cast<size_t>(NB * BS * H * D / 2), 0);
        vs.assign(static_cast<size_t>(NB * BS * H * D / 32), 0);
        KvCache kv;
        kv.n_blocks = NB;
        kv.block_size = BS;
        kv.n_kv_heads = H;
        kv.head_dim = D;
        kv.k = k.data();
        kv.k_scale = ks.data();
        kv.v = v.data();
        kv.v_scale = vs.data();
        kv.table = table.data();
        kv.table_len = NB;
        return kv;
    };
    std::vector<int8_t> k1, k2;
    std::vector<float> ks1, ks2;
    std::vector<uint8_t> v1, v2;
    std::vector<uint16_t> vs1, vs2;
    const KvCache c1 = make(k1, ks1, v1, vs1), c2 = make(k2, ks2, v2, vs2);
    const std::vector<float> kx = randn(static_cast<size_t>(L * H * D)), vx = randn(static_cast<size_t>(L * H * D));
    for (int64_t p = 0; p < L; ++p) {
        ref.kv_write(c1, p, kx.data() + p * H * D, D, vx.data() + p * H * D, D);
        tbl.kv_write(c2, p, kx.data() + p * H * D, D, vx.data() + p * H * D, D);
    }
    if (!same(k1, k2) || !same(ks1, ks2) || !same(v1, v2) || !same(vs1, vs2)) fail(std::string(tbl.name) + " kv_write");
    const std::vector<float> q = randn(static_cast<size_t>(6 * D));
    std::vector<float> o1(static_cast<size_t>(6 * D)), o2(static_cast<size_t>(6 * D)), sc(static_cast<size_t>(AttnScratch(6, L, D).total));
    auto tile = [&](int64_t nq) {  // nq queries (3 per kv head beyond one) over L - 1 positions
        AttnTile t;
        t.q = q.data();
        t.qstride = 3 * D;
        t.ostride = 3 * D;
        t.nq = nq;
        t.per = nq == 1 ? 1 : 3;
        t.L0 = L - 1;
        t.scale = 0.125f;
        return t;
    };
    for (int64_t h = 0; h < H; ++h) {
        for (int64_t nq : {1, 3, 6}) {
            AttnTile t = tile(nq);
            t.out = o1.data();
            ref.attn_heads(c1, h, t, sc.data());
            t.out = o2.data();
            tbl.attn_heads(c1, h, t, sc.data());
            if (!same(o1, o2)) fail(std::string(tbl.name) + " attn_heads nq=" + std::to_string(nq));
        }
    }
    // the float16-K-scale layouts: int5 V in groups of 32 ("int8-v5"), int6 V per head ("int8")
    for (const bool v6 : {false, true}) {
        const int64_t g = v6 ? D : 32, G = D / g;
        struct K16 {
            std::vector<int8_t> k;
            std::vector<uint16_t> ks, vs16, vm;
            std::vector<uint8_t> v, vh, vs8;
        } a[2];
        KvCache c[2];
        for (int i = 0; i < 2; ++i) {
            a[i].k.assign(static_cast<size_t>(NB * BS * H * D), 0);
            a[i].ks.assign(static_cast<size_t>(NB * BS * H), 0);
            a[i].v.assign(static_cast<size_t>(NB * BS * H * D / 2), 0);
            a[i].vh.assign(static_cast<size_t>(NB * BS * H * D / (v6 ? 4 : 8)), 0);
            a[i].vs16.assign(static_cast<size_t>(NB * BS * H * G), 0);
            a[i].vs8.assign(static_cast<size_t>(NB * BS * H * G), 0);
            a[i].vm.assign(static_cast<size_t>(NB * BS * H * G), 0);
            KvCache& kv = c[i];
            kv.n_blocks = NB;
            kv.block_size = BS;
            kv.n_kv_heads = H;
            kv.head_dim = D;
            kv.v_group = g;
            kv.v5 = !v6;
            kv.v6 = v6;
            kv.k = a[i].k.data();
            kv.k_scale16 = a[i].ks.data();
            kv.v = a[i].v.data();
            kv.v_high = a[i].vh.data();
            kv.v_min = a[i].vm.data();
            if (v6) {
                kv.v_scale = a[i].vs8.data();
            } else {
                kv.v_scale = a[i].vs16.data();
            }
            kv.table = table.data();
            kv.table_len = NB;
        }
        const std::string what = std::string(tbl.name) + (v6 ? " int6 V" : " int5 V");
        for (int64_t p = 0; p < L; ++p) {
            ref.kv_write(c[0], p, kx.data() + p * H * D, D, vx.data() + p * H * D, D);
            tbl.kv_write(c[1], p, kx.data() + p * H * D, D, vx.data() + p * H * D, D);
        }
        if (!same(a[0].k, a[1].k) || !same(a[0].ks, a[1].ks) || !same(a[0].v, a[1].v) || !same(a[0].vh, a[1].vh) ||
            !same(a[0].vs16, a[1].vs16) || !same(a[0].vs8, a[1].vs8) || !same(a[0].vm, a[1].vm)) {
            fail(what + " kv_write");
        }
        for (int64_t h = 0; h < H; ++h) {
            for (int64_t nq : {1, 3, 6}) {
                AttnTile t = tile(nq);
                t.window = nq == 3 ? 9 : 0;
                t.softcap = nq == 6 ? 2.0f : 0.0f;
                t.out = o1.data();
                ref.attn_heads(c[0], h, t, sc.data());
                t.out = o2.data();
                tbl.attn_heads(c[0], h, t, sc.data());
                if (!same(o1, o2)) fail(what + " attn_heads nq=" + std::to_string(nq));
            }
        }
    }
}

struct QW {
    std::vector<int8_t> c8;
    std::vector<uint8_t> c4;
    std::vector<float> s8;
    std::vector<uint16_t> s16, z16;
    WeightView v;
};

QW make_weight(WEnc enc, int64_t N, int64_t K, int64_t gw) {
    QW w;
    std::uniform_int_distribution<int> b(-128, 127), u(0, 255);
    w.v.enc = enc;
    w.v.N = N;
    w.v.K = K;
    if (enc == WEnc::i8) {
        w.c8.resize(static_cast<size_t>(N * K));
        for (auto& c : w.c8) c = static_cast<int8_t>(b(gen));
        w.s8 = randn(static_cast<size_t>(N), 0.01f);
        for (float& s : w.s8) s = std::fabs(s);
        w.v.codes = w.c8.data();
        w.v.scales_f32 = w.s8.data();
        w.v.group = K;
    } else {
        w.c4.resize(static_cast<size_t>(N * K / 2));
        for (auto& c : w.c4) c = static_cast<uint8_t>(u(gen));
        for (float s : randn(static_cast<size_t>(N * K / gw), 0.01f)) w.s16.push_back(f32_to_f16(s));
        for (float s : randn(static_cast<size_t>(N * K / gw), 0.1f)) w.z16.push_back(f32_to_f16(s));
        w.v.codes = w.c4.data();
        w.v.scales_f16 = w.s16.data();
        w.v.zeros_f16 = enc == WEnc::i4asym ? w.z16.data() : nullptr;
        w.v.group = gw;
    }
    return w;
}

void check_matmul(const InferTable& ref, const InferTable& t) {
    const std::string name = t.name;
    const bool exact_table = name == "neon" || name == "avx512" || name == "amx" || name == "scalar";
    struct Case {
        WEnc enc;
        int64_t N, K, gw, ga;
    };
    const Case cases[] = {
        {WEnc::i8, 37, 576, 0, 576},     {WEnc::i8, 21, 576, 0, 32},       {WEnc::i4sym, 37, 576, 32, 576},
        {WEnc::i4sym, 21, 1536, 64, 32}, {WEnc::i4asym, 37, 576, 32, 576}, {WEnc::i4asym, 21, 1024, 128, 64},
    };
    std::uniform_int_distribution<int> xb(-127, 127);
    for (const Case& c : cases) {
        const QW w = make_weight(c.enc, c.N, c.K, c.gw);
        for (int64_t T : {1, 3, 6, 17}) {
            std::vector<int8_t> xq(static_cast<size_t>(T * c.K));
            for (auto& v : xq) v = static_cast<int8_t>(xb(gen));
            std::vector<float> xs = randn(static_cast<size_t>(T * (c.K / c.ga)), 0.02f);
            ActQ8 x;
            x.T = T;
            x.K = c.K;
            x.group = c.ga;
            x.q = xq.data();
            x.s = xs.data();
            std::vector<float> ya(static_cast<size_t>(T * c.N)), yb(static_cast<size_t>(T * c.N));
            GemmOut oa, ob;
            oa.y = ya.data();
            oa.ldy = c.N;
            ob.y = yb.data();
            ob.ldy = c.N;
            ref.q8_gemm(w.v, x, 0, c.N, oa);
            std::vector<uint8_t> prep(static_cast<size_t>(T * t.q8_prep_bytes(w.v, c.ga) + 64));
            x.prep = prep.data();
            x.prep_stride = t.q8_prep_bytes(w.v, c.ga);
            t.q8_prep(w.v, x, 0, T);
            t.q8_gemm(w.v, x, 0, c.N, ob);
            float ymax = 0.0f;
            for (float v : ya) ymax = std::fmax(ymax, std::fabs(v));
            for (size_t i = 0; i < ya.size(); ++i) {
                // amx: the tile GEMM (always from 16 tokens on) is exact; below its
                // threshold it runs avx512's kernels
                const bool exact = exact_table;
                const bool ok = exact ? std::memcmp(&ya[i], &yb[i], 4) == 0
                                      : std::fabs(ya[i] - yb[i]) <= 1e-4f * ymax;
                if (!ok) {
                    fail(name + " q8_gemm enc=" + std::to_string(static_cast<int>(c.enc)) + " T=" + std::to_string(T) +
                         " got " + std::to_string(yb[i]) + " want " + std::to_string(ya[i]));
                    break;
                }
            }
            // float-activation path on the same weights
            std::vector<float> xf = randn(static_cast<size_t>(T * c.K));
            ActF32 af;
            af.T = T;
            af.K = c.K;
            af.x = xf.data();
            ref.f32_gemm(w.v, af, 0, c.N, oa);
            t.f32_gemm(w.v, af, 0, c.N, ob);
            ymax = 0.0f;
            for (float v : ya) ymax = std::fmax(ymax, std::fabs(v));
            for (size_t i = 0; i < ya.size(); ++i) {
                if (std::fabs(ya[i] - yb[i]) > 1e-4f * ymax) {
                    fail(name + " f32_gemm enc=" + std::to_string(static_cast<int>(c.enc)));
                    break;
                }
            }
        }
    }
}

// The LoRA up-projection: bit-identical to the reference for int8 and float B^T, over
// output ranges that start and end off the vector width.
void check_lora_up(const InferTable& ref, const InferTable& t) {
    const std::string name = t.name;
    for (int64_t r : {16, 1, 5}) {
        for (int64_t N : {576, 192, 37}) {
            const std::vector<float> h = randn(static_cast<size_t>(r)), bf = randn(static_cast<size_t>(r * N));
            const std::vector<float> sc = randn(static_cast<size_t>(N), 0.01f), y0 = randn(static_cast<size_t>(N));
            std::vector<int8_t> bq(static_cast<size_t>(r * N));
            for (size_t i = 0; i < bq.size(); ++i) bq[i] = static_cast<int8_t>(static_cast<int>(bf[i] * 40.0f) % 128);
            for (bool i8 : {true, false}) {
                LoraUp b;
                b.codes = i8 ? static_cast<const void*>(bq.data()) : static_cast<const void*>(bf.data());
                b.scales = i8 ? sc.data() : nullptr;
                b.r = r;
                b.N = N;
                std::vector<float> ya = y0, yb = y0;
                ref.lora_up(b, h.data(), 0, N, ya.data());
                t.lora_up(b, h.data(), 3, N / 2, yb.data());
                t.lora_up(b, h.data(), 0, 3, yb.data());
                t.lora_up(b, h.data(), N / 2, N, yb.data());
                if (!same(ya, yb)) fail(name + " lora_up r=" + std::to_string(r) + " N=" + std::to_string(N) + (i8 ? " int8" : " f32"));
            }
        }
    }
}

}  // namespace

int main() {
    const InferTable& ref = scalar_infer_table();
    std::vector<const InferTable*> tables = {&ref};
#if defined(EDGEPACK_HAVE_NEON)
    tables.push_back(&neon_infer_table());
#endif
#if defined(EDGEPACK_HAVE_AVX2)
    tables.push_back(&avx2_infer_table());
#endif
#if defined(EDGEPACK_HAVE_AVX512)
    tables.push_back(&avx512_infer_table());
#endif
#if defined(EDGEPACK_HAVE_AMX)
    // The process's permission for the tile state (ARCH_REQ_XCOMP_PERM, XTILEDATA), as
    // dispatch.cpp asks for it; without it the table is skipped.
    if (syscall(SYS_arch_prctl, 0x1023, 18) == 0) tables.push_back(&amx_infer_table());
#endif
    for (const InferTable* t : tables) {
        check_rows(ref, *t);
        check_attention(ref, *t);
        check_matmul(ref, *t);
        check_lora_up(ref, *t);
        std::printf("%s: %s\n", t->name, failures ? "FAILED" : "ok");
    }
    return failures ? 1 : 0;
}
